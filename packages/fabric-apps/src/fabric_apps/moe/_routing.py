"""Routing arithmetic shared by the fabric path, the collectives baseline and the reference:
input checks, which ranks a token goes to, grouping received tokens by local expert, and
the combine's weighted sum (the definition every implementation reproduces bitwise)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from fabric_core.errors import ConfigError

from .config import MoeConfig
from .result import DispatchResult

__all__ = [
    "check_inputs",
    "destinations",
    "group_received",
    "local_index_table",
    "combine_positions",
    "weighted_sum",
]

logger = logging.getLogger(__name__)


def check_inputs(
    config: MoeConfig, x: object, topk_idx: object, topk_weights: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate one rank's inputs; returns (x, int64 CPU indices, float32 CPU weights).

    ``x`` is ``[T, H]`` in ``config.dtype`` with ``T <= max_tokens`` (``T == 0`` is a rank
    with no tokens); ``topk_idx`` is ``[T, K]`` of expert ids, ``-1`` meaning "no expert"
    (that slot is skipped in the combine); an id may appear once per row.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or int(x.shape[1]) != config.hidden:
        raise ConfigError(f"x must be a [T, {config.hidden}] tensor, got {_shape(x)}")
    t = int(x.shape[0])
    if t > config.max_tokens:
        raise ConfigError(f"x has {t} tokens but max_tokens is {config.max_tokens}")
    if x.dtype != config.dtype:
        raise ConfigError(f"x has dtype {x.dtype}, the layer's dtype is {config.dtype}")
    k = config.top_k
    if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (t, k):
        raise ConfigError(f"topk_idx must be a [{t}, {k}] tensor, got {_shape(topk_idx)}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise ConfigError(f"topk_idx must hold integers, got {topk_idx.dtype}")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (t, k):
        raise ConfigError(f"topk_weights must be a [{t}, {k}] tensor, got {_shape(topk_weights)}")
    if not topk_weights.dtype.is_floating_point:
        raise ConfigError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    idx = topk_idx.detach().to("cpu", torch.int64)
    if t:
        a = idx.numpy()  # the checks in numpy: a few microseconds each, a torch call ten or more
        lo, hi = int(a.min()), int(a.max())
        if lo < -1 or hi >= config.num_experts:
            raise ConfigError(
                f"topk_idx holds {lo if lo < -1 else hi}: ids must be in [-1, {config.num_experts})"
            )
        s = np.sort(a, axis=1)
        if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
            raise ConfigError("topk_idx names an expert twice in one token's row")
    w = topk_weights.detach().to("cpu", torch.float32)
    return x, idx, w


def _shape(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"shape {list(obj.shape)}"
    return type(obj).__name__


def destinations(config: MoeConfig, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [T, W] bool, pair_rank [T, K] int64)``: whether token t goes to rank q (once,
    however many of its experts q owns), and the rank of each (t, k) slot (-1: none).
    ``idx`` is a CPU int64 tensor (as ``check_inputs`` returns it)."""
    a = idx.numpy()
    valid = a >= 0
    pair_rank = np.where(valid, config.owner_array()[np.maximum(a, 0)], -1)
    mask = np.zeros((a.shape[0], config.world_size), dtype=np.bool_)
    tt, kk = np.nonzero(valid)
    mask[tt, pair_rank[tt, kk]] = True
    return torch.from_numpy(mask), torch.from_numpy(pair_rank)


def _local_index(config: MoeConfig, rank: int) -> tuple[np.ndarray[Any, np.dtype[np.int64]], tuple[int, ...]]:
    """(position of each expert among ``rank``'s local experts, -1 elsewhere; those experts'
    global ids, ascending), both from the owner table."""
    owner = config.owner_array()
    mine = np.flatnonzero(owner == rank)
    table = np.full(owner.shape, -1, dtype=np.int64)
    table[mine] = np.arange(mine.size, dtype=np.int64)
    return table, tuple(mine.tolist())


def local_index_table(config: MoeConfig, rank: int) -> torch.Tensor:
    """int64 ``[E]``: position of each expert among ``rank``'s local experts, -1 elsewhere."""
    return torch.from_numpy(_local_index(config, rank)[0])


