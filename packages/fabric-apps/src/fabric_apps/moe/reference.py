"""A single-process reference of dispatch and combine, in plain torch with explicit loops.

It is written independently of the fabric path and of the collectives baseline (token by
token, slot by slot) so that both can be checked against it bitwise:

* ``reference_dispatch``: every rank's ``DispatchResult`` from every rank's inputs;
* ``reference_combine``: every rank's combined output from the dispatch results and the
  experts' outputs (the data path of the combine);
* ``reference_moe``: the whole layer from an expert function, without any grouping.

An *expert function* ``expert_fn(expert, rows) -> rows`` maps ``[n, H]`` to ``[n, H]`` and
must treat each row on its own (no reduction across rows), so applying it to a token alone
or inside a batch gives the same bits; ``apply_experts`` runs it over a ``DispatchResult``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from fabric_core.errors import ConfigError

from ._routing import check_inputs
from .config import MoeConfig
from .result import DispatchResult

__all__ = ["ExpertFn", "apply_experts", "reference_combine", "reference_dispatch", "reference_moe"]

logger = logging.getLogger(__name__)

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``(global expert id, [n, H] rows) -> [n, H] rows``, row by row."""


def _check_world(
    config: MoeConfig, xs: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    w = config.world_size
    if not len(xs) == len(idxs) == len(ws) == w:
        raise ConfigError(f"pass one input per rank ({w}), got {len(xs)}, {len(idxs)}, {len(ws)}")
    return [check_inputs(config.for_rank(r), xs[r], idxs[r], ws[r]) for r in range(w)]


def reference_dispatch(
    config: MoeConfig, xs: Sequence[torch.Tensor], topk_idx: Sequence[torch.Tensor]
) -> list[DispatchResult]:
    """What each rank receives: ``xs[r]`` and ``topk_idx[r]`` are rank r's inputs."""
    w = config.world_size
    inputs = _check_world(config, xs, topk_idx, [torch.zeros(i.shape) for i in topk_idx])
    results = []
    for q in range(w):
        experts = config.local_experts(q)
        position = {e: j for j, e in enumerate(experts)}
        buckets: list[list[tuple[int, int, int]]] = [[] for _ in experts]
        per_source = [0] * w
        for r in range(w):
            _x, idx, _w = inputs[r]
            for t in range(int(idx.shape[0])):
                hit = False
                for k in range(config.top_k):
                    e = int(idx[t, k])
                    if e >= 0 and config.expert_rank(e) == q:
                        buckets[position[e]].append((r, t, k))
                        hit = True
                per_source[r] += hit
        flat = [entry for bucket in buckets for entry in bucket]
        rows = [inputs[r][0][t] for r, t, _k in flat]
        results.append(
            DispatchResult(
                tokens=torch.stack(rows) if rows else torch.empty(0, config.hidden, dtype=config.dtype),
                expert_counts=torch.tensor([len(b) for b in buckets], dtype=torch.int64),
                experts=experts,
                src_rank=torch.tensor([r for r, _t, _k in flat], dtype=torch.int64),
                src_token=torch.tensor([t for _r, t, _k in flat], dtype=torch.int64),
                src_k=torch.tensor([k for _r, _t, k in flat], dtype=torch.int64),
                tokens_per_source=torch.tensor(per_source, dtype=torch.int64),
            )
        )
    return results


def _combine_token(
    config: MoeConfig, outputs: dict[int, torch.Tensor], idx: torch.Tensor, w: torch.Tensor, t: int
) -> torch.Tensor:
    """One token's combine, slot by slot (the definition ``weighted_sum`` vectorises)."""
    acc = torch.zeros(config.hidden, dtype=torch.float32)
    for k in range(config.top_k):
        if int(idx[t, k]) >= 0:
            acc = acc + outputs[k].to(torch.float32) * w[t, k]
    return acc.to(config.dtype)


def reference_combine(
    config: MoeConfig,
    results: Sequence[DispatchResult],
    expert_outputs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """Each origin's output: row i of rank q's ``expert_outputs[q]`` goes back to slot
    ``(src_token[i], src_k[i])`` of rank ``src_rank[i]``, which sums its slots."""
    w = config.world_size
    if not len(results) == len(expert_outputs) == w:
        raise ConfigError(f"pass one result and one output per rank ({w})")
    slots: list[dict[int, dict[int, torch.Tensor]]] = [{} for _ in range(w)]
    for q in range(w):
        res, out = results[q], expert_outputs[q]
        for i in range(res.num_rows):
            r, t, k = int(res.src_rank[i]), int(res.src_token[i]), int(res.src_k[i])
            if k in slots[r].setdefault(t, {}):
                raise ConfigError(f"slot ({t}, {k}) of rank {r} is returned twice")
            slots[r][t][k] = out[i]
    combined = []
    for r in range(w):
        idx = topk_idx[r].to(torch.int64)
        wt = topk_weights[r].to(torch.float32)
        rows = [_combine_token(config, slots[r].get(t, {}), idx, wt, t) for t in range(int(idx.shape[0]))]
        combined.append(torch.stack(rows) if rows else torch.empty(0, config.hidden, dtype=config.dtype))
    return combined


def reference_moe(
    config: MoeConfig,
    xs: Sequence[torch.Tensor],
    topk_idx: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    expert_fn: ExpertFn,
) -> list[torch.Tensor]:
    """The whole layer per rank, token by token: ``sum_k w[t, k] * expert_fn(idx[t, k], x[t])``
    in ascending k, in float32, cast to ``config.dtype``."""
    out = []
    for x, idx, w in _check_world(config, xs, topk_idx, topk_weights):
        rows = []
        for t in range(int(x.shape[0])):
            outputs = {
                k: expert_fn(int(idx[t, k]), x[t : t + 1])[0]
                for k in range(config.top_k)
                if int(idx[t, k]) >= 0
            }
            rows.append(_combine_token(config, outputs, idx, w, t))
        out.append(torch.stack(rows) if rows else torch.empty(0, config.hidden, dtype=config.dtype))
    return out


def apply_experts(result: DispatchResult, expert_fn: ExpertFn) -> torch.Tensor:
    """Run ``expert_fn`` on each expert's block of ``result``: the ``expert_outputs`` to pass
    to ``combine_send`` (same row order)."""
    blocks = [
        expert_fn(e, result.expert_block(j))
        for j, e in enumerate(result.experts)
        if int(result.expert_counts[j])
    ]
    if not blocks:
        return torch.empty_like(result.tokens)
    return torch.cat(blocks)
