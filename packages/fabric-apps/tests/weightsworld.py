"""Helpers of the weight-update tests: buffers and images from the single-process torch
reference reshard (``fabric_apps.weights.reference``), a plan applied without a fabric, and a
rig that runs every rank of both fleets on one private simulated fabric, each rank in its own
thread. Pieces are placed in a rank's buffer through ``LocalLayout.views`` (the buffer format
itself).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from fabric_apps.weights import (
    ExpertPlacement,
    FleetSpec,
    FsdpShard,
    ParamSpec,
    PlanOptions,
    Replicated,
    TensorParallel,
    TransferPlan,
    WeightsReceiver,
    WeightsSender,
    make_plan,
)
from fabric_apps.weights.reference import full_tensors, real_elements, shard
from fabric_core import TransferEngine
from fabric_sim import SimFabric

T = 10.0  # every wait in these tests is bounded by this many seconds


def source_buffer(spec: FleetSpec, rank: int, fulls: dict[str, torch.Tensor]) -> torch.Tensor:
    layout = spec.layout(rank)
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    write_source(spec, rank, fulls, buf)
    return buf


def write_source(spec: FleetSpec, rank: int, fulls: dict[str, torch.Tensor], buf: torch.Tensor) -> None:
    views = spec.layout(rank).views(buf)
    for p in spec.params:
        views[p.name].copy_(shard(fulls[p.name], p, spec.world_size, rank))


def expected_image(
    spec: FleetSpec, rank: int, fulls: dict[str, torch.Tensor], before: torch.Tensor
) -> torch.Tensor:
    """Destination rank ``rank``'s buffer after an update from ``fulls`` lands on ``before``:
    every piece cast to the destination dtype; padding and gaps keep their old bytes."""
    img = before.clone()
    views = spec.layout(rank).views(img)
    for p in spec.params:
        local = shard(fulls[p.name].to(getattr(torch, p.dtype)), p, spec.world_size, rank)
        real = real_elements(p, spec.world_size, rank)
        views[p.name].reshape(-1)[:real].copy_(local.reshape(-1)[:real])
    return img


def param_mask(spec: FleetSpec, rank: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Bytes of destination rank ``rank``'s buffer that hold parameter data."""
    layout = spec.layout(rank)
    mask = np.zeros(layout.nbytes, bool)
    for p in spec.params:
        e = layout[p.name]
        mask[e.offset : e.offset + real_elements(p, spec.world_size, rank) * p.itemsize] = True
    return mask


