"""Helpers of the MoE tests: W ranks' engines on one private simulated fabric (threads, one
process), routings, a row-wise expert function, bitwise checks and exact imm accounting."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from fabric_apps.moe import DispatchResult, MoeAllToAll, MoeConfig, Phase, moe_imm
from fabric_apps.moe.workload import Inputs, dispatch_mismatch, output_mismatch, random_inputs, scaled_expert
from fabric_core.testing.ranks import run_ranks, unwrap_ranks
from fabric_sim import SimEngine, SimFabric

T = 10.0  # every wait in these tests is bounded by this many seconds
R = TypeVar("R")


expert_fn = scaled_expert  # a row-wise expert: the same bits for a row alone or in any batch


def parallel(fn: Callable[[int], R], n: int, timeout: float = 3 * T) -> list[R | BaseException]:
    """Run ``fn(rank)`` for every rank in its own thread (a hang fails the test)."""
    return run_ranks(fn, n, timeout)


def unwrap(results: Sequence[R | BaseException]) -> list[R]:
    return unwrap_ranks(results)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_dispatch(got: DispatchResult, want: DispatchResult, rank: int) -> None:
    for name in ("expert_counts", "src_rank", "src_token", "src_k", "tokens_per_source"):
        assert getattr(got, name).dtype == torch.int64, f"rank {rank} {name}"
    problem = dispatch_mismatch(got, want)
    assert problem is None, f"rank {rank}: {problem}"


def assert_same_output(got: torch.Tensor, want: torch.Tensor, rank: int) -> None:
    problem = output_mismatch(got, want)
    assert problem is None, f"rank {rank}: {problem}"


def pieces(nbytes: int, max_msg: int) -> int:
    """Work requests one page of ``nbytes`` becomes (written out by hand, as a cross-check of
    the contract's rule)."""
    return max(1, -(-nbytes // max_msg))


def sharded_pieces(nbytes: int, nics: int, max_msg: int) -> int:
    """Work requests one ``Sharded`` write of ``nbytes`` becomes over ``nics`` NICs (written
    out by hand: shards of ceil(nbytes / nics) rounded up to 4 KiB, each cut at max_msg)."""
    per_nic = (nbytes + nics - 1) // nics
    size = (per_nic + 4095) // 4096 * 4096
    return sum(pieces(min(size, nbytes - off), max_msg) for off in range(0, nbytes, size))


def expected_imms(config: MoeConfig, inputs: Inputs, max_msg: int, nics: int) -> list[int]:
    """Imms each rank counts in one step, from the routing alone."""
    w, k = config.world_size, config.top_k
    owner = config.rank_table()
    total = [w] * w  # one count record from every rank
    for r in range(w):
        idx = inputs.idxs[r]
        for q in range(w):
            on_q = ((idx >= 0) & (owner[idx.clamp(min=0)] == q)).reshape(-1, k)
            n_tokens, n_pairs = int(on_q.any(1).sum()), int(on_q.sum())
            if n_tokens:  # tokens r -> q: packed, one sharded write
                total[q] += sharded_pieces(n_tokens * config.record_bytes, nics, max_msg)
            # q -> r: the outputs, packed, one sharded write (an imm-only write if none)
            total[r] += sharded_pieces(n_pairs * config.token_bytes, nics, max_msg) if n_pairs else 1
    return total


def expected_bytes(config: MoeConfig, inputs: Inputs, results: Sequence[DispatchResult]) -> list[int]:
    """Bytes each rank writes in one step: each token once per destination rank."""
    w, owner = config.world_size, config.rank_table()
    out = []
    for r in range(w):
        idx = inputs.idxs[r]
        hits = torch.zeros(idx.shape[0], w, dtype=torch.bool)
        for q in range(w):
            hits[:, q] = ((idx >= 0) & (owner[idx.clamp(min=0)] == q)).any(1)
        out.append(32 * w + int(hits.sum()) * config.record_bytes + results[r].num_rows * config.token_bytes)
    return out


def layer_imms(config: MoeConfig, layer: int) -> list[int]:
    return [
        moe_imm(layer, step, phase, src)
        for step in (0, 1)
        for phase in (Phase.COUNTS, Phase.DISPATCH, Phase.COMBINE)
        for src in range(config.world_size)
    ]


class MoeWorld:
    """W engines on one private ``SimFabric``; closes everything it made."""

    def __init__(self, seed: int, world_size: int, *, nics: int = 2, chunk_bytes: int = 64, **engine: Any):
        self.fabric = SimFabric(seed, chunk_bytes=chunk_bytes)
        self.nics = nics
        self.engines: list[SimEngine] = [self.fabric.open_engine(nics, **engine) for _ in range(world_size)]
        self.apps: list[MoeAllToAll] = []

    @property
    def max_msg_size(self) -> int:
        return self.engines[0].capabilities.max_msg_size

    def layer(self, config: MoeConfig, layer: int = 0, *, timeout: float = T) -> list[MoeAllToAll]:
        """One connected instance per rank (endpoints passed in process, as bytes)."""
        moes = [
            MoeAllToAll(e, config.for_rank(r), layer=layer, timeout=timeout)
            for r, e in enumerate(self.engines)
        ]
        self.apps.extend(moes)
        endpoints = [m.endpoint.to_bytes() for m in moes]
        for m in moes:
            m.connect(endpoints)
        return moes

    def received(self) -> list[int]:
        return [e.stats().imms_received for e in self.engines]

    def written(self) -> list[int]:
        return [e.stats().bytes_written for e in self.engines]

    def close(self) -> None:
        for app in reversed(self.apps):
            app.close(timeout=1.0)
        for e in reversed(self.engines):
            e.close(timeout=2.0)


def step(moe: MoeAllToAll, inputs: Inputs, rank: int) -> tuple[DispatchResult, torch.Tensor]:
    """One whole step of one rank with ``expert_fn`` as the experts."""
    from fabric_apps.moe import apply_experts

    moe.dispatch_send(inputs.xs[rank], inputs.idxs[rank], inputs.ws[rank])
    res = moe.dispatch_recv(T)
    moe.combine_send(apply_experts(res, expert_fn))
    return res, moe.combine_recv(T)


def baseline_worker(
    rank: int, world_size: int, store_path: str, out_path: str, config_kw: dict[str, Any], seeds: list[int]
) -> None:
    """One rank of the collectives baseline in a spawned process (gloo over a FileStore):
    runs one step per seed and saves what it got to ``out_path``."""
    from datetime import timedelta

    import torch.distributed as dist

    from fabric_apps.moe import apply_experts
    from fabric_apps.moe.baseline import CollectiveMoe

    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        config = MoeConfig(**config_kw, rank=rank)
        moe = CollectiveMoe(config)
        saved = []
        for seed in seeds:
            inputs = random_inputs(config, seed)  # every rank draws every rank's inputs alike
            res = moe.dispatch(inputs.xs[rank], inputs.idxs[rank], inputs.ws[rank])
            out = moe.combine(apply_experts(res, expert_fn))
            saved.append({**{k: getattr(res, k) for k in _RESULT_FIELDS}, "out": out})
        torch.save(saved, out_path)
    finally:
        dist.destroy_process_group()


_RESULT_FIELDS = ("tokens", "expert_counts", "src_rank", "src_token", "src_k", "tokens_per_source")