def group_received(
    config: MoeConfig,
    rank: int,
    src_rank: torch.Tensor,
    src_token: torch.Tensor,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    tokens_per_source: torch.Tensor,
) -> DispatchResult:
    """Group received records by ``rank``'s local experts.

    Record ``m`` came from ``src_rank[m]`` (its token ``src_token[m]``, routed to the global
    expert ids ``ids[m]``) and its hidden state is ``hidden[rows[m]]``. Records must be in
    (source rank, source token) order; the result's blocks are then in (source rank, source
    token, k) order inside each expert. The index tensors are CPU int64; ``hidden`` may live
    on a GPU (one gather runs there).
    """
    local, experts = _local_index(config, rank)
    e = ids.numpy()
    li = np.where(e >= 0, local[np.maximum(e, 0)], -1)
    m, k = np.nonzero(li >= 0)  # row-major: (record, k) ascending
    le = li[m, k]
    order = np.argsort(le, kind="stable")
    m, k, le = m[order], k[order], le[order]
    picked = torch.from_numpy(rows.numpy()[m])
    return DispatchResult(
        tokens=hidden.index_select(0, picked.to(hidden.device)),  # the records may live on a GPU
        expert_counts=torch.from_numpy(np.bincount(le, minlength=len(experts)).astype(np.int64, copy=False)),
        experts=experts,
        src_rank=torch.from_numpy(src_rank.numpy()[m]),
        src_token=torch.from_numpy(src_token.numpy()[m]),
        src_k=torch.from_numpy(k.astype(np.int64, copy=False)),
        tokens_per_source=tokens_per_source,
    )


def combine_positions(config: MoeConfig, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the combine brings back each ``(t, k)`` slot of ``idx``: ``(pos [T, K] int64,
    pairs [W] int64)``. The origin's combine rows are packed by serving rank, ascending; rank
    ``q``'s ``pairs[q]`` rows start at ``sum(pairs[:q])`` and come in the order ``q``'s
    ``DispatchResult`` lists this origin's rows: by expert id, then token (a token names an
    expert at most once). ``pos[t, k]`` is that slot's row; 0 for ``idx < 0`` (never read).
    ``idx`` is a CPU int64 tensor."""
    flat = idx.numpy().reshape(-1)
    valid = np.flatnonzero(flat >= 0)  # (t, k) row-major
    experts = flat[valid]
    owner = config.owner_array()[experts]
    order = valid[np.argsort(owner * config.num_experts + experts, kind="stable")]
    pos = np.zeros(flat.size, dtype=np.int64)
    pos[order] = np.arange(order.size, dtype=np.int64)
    pairs = np.bincount(owner, minlength=config.world_size).astype(np.int64, copy=False)
    return torch.from_numpy(pos).view(idx.shape), torch.from_numpy(pairs)


def weighted_sum(
    y: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The combine: ``out[t] = sum over k = 0..K-1 with idx[t, k] >= 0 of
    float32(weights[t, k]) * float32(y[t, k])``, accumulated in float32 from zero in
    ascending k (one multiply, then one add per slot, never fused), cast to ``dtype`` once.

    ``y`` is ``[T, K, H]``; slots with ``idx < 0`` are skipped (whatever they hold).
    """
    t, k_count, h = int(idx.shape[0]), int(idx.shape[1]), int(y.shape[2])
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    valid = (idx >= 0).to(y.device)
    # a skipped slot contributes (+0) * (+0): adding +0 leaves every acc bit unchanged (acc is
    # never -0: it starts at +0, and round-to-nearest sums to -0 only from two -0s)
    w = torch.where(valid, weights.to(y.device, torch.float32), 0.0)
    some_skipped = not bool(valid.all())
    step = max(1, _SUM_BLOCK // max(1, k_count * h))  # tokens per block: bounded float32 scratch
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        prod = y[lo:hi].to(torch.float32, copy=True)  # [b, K, H], never a view of y
        if some_skipped:
            prod.masked_fill_(~valid[lo:hi, :, None], 0.0)  # whatever a skipped slot holds
        prod.mul_(w[lo:hi, :, None])  # every product rounded on its own, as before any sum
        block = acc[lo:hi]
        for k in range(k_count):
            block.add_(prod[:, k])
    return acc.to(dtype)


_SUM_BLOCK = 1 << 23  # float32 elements of weighted_sum's scratch (32 MiB)