def apply_plan(plan: TransferPlan, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """Do what the plan says with plain copies (and torch casts), without a fabric."""
    for e in plan.entries():
        piece, out = e.src_length // e.count, e.length // e.count
        for i in range(e.count):  # a packed row: its pieces, one by one
            at = e.src_offset + i * e.src_stride
            s = srcs[e.src_rank][at : at + piece]
            d = dsts[e.dst_rank][e.dst_offset + i * out : e.dst_offset + (i + 1) * out]
            if e.cast is None:
                d.copy_(s)
            else:
                d.view(getattr(torch, e.cast[1])).copy_(s.view(getattr(torch, e.cast[0])))


def coverage(plan: TransferPlan) -> list[np.ndarray[Any, np.dtype[np.int64]]]:
    """How many plan rows write each byte of each destination buffer."""
    out = []
    for d in range(plan.destination.world_size):
        hits = np.zeros(plan.destination.layout(d).nbytes + 1, np.int64)
        for e in plan.entries(dst=d):
            hits[e.dst_offset] += 1
            hits[e.dst_offset + e.length] -= 1
        out.append(np.cumsum(hits)[:-1])
    return out


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


# --- random fleets (hypothesis) ----------------------------------------------------------------------
DTYPES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float32")]


@st.composite
def random_sharding(draw: Any, shape: tuple[int, ...], world: int, *, source: bool) -> Any:
    kinds = ["replicated", "fsdp", "experts"] + (["tp"] if shape else [])
    kind = draw(st.sampled_from(kinds if shape else ["replicated", "fsdp"]))
    replicas = draw(st.sampled_from([r for r in (1, 2, 3) if world % r == 0]))
    if kind == "replicated":
        return Replicated()
    if kind == "fsdp":
        return FsdpShard(replicas=replicas)
    if kind == "tp":
        dim = draw(st.integers(0, len(shape) - 1))
        # sometimes a fused tensor: its size along dim in 1-3 sections, each cut on its own
        cuts = sorted(draw(st.sets(st.integers(1, shape[dim] - 1), max_size=2))) if shape[dim] > 1 else []
        bounds = [0, *cuts, shape[dim]]
        sections = tuple(int(x) for x in np.diff(bounds)) if cuts else ()
        return TensorParallel(dim, replicas, sections)
    e = shape[0]
    held = [sorted(draw(st.sets(st.integers(0, e - 1), max_size=e))) for _ in range(world)]
    if source:  # every expert somewhere at the source
        for x in range(e):
            if not any(x in h for h in held):
                held[draw(st.integers(0, world - 1))].append(x)
    return ExpertPlacement(tuple(tuple(draw(st.permutations(h))) for h in held))


@st.composite
def random_fleets(draw: Any) -> tuple[FleetSpec, FleetSpec, PlanOptions]:
    """Small random fleets: 1-4 ranks each, 1-4 parameters of up to 3 dims, any sharding on
    either side (every expert held somewhere at the source), random casts and options."""
    s_world, d_world = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    s_params, d_params = [], []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
        s_dt, d_dt = draw(st.sampled_from(DTYPES))
        s_params.append(ParamSpec(f"p{i}", shape, s_dt, draw(random_sharding(shape, s_world, source=True))))  # type: ignore[arg-type]
        d_params.append(ParamSpec(f"p{i}", shape, d_dt, draw(random_sharding(shape, d_world, source=False))))  # type: ignore[arg-type]
    order = draw(st.permutations(d_params))
    options = PlanOptions(
        num_nics=draw(st.integers(1, 3)),
        max_write_bytes=draw(st.sampled_from([64, 100, 1 << 30])),
        staging_bytes=256,
        stage_chunk_bytes=draw(st.sampled_from([0, 8, 24])),
        split_bytes=draw(st.sampled_from([1, 16, 1 << 20])),
        nic_split_bytes=draw(st.sampled_from([1, 32, 1 << 20])),
    )
    align = draw(st.sampled_from([8, 64]))
    return FleetSpec(s_world, tuple(s_params), align), FleetSpec(d_world, tuple(order), align), options


# --- a model with every sharding ----------------------------------------------------------------
def mixed_fleets(src_world: int, dst_world: int) -> tuple[FleetSpec, FleetSpec]:
    """A small transformer-like model: replicated, TP rows/columns, FSDP (odd sizes, padding),
    HSDP replicas, expert placement with redundant experts, and float32 -> bf16 / fp8 casts."""
    e = 6
    src_replicas = 2 if src_world % 2 == 0 else 1
    dst_experts = ExpertPlacement(tuple(tuple((2 * r + k) % e for k in range(3)) for r in range(dst_world)))
    src = FleetSpec(
        src_world,
        (
            ParamSpec("embed", (24, 16), "float32", Replicated()),
            ParamSpec("qkv", (24, 16), "bfloat16", TensorParallel(0)),
            ParamSpec("o_proj", (16, 24), "bfloat16", TensorParallel(1)),
            ParamSpec("mlp_up", (40, 16), "bfloat16", FsdpShard()),
            ParamSpec("mlp_down", (17, 5), "float32", TensorParallel(0)),
            ParamSpec("experts", (e, 8, 4), "bfloat16", ExpertPlacement.contiguous(e, src_world)),
            ParamSpec("norm", (16,), "float32", Replicated()),
            ParamSpec("router", (6, 10), "float32", FsdpShard(replicas=src_replicas)),
            ParamSpec("scale", (), "float32", Replicated()),
        ),
    )
    dst = FleetSpec(
        dst_world,
        (
            ParamSpec("embed", (24, 16), "bfloat16", TensorParallel(0)),
            ParamSpec("qkv", (24, 16), "bfloat16", TensorParallel(1)),
            ParamSpec("o_proj", (16, 24), "bfloat16", TensorParallel(0)),
            ParamSpec("mlp_up", (40, 16), "bfloat16", TensorParallel(0, sections=(24, 16))),  # fused gate, up
            ParamSpec("mlp_down", (17, 5), "float32", FsdpShard()),
            ParamSpec("experts", (e, 8, 4), "bfloat16", dst_experts),
            ParamSpec("norm", (16,), "float32", Replicated()),
            ParamSpec("router", (6, 10), "float8_e4m3fn", Replicated()),
            ParamSpec("scale", (), "float32", Replicated()),
        ),
        align=64,
    )
    return src, dst


# --- engines and ranks on a simulated fabric ------------------------------------------------------
class Rig:
    """Every rank of both fleets on one private ``SimFabric``: receivers (with random old
    bytes), senders, and a way to run a step with each rank in its own thread."""

    def __init__(
        self,
        seed: int,
        src: FleetSpec,
        dst: FleetSpec,
        *,
        nics: int = 1,
        options: PlanOptions | None = None,
        chunk_bytes: int = 256,
        max_msg_size: int | None = None,
        plan: TransferPlan | None = None,
    ) -> None:
        self.fabric = SimFabric(seed, chunk_bytes=chunk_bytes)
        # an empty plan is falsy (no rows): test for None
        self.plan = plan if plan is not None else make_plan(src, dst, options or PlanOptions(num_nics=nics))
        self.src, self.dst = self.plan.source, self.plan.destination
        extra: dict[str, Any] = {"timeout_s": T}
        if max_msg_size is not None:
            extra["max_msg_size"] = max_msg_size
        S, D = self.src.world_size, self.dst.world_size
        nics = self.plan.options.num_nics
        self.src_engines: list[TransferEngine] = [self.fabric.open_engine(nics, **extra) for _ in range(S)]
        self.dst_engines: list[TransferEngine] = [self.fabric.open_engine(nics, **extra) for _ in range(D)]
        self.dst_bufs = [random_bytes(self.dst.layout(d).nbytes, 1000 + d) for d in range(D)]
        self.src_bufs = [torch.zeros(self.src.layout(s).nbytes, dtype=torch.uint8) for s in range(S)]
        addresses = [e.address for e in self.src_engines]
        self.receivers = [
            WeightsReceiver(self.dst_engines[d], self.plan, d, self.dst_bufs[d], addresses, timeout=T)
            for d in range(D)
        ]
        descs = [r.descriptor for r in self.receivers]
        self.senders = [
            WeightsSender(self.src_engines[s], self.plan, s, self.src_bufs[s], descs, timeout=T)
            for s in range(S)
        ]

    def load(self, seed: int) -> dict[str, torch.Tensor]:
        """New weights at every source rank (what a training step produced)."""
        fulls = full_tensors(self.src, seed)
        for s in range(self.src.world_size):
            write_source(self.src, s, fulls, self.src_bufs[s])
        return fulls

    def expected(self, fulls: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [expected_image(self.dst, d, fulls, self.dst_bufs[d]) for d in range(self.dst.world_size)]

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.dst_bufs]

    def run_step(
        self,
        step: int,
        *,
        senders: Sequence[int] | None = None,
        receivers: Sequence[int] | None = None,
        timeout: float = T,
    ) -> tuple[dict[int, Any], dict[int, Any]]:
        """Run ``send_step`` / ``wait_step`` of ``step`` on the given ranks (all by default),
        each in a thread; returns each rank's report or the exception it raised."""
        sent: dict[int, Any] = {}
        got: dict[int, Any] = {}

        def run(out: dict[int, Any], rank: int, fn: Callable[[], Any]) -> None:
            try:
                out[rank] = fn()
            except BaseException as exc:
                out[rank] = exc

        threads = [
            threading.Thread(
                target=run, args=(got, d, lambda d=d: self.receivers[d].wait_step(step, timeout))
            )
            for d in (range(self.dst.world_size) if receivers is None else receivers)
        ] + [
            threading.Thread(target=run, args=(sent, s, lambda s=s: self.senders[s].send_step(step, timeout)))
            for s in (range(self.src.world_size) if senders is None else senders)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * timeout)
            assert not t.is_alive(), "a rank did not finish within its deadline"
        return sent, got

    def close(self) -> None:
        for s in self.senders:
            s.close(timeout=2.0)
        for r in self.receivers:
            r.close()
        for e in self.src_engines + self.dst_engines:
            e.close(timeout=2.0)
