"""The collectives baseline: the same dispatch and combine with ``all_to_all_single``.

For comparison only (benchmarks, and as a second implementation the tests check against the
reference). It needs a ``torch.distributed`` process group that is already initialised
(gloo on CPU, NCCL on GPU) whose ranks are the layer's ranks. Every tensor that travels
lives on ``x``'s device (the counts included: NCCL carries CUDA tensors only); the small
index work of grouping runs on the host, as in ``MoeAllToAll``. It gives the same
``DispatchResult`` and the same combined bits as ``MoeAllToAll``: tokens travel once per
destination rank in the same record format, receivers group them with the same code, and the
combine uses the same ``weighted_sum``. Each step costs three collectives (counts, tokens,
outputs), each a barrier across all ranks: what the one-sided path avoids.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fabric_core.errors import ConfigError

from ._routing import check_inputs, combine_positions, destinations, group_received, weighted_sum
from .config import MoeConfig
from .errors import MoeStateError
from .result import DispatchResult

__all__ = ["CollectiveMoe"]

logger = logging.getLogger(__name__)


class CollectiveMoe:
    """Dispatch/combine of one rank over ``torch.distributed`` (``group`` or the default)."""

    def __init__(self, config: MoeConfig, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call init_process_group first")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (config.world_size, config.rank):
            raise ConfigError(
                f"the process group is rank {rank} of {size}, "
                f"the layer rank {config.rank} of {config.world_size}"
            )
        self.config, self.group = config, group
        self._idx = torch.empty(0, config.top_k, dtype=torch.int64)
        self._weights = torch.empty(0, config.top_k, dtype=torch.float32)
        self._pairs_from = torch.zeros(config.world_size, dtype=torch.int64)
        self._pos = torch.zeros(0, config.top_k, dtype=torch.int64)
        self._row_src_rank: torch.Tensor | None = None

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group
        )

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchResult:
        """Counts (one all-to-all), then the token records (another); the result matches
        ``MoeAllToAll.dispatch_recv`` bit for bit."""
        c = self.config
        x, idx, weights = check_inputs(c, x, topk_idx, topk_weights)
        dev = x.device
        mask, _ = destinations(c, idx)
        per_rank = mask.sum(0)
        recv_counts = torch.empty_like(per_rank, device=dev)
        self._a2a(recv_counts, per_rank.to(dev), [1] * c.world_size, [1] * c.world_size)
        recv_counts = recv_counts.to("cpu")
        send_tok = torch.cat([mask[:, q].nonzero().flatten() for q in range(c.world_size)])
        meta = torch.zeros(int(send_tok.numel()), c.meta_bytes // 4, dtype=torch.int32)
        meta[:, 0] = send_tok.to(torch.int32)
        meta[:, 1 : 1 + c.top_k] = idx[send_tok].to(torch.int32)
        records = torch.zeros(int(send_tok.numel()), c.record_bytes, dtype=torch.uint8, device=dev)
        records[:, : c.meta_bytes].copy_(meta.view(torch.uint8))
        records[:, c.meta_bytes : c.meta_bytes + c.token_bytes].view(c.dtype).copy_(x[send_tok.to(dev)])
        received = torch.empty(int(recv_counts.sum()), c.record_bytes, dtype=torch.uint8, device=dev)
        self._a2a(received, records, recv_counts.tolist(), per_rank.tolist())
        rmeta = received[:, : c.meta_bytes].to("cpu").view(torch.int32).to(torch.int64)
        src_rank = torch.repeat_interleave(torch.arange(c.world_size, dtype=torch.int64), recv_counts)
        result = group_received(
            c,
            c.rank,
            src_rank,
            rmeta[:, 0],
            rmeta[:, 1 : 1 + c.top_k],
            received[:, c.meta_bytes : c.meta_bytes + c.token_bytes].view(c.dtype),
            torch.arange(int(src_rank.numel()), dtype=torch.int64),
            recv_counts,
        )
        self._idx, self._weights = idx, weights
        self._pos, self._pairs_from = combine_positions(c, idx)
        self._row_src_rank = result.src_rank
        return result

    def combine(self, expert_outputs: torch.Tensor) -> torch.Tensor:
        """Outputs back to their origins (one all-to-all), then the same ``weighted_sum``."""
        c = self.config
        if self._row_src_rank is None:
            raise MoeStateError("combine before dispatch")
        src_rank, self._row_src_rank = self._row_src_rank, None
        if (
            tuple(expert_outputs.shape) != (int(src_rank.numel()), c.hidden)
            or expert_outputs.dtype != c.dtype
        ):
            raise MoeStateError(f"expert_outputs must be [{int(src_rank.numel())}, {c.hidden}] {c.dtype}")
        dev = expert_outputs.device
        order = torch.argsort(src_rank, stable=True)
        send = expert_outputs.index_select(0, order.to(dev)).contiguous().view(torch.uint8)
        send_splits = torch.bincount(src_rank, minlength=c.world_size).tolist()
        recv_splits = self._pairs_from.tolist()
        back = torch.empty(sum(recv_splits), c.token_bytes, dtype=torch.uint8, device=dev)
        self._a2a(back, send, recv_splits, send_splits)
        rows = back.view(c.dtype)
        t = int(self._idx.shape[0])
        if not rows.shape[0]:  # no slot of any token is served: every slot is skipped
            rows = torch.zeros(1, c.hidden, dtype=c.dtype, device=dev)
        y = rows.index_select(0, self._pos.reshape(-1).to(dev)).view(t, c.top_k, c.hidden)
        return weighted_sum(y, self._weights, self._idx, c.dtype)
