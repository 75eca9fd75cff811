"""``MoeConfig``: the shape of one expert-parallel MoE layer, as one rank sees it.

Every rank of a layer holds the same config except ``rank``. It fixes the buffers (sized for
the worst case once, registered once) and the record format of the wire, so two ranks whose
configs differ in anything but ``rank`` refuse to connect.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fabric_core.errors import ConfigError

__all__ = ["MAX_WORLD_SIZE", "MoeConfig"]

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1024
"""Ranks one layer can span: the imm carries the source rank in 10 bits (``imms``)."""

_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
_ALIGN = 16


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """One rank's view of an expert-parallel MoE layer.

    ``world_size`` ranks (W) hold ``num_experts`` experts (E); each rank feeds at most
    ``max_tokens`` tokens (T_max) of ``hidden`` (H) values in ``dtype`` and routes each to
    ``top_k`` (K) experts. ``placement`` maps expert ``e`` to the rank that owns it; ``None``
    is the contiguous placement (rank ``r`` owns experts ``[r * E/W, (r + 1) * E/W)``, which
    needs ``E % W == 0``). A rank's *local experts* are the experts it owns in ascending id.
    ``device`` is where the buffers live (the engine must be able to register it).
    """

    world_size: int
    rank: int
    num_experts: int
    hidden: int
    top_k: int
    max_tokens: int
    dtype: torch.dtype = torch.bfloat16
    placement: tuple[int, ...] | None = None
    device: str = "cpu"
    _owner: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # the same placement as a read-only numpy table, made once: the per-step index work of
    # dispatch and combine looks experts up in it (a torch tensor built from the tuple per
    # call cost more than the lookup)
    _owner_np: np.ndarray[Any, np.dtype[np.int64]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        w = _positive("world_size", self.world_size)
        if w > MAX_WORLD_SIZE:
            raise ConfigError(f"world_size {w} exceeds {MAX_WORLD_SIZE} (the imm's 10 source-rank bits)")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < w:
            raise ConfigError(f"rank must be an int in [0, {w}), got {self.rank!r}")
        e = _positive("num_experts", self.num_experts)
        _positive("hidden", self.hidden)
        k = _positive("top_k", self.top_k)
        _positive("max_tokens", self.max_tokens)
        if k > e:
            raise ConfigError(f"top_k {k} exceeds num_experts {e}")
        if self.max_tokens >= 1 << 31:
            raise ConfigError("max_tokens must stay below 2**31 (token indices travel as int32)")
        if e >= 1 << 31:
            raise ConfigError("num_experts must stay below 2**31 (expert ids travel as int32)")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(_DTYPES.values())}, got {self.dtype}")
        if self.placement is None:
            if e % w:
                raise ConfigError(
                    f"contiguous placement needs num_experts ({e}) divisible by world_size ({w}); "
                    "pass placement=(rank of expert 0, rank of expert 1, ...) otherwise"
                )
            owner = tuple(x // (e // w) for x in range(e))
        else:
            owner = tuple(self.placement)
            if len(owner) != e:
                raise ConfigError(f"placement names {len(owner)} experts, num_experts is {e}")
            for x, r in enumerate(owner):
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < w:
                    raise ConfigError(f"placement[{x}] must be a rank in [0, {w}), got {r!r}")
            object.__setattr__(self, "placement", owner)
        object.__setattr__(self, "_owner", owner)
        table = np.array(owner, dtype=np.int64)
        table.flags.writeable = False
        object.__setattr__(self, "_owner_np", table)

    # --- placement ----------------------------------------------------------------
    @property
    def experts_per_rank(self) -> int:
        """E / W (contiguous placement); with an explicit placement, the most any rank owns."""
        return max(self.num_local_experts(r) for r in range(self.world_size))

    def expert_rank(self, expert: int) -> int:
        """The rank that owns ``expert``."""
        return self._owner[expert]

    def local_experts(self, rank: int | None = None) -> tuple[int, ...]:
        """Global ids of the experts ``rank`` (default: this rank) owns, ascending."""
        r = self.rank if rank is None else rank
        return tuple(x for x, o in enumerate(self._owner) if o == r)

    def num_local_experts(self, rank: int | None = None) -> int:
        return len(self.local_experts(rank))

    def rank_table(self) -> torch.Tensor:
        """int64 ``[E]``: the owning rank of each expert (a new tensor)."""
        return torch.tensor(self._owner, dtype=torch.int64)

    def owner_array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """int64 ``[E]``: the owning rank of each expert, as a read-only numpy array (the same
        array every call)."""
        return self._owner_np

    def for_rank(self, rank: int) -> MoeConfig:
        """The same layer seen from ``rank``."""
        return replace(self, rank=rank)

    # --- wire format and buffer sizes ---------------------------------------------
    @property
    def element_size(self) -> int:
        return int(torch.empty((), dtype=self.dtype).element_size())

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's hidden state (one page of a combine write)."""
        return self.hidden * self.element_size

    @property
    def meta_bytes(self) -> int:
        """Header of a dispatch record: int32 source token index and K int32 expert ids,
        padded to 16 bytes."""
        return _round_up(4 * (1 + self.top_k), _ALIGN)

    @property
    def record_bytes(self) -> int:
        """One dispatched token on the wire: header then hidden state, padded to 16 bytes."""
        return _round_up(self.meta_bytes + self.token_bytes, _ALIGN)

    @property
    def max_pairs(self) -> int:
        """Rows a rank can receive in the worst case: every token of every rank routed to
        ``min(K, local experts)`` of its experts (duplicate expert ids are refused)."""
        return self.world_size * self.max_tokens * min(self.top_k, self.num_local_experts())

    def buffer_bytes(self) -> dict[str, int]:
        """Registered bytes per buffer of one rank (what ``MoeAllToAll`` allocates)."""
        w, t, k = self.world_size, self.max_tokens, self.top_k
        return {
            "send_counts": w * 32,
            "recv_counts": w * 32,
            "send_tokens": w * t * self.record_bytes,
            "recv_tokens": w * t * self.record_bytes,
            "send_combine": max(1, self.max_pairs) * self.token_bytes,
            "recv_combine": t * k * self.token_bytes,
        }

    @property
    def dtype_name(self) -> str:
        return _DTYPES[self.dtype]

    def fingerprint(self) -> str:
        """Hash of everything but ``rank`` (and ``device``): equal on every rank of a layer."""
        shape: dict[str, Any] = {
            "world_size": self.world_size,
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "dtype": self.dtype_name,
            "placement": self._owner,
        }
        return hashlib.sha256(repr(sorted(shape.items())).encode()).hexdigest()[:16]
