"""``DispatchResult``: what a rank receives from dispatch, grouped by local expert."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["DispatchResult"]


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """The tokens a rank's experts must process, grouped by local expert.

    Row ``i`` of ``tokens`` is the hidden state of token ``src_token[i]`` of rank
    ``src_rank[i]``, routed by that token's top-k slot ``src_k[i]`` to local expert
    ``experts[j]`` for the ``j`` whose block holds row ``i``. Blocks follow ``experts``
    (ascending global expert id) and hold ``expert_counts[j]`` rows each; inside a block rows
    are ordered by (source rank, source token, k). A token that picks two experts of this
    rank arrives once over the wire but appears in both blocks.

    ``tokens_per_source[r]`` is how many distinct tokens rank ``r`` sent here (each token
    once per destination rank, however many of its experts live here).

    Pass the experts' outputs to ``combine_send`` as one ``[num_rows, hidden]`` tensor in
    the same row order. The tensors are this result's own (not views of fabric buffers).
    """

    tokens: torch.Tensor
    expert_counts: torch.Tensor
    experts: tuple[int, ...]
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_k: torch.Tensor
    tokens_per_source: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expert_offsets(self) -> torch.Tensor:
        """int64 ``[len(experts) + 1]``: block ``j`` is rows ``[offsets[j], offsets[j + 1])``."""
        out = torch.zeros(len(self.experts) + 1, dtype=torch.int64)
        torch.cumsum(self.expert_counts, 0, out=out[1:])
        return out

    @cached_property
    def _bounds(self) -> tuple[int, ...]:
        # the offsets as plain ints, once: expert_block is called once per local expert
        return tuple(int(x) for x in self.expert_offsets)

    def expert_block(self, j: int) -> torch.Tensor:
        """The rows of local expert ``experts[j]`` (a view of ``tokens``)."""
        off = self._bounds
        return self.tokens[off[j] : off[j + 1]]
