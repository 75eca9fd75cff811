"""RL weight updates: trainer ranks write new weights straight into inference ranks' memory.

After each training step the training fleet pushes its weights to the inference fleet with
one-sided writes, as fast as the NICs allow, with no rank-0 funnel and no collective across
the two fleets:

* **metadata** (``FleetSpec``): each fleet names every parameter (global shape, dtype) and how
  it shards it (``Replicated``, ``FsdpShard``, ``TensorParallel`` rows/columns,
  ``ExpertPlacement``); each rank packs its pieces in one buffer (``LocalLayout``);
* **plan** (``make_plan`` → ``TransferPlan``): computed once from both fleets' metadata, a
  static list of byte-range writes (coalesced, balanced over source replicas and NICs, with
  the dtype casts made at the source); serializable, inspectable (``explain``), replayed
  every step;
* **execution**: ``WeightsSender.send_step(step)`` at each trainer rank writes its rows
  (casts through a bounded staging pool, pipelined); ``WeightsReceiver.wait_step(step)`` at
  each inference rank fences "weights landed" on one counter per source;
* **failure**: ``StepFailed`` (``StepPeerLost``, ``StepTimeout``) on every affected rank.

The imm scheme is in ``fabric_apps.weights.imms``; setup through a ``torch.distributed``
Store in ``WeightsSender.connect`` / ``WeightsReceiver.connect``.
"""

from __future__ import annotations

from ._staging import StagingPool
from .errors import StepFailed, StepPeerLost, StepTimeout
from .imms import DEFAULT_IMM_BASE, ImmScheme
from .plan import PlanBalance, PlanEntry, PlanOptions, TransferPlan, make_plan
from .receiver import ReceiveReport, WeightsReceiver
from .sender import SendReport, WeightsSender
from .spec import (
    DType,
    ExpertPlacement,
    FleetSpec,
    FsdpShard,
    LayoutEntry,
    LocalLayout,
    ParamSpec,
    Replicated,
    Sharding,
    TensorParallel,
    tp_column,
    tp_row,
)

__all__ = [
    # metadata
    "DType",
    "ExpertPlacement",
    "FleetSpec",
    "FsdpShard",
    "LayoutEntry",
    "LocalLayout",
    "ParamSpec",
    "Replicated",
    "Sharding",
    "TensorParallel",
    "tp_column",
    "tp_row",
    # the plan
    "PlanBalance",
    "PlanEntry",
    "PlanOptions",
    "TransferPlan",
    "make_plan",
    "DEFAULT_IMM_BASE",
    "ImmScheme",
    # the two sides
    "ReceiveReport",
    "SendReport",
    "StagingPool",
    "WeightsReceiver",
    "WeightsSender",
    # errors
    "StepFailed",
    "StepPeerLost",
    "StepTimeout",
]
