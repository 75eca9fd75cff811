"""Expert-parallel MoE dispatch and combine on the fabric contract, without collectives.

Each rank owns ``E / W`` experts (``MoeConfig``). ``MoeAllToAll`` sends every token once to
each rank that owns at least one of its experts and brings the experts' outputs back to the
token's origin, which forms the top-k weighted sum in a fixed order (``weighted_sum``):

* counts first, one small write per destination carrying an imm, then the tokens with
  paged WriteImm into receive buffers registered once, at offsets fixed by the layout (each
  receiver keeps one slot of ``max_tokens`` records per source rank), so no round trip;
* every wait expects exactly the work requests the contract's counting rule gives, per
  source rank, with an imm that names layer, step parity, phase and source (``imms``);
* send and receive halves are separate calls.

``reference`` is a single-process reference (plain torch) and ``baseline`` the same
exchange over ``torch.distributed.all_to_all_single``, for comparison. The protocol is in
``docs/apps/moe.md``.
"""

from __future__ import annotations

from ._routing import weighted_sum
from .alltoall import DEFAULT_TIMEOUT_S, MoeAllToAll
from .config import MAX_WORLD_SIZE, MoeConfig
from .endpoint import MoeEndpoint
from .errors import MoeProtocolError, MoeStateError, StepAborted
from .imms import IMM_TAG, MAX_LAYER, ImmFields, Phase, decode_imm, moe_imm
from .reference import ExpertFn, apply_experts, reference_combine, reference_dispatch, reference_moe
from .result import DispatchResult

__all__ = [
    # config and the two halves
    "DEFAULT_TIMEOUT_S",
    "MAX_WORLD_SIZE",
    "DispatchResult",
    "MoeAllToAll",
    "MoeConfig",
    "MoeEndpoint",
    "weighted_sum",
    # imms
    "IMM_TAG",
    "MAX_LAYER",
    "ImmFields",
    "Phase",
    "decode_imm",
    "moe_imm",
    # reference
    "ExpertFn",
    "apply_experts",
    "reference_combine",
    "reference_dispatch",
    "reference_moe",
    # errors
    "MoeProtocolError",
    "MoeStateError",
    "StepAborted",
]
