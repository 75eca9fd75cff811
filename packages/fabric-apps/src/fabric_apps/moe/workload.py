"""Synthetic MoE workloads: seeded inputs for every rank, a row-wise expert, bitwise checks.

The benchmark (``fabric_apps.moe.bench``) and the tests use the same pieces, so a routing
that a test proves exact is the routing the benchmark measures:

* ``random_inputs``: every rank's hidden states, top-k expert ids and weights from one seed
  (any rank can rebuild every other rank's inputs, so no rank needs to receive them to
  compute the reference);
* ``scaled_expert``: an expert function that treats each row on its own;
* ``dispatch_mismatch`` / ``output_mismatch``: ``None`` when two results are the same bits,
  else a sentence naming the first difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fabric_core.errors import ConfigError

from .config import MoeConfig
from .result import DispatchResult

__all__ = ["ROUTINGS", "Inputs", "dispatch_mismatch", "output_mismatch", "random_inputs", "scaled_expert"]

ROUTINGS = ("uniform", "skewed", "masked")
"""``uniform``: each token picks K distinct experts at random; ``skewed``: every token picks
experts 0..K-1, so everything lands on the first rank(s); ``masked``: uniform with about a
quarter of the slots -1 and one token routed nowhere."""


@dataclass
class Inputs:
    """Every rank's inputs for one step: ``xs[r]`` ``[T_r, H]``, ``idxs[r]`` ``[T_r, K]``
    int64, ``ws[r]`` ``[T_r, K]`` float32."""

    xs: list[torch.Tensor]
    idxs: list[torch.Tensor]
    ws: list[torch.Tensor]


def random_inputs(
    config: MoeConfig,
    seed: int,
    tokens: Sequence[int] | None = None,
    *,
    kind: str = "uniform",
) -> Inputs:
    """Random hidden states and routings for every rank (``ROUTINGS`` names the kinds).

    ``tokens[r]`` tokens on rank r (default: random in [0, max_tokens]). The weights are
    signed and spread over a wide range, so a sum in another order than ascending k changes
    bits even after the cast to the layer's dtype.
    """
    if kind not in ROUTINGS:
        raise ConfigError(f"routing must be one of {', '.join(ROUTINGS)}, got {kind!r}")
    g = torch.Generator().manual_seed(seed)
    w, e, k, h = config.world_size, config.num_experts, config.top_k, config.hidden
    if tokens is None:
        tokens = [int(torch.randint(0, config.max_tokens + 1, (1,), generator=g)) for _ in range(w)]
    if len(tokens) != w:
        raise ConfigError(f"pass one token count per rank ({w}), got {len(tokens)}")
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, h, generator=g).to(config.dtype))
        if kind == "skewed":
            idx = torch.arange(k, dtype=torch.int64).repeat(t, 1)
        else:
            # K distinct experts per token: the K smallest of E random keys
            idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k] if t else torch.empty(0, k)
            idx = idx.to(torch.int64)
            if kind == "masked" and t:
                drop = torch.rand(t, k, generator=g) < 0.25
                drop[0] = True  # a token routed nowhere
                idx = torch.where(drop, torch.full_like(idx, -1), idx)
        idxs.append(idx)
        ws.append(torch.randn(t, k, generator=g) * 2.0 ** torch.randint(-6, 7, (t, k), generator=g))
    return Inputs(xs, idxs, ws)


def scaled_expert(expert: int, rows: torch.Tensor) -> torch.Tensor:
    """A row-wise expert: ``rows * (1 + e/8) + (e/16 - 1/2)`` in float32, cast back. The same
    bits for a row alone or inside any batch, on CPU or GPU."""
    scale, shift = 1.0 + expert / 8.0, expert / 16.0 - 0.5
    return (rows.to(torch.float32) * scale + shift).to(rows.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().view(torch.uint8)


def dispatch_mismatch(got: DispatchResult, want: DispatchResult) -> str | None:
    """``None`` if ``got`` holds exactly ``want``'s rows, experts and source mapping (bit for
    bit); else what differs first."""
    if got.experts != want.experts:
        return f"experts {got.experts} != {want.experts}"
    for name in ("expert_counts", "src_rank", "src_token", "src_k", "tokens_per_source"):
        a, b = getattr(got, name).to("cpu"), getattr(want, name).to("cpu")
        if a.dtype != b.dtype or not torch.equal(a, b):
            return f"{name} differs: {a.tolist()[:8]} against {b.tolist()[:8]}"
    return output_mismatch(got.tokens, want.tokens, what="token rows")


def output_mismatch(got: torch.Tensor, want: torch.Tensor, *, what: str = "combined rows") -> str | None:
    """``None`` if the two tensors have the same dtype, shape and bytes; else what differs."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: {got.dtype} {tuple(got.shape)} against {want.dtype} {tuple(want.shape)}"
    a, b = _bits(got), _bits(want)
    if torch.equal(a, b):
        return None
    rows = (a != b).reshape(a.shape[0], -1).any(1).nonzero().flatten()
    return f"{what}: {int(rows.numel())} of {int(a.shape[0])} rows differ (first: row {int(rows[0])})"
