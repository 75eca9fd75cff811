"""Routing arithmetic shared by the fabric path, the collectives baseline and the reference:
input checks, which ranks a token goes to, grouping received tokens by local expert, and
the combine's weighted sum (the definition every implementation reproduces bitwise)."""

from __future__ import annotations

import logging

import torch

from fabric_core.errors import ConfigError

from .config import MoeConfig
from .result import DispatchResult

__all__ = [
    "check_inputs",
    "destinations",
    "group_received",
    "local_index_table",
    "origin_pair_order",
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
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= config.num_experts:
            raise ConfigError(
                f"topk_idx holds {lo if lo < -1 else hi}: ids must be in [-1, {config.num_experts})"
            )
        s = idx.sort(dim=1).values
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
    however many of its experts q owns), and the rank of each (t, k) slot (-1: none)."""
    t = int(idx.shape[0])
    valid = idx >= 0
    pair_rank = torch.where(valid, config.rank_table()[idx.clamp(min=0)], torch.full_like(idx, -1))
    mask = torch.zeros(t, config.world_size, dtype=torch.bool)
    tt, kk = valid.nonzero(as_tuple=True)
    mask[tt, pair_rank[tt, kk]] = True
    return mask, pair_rank


def local_index_table(config: MoeConfig, rank: int) -> torch.Tensor:
    """int64 ``[E]``: position of each expert among ``rank``'s local experts, -1 elsewhere."""
    table = torch.full((config.num_experts,), -1, dtype=torch.int64)
    local = config.local_experts(rank)
    if local:
        table[torch.tensor(local, dtype=torch.int64)] = torch.arange(len(local), dtype=torch.int64)
    return table


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
    token, k) order inside each expert.
    """
    local = local_index_table(config, rank)
    li = torch.where(ids >= 0, local[ids.clamp(min=0)], torch.full_like(ids, -1))
    m, k = (li >= 0).nonzero(as_tuple=True)  # row-major: (record, k) ascending
    le = li[m, k]
    order = torch.argsort(le, stable=True)
    m, k, le = m[order], k[order], le[order]
    experts = config.local_experts(rank)
    return DispatchResult(
        tokens=hidden.index_select(0, rows[m].to(hidden.device)),  # the records may live on a GPU
        expert_counts=torch.bincount(le, minlength=len(experts)),
        experts=experts,
        src_rank=src_rank[m],
        src_token=src_token[m],
        src_k=k,
        tokens_per_source=tokens_per_source,
    )


def origin_pair_order(config: MoeConfig, idx: torch.Tensor, dest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, k)`` of the slots of ``idx`` that rank ``dest`` serves, in the order ``dest``'s
    ``DispatchResult`` lists them for this origin: by expert id, then token, then k."""
    valid = idx >= 0
    owner = torch.where(valid, config.rank_table()[idx.clamp(min=0)], torch.full_like(idx, -1))
    t, k = (owner == dest).nonzero(as_tuple=True)
    order = torch.argsort(idx[t, k], stable=True)
    return t[order], k[order]


def weighted_sum(
    y: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The combine: ``out[t] = sum over k = 0..K-1 with idx[t, k] >= 0 of
    float32(weights[t, k]) * float32(y[t, k])``, accumulated in float32 from zero in
    ascending k (one multiply, then one add per slot, never fused), cast to ``dtype`` once.

    ``y`` is ``[T, K, H]``; slots with ``idx < 0`` are skipped (whatever they hold).
    """
    t, k_count = int(idx.shape[0]), int(idx.shape[1])
    acc = torch.zeros(t, int(y.shape[2]), dtype=torch.float32, device=y.device)
    w = weights.to(y.device, torch.float32)
    valid = (idx >= 0).to(y.device)
    for k in range(k_count):
        contrib = y[:, k, :].to(torch.float32) * w[:, k : k + 1]
        acc = torch.where(valid[:, k : k + 1], acc + contrib, acc)
    return acc.to(dtype)
