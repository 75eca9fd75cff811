"""``fabric bench moe``: MoE dispatch and combine timed on a real backend against the
collectives baseline, in the same run, with every step checked bit for bit.

W ranks on this host. On a compiled backend (efa, verbs) each rank is a process of its own
with its own engine, as in a real deployment, and runs both implementations: fabric's
``MoeAllToAll`` and ``CollectiveMoe`` (``all_to_all_single`` over gloo, or over NCCL with GPU
buffers when every rank has a GPU of its own), one step of each in turn, so both see the same
machine at the same moment. On the simulator (which lives in one
process) the fabric ranks are threads of this process and the baseline runs in W processes
of its own afterwards.

A step of one implementation: a barrier, then dispatch (send + receive) timed, the experts
(``scaled_expert``, not timed), a barrier, then combine (send + receive) timed. A phase's time
in a step is the slower rank's (the layer waits for it); p50 and p99 are over the timed
steps. Every rank draws every rank's inputs from the seed, so the first step of each
implementation is checked against the single-process reference (``reference_dispatch``,
``reference_moe``) and every later step against the first: a benchmark that measures a wrong
answer fails instead.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

from fabric_core.errors import ConfigError, FabricError

from .._spawn import child_env, reap
from .alltoall import MoeAllToAll
from .baseline import CollectiveMoe
from .config import MoeConfig
from .reference import apply_experts, reference_dispatch, reference_moe
from .result import DispatchResult
from .workload import ROUTINGS, dispatch_mismatch, output_mismatch, random_inputs, scaled_expert

__all__ = ["SHAPES", "MoeBenchError", "MoeBenchResult", "MoeBenchSpec", "PhaseTimes", "run_moe_bench"]

logger = logging.getLogger(__name__)

SHAPES = {"decode": 128, "prefill": 4096}
"""Tokens per rank of the two standard shapes (DeepSeek-V3-like decode and prefill)."""


class MoeBenchError(FabricError):
    """A rank failed, hung past the deadline, or produced bits other than the reference's."""


@dataclass(frozen=True)
class MoeBenchSpec:
    """What to run. ``shapes``: (name, tokens per rank) pairs; ``engine_options``: settings
    passed to ``open_engine`` (e.g. ``{"efa_provider": "shm", "nics": 1}``)."""

    backend: str
    ranks: int = 2
    shapes: tuple[tuple[str, int], ...] = tuple(SHAPES.items())
    hidden: int = 7168
    top_k: int = 8
    experts: int = 256
    routing: str = "uniform"
    steps: int = 20
    warmup: int = 2
    device: str = "cpu"
    baseline: bool = True
    seed: int = 0
    timeout: float = 120.0
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"steps must be >= 1 and warmup >= 0, got {self.steps} and {self.warmup}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.shapes or any(t < 1 for _, t in self.shapes):
            raise ConfigError(f"shapes must name at least one shape of >= 1 token, got {self.shapes}")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0, got {self.timeout}")
        # the layer's own checks (experts divisible by ranks, top_k <= experts, ...)
        MoeConfig(self.ranks, 0, self.experts, self.hidden, self.top_k, max(t for _, t in self.shapes))


@dataclass
class PhaseTimes:
    """One phase of one implementation: per-step seconds of the slower rank, and summaries."""

    seconds: list[float]
    p50_us: float
    p99_us: float

    @classmethod
    def of(cls, per_rank: Sequence[Sequence[float]]) -> PhaseTimes:
        steps = [max(ts) for ts in zip(*per_rank, strict=True)]
        ordered = sorted(steps)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return cls(steps, statistics.median(ordered) * 1e6, p99 * 1e6)


@dataclass
class MoeBenchResult:
    """Per shape and implementation (``fabric``, ``baseline``): dispatch and combine times."""

    spec: MoeBenchSpec
    times: dict[str, dict[str, dict[str, PhaseTimes]]]  # shape -> impl -> phase -> times
    baseline_note: str | None  # why the baseline did not run, if it did not
    host: dict[str, Any]
    duration_s: float

    @property
    def checked_steps(self) -> int:
        """Steps per shape and implementation checked bit for bit: every one (a difference
        raises instead of giving a result)."""
        return self.spec.warmup + self.spec.steps

    def ratio(self, shape: str, phase: str) -> float | None:
        """fabric's p50 over the baseline's (below 1: fabric is faster)."""
        impls = self.times.get(shape, {})
        if "baseline" not in impls:
            return None
        return impls["fabric"][phase].p50_us / impls["baseline"][phase].p50_us

    def to_json(self) -> dict[str, Any]:
        spec = asdict(self.spec)
        spec["shapes"] = dict(self.spec.shapes)
        return {
            "kind": "moe",
            "spec": spec,
            "host": self.host,
            "checked_steps": self.checked_steps,
            "baseline_note": self.baseline_note,
            "duration_s": self.duration_s,
            "shapes": {
                shape: {
                    impl: {phase: asdict(t) for phase, t in phases.items()} for impl, phases in impls.items()
                }
                | {
                    "ratio_p50": {ph: self.ratio(shape, ph) for ph in ("dispatch", "combine")},
                    "tokens_per_rank": dict(self.spec.shapes)[shape],
                }
                for shape, impls in self.times.items()
            },
        }


def _host() -> dict[str, Any]:
    from fabric_core.cli.bench import host_info

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {**host_info(), "torch": torch.__version__, "gpu": gpu}


# --- one rank -------------------------------------------------------------------------
Step = tuple[Callable[[], DispatchResult], Callable[[torch.Tensor], torch.Tensor]]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _implementations(
    moe: MoeAllToAll | None,
    base: CollectiveMoe | None,
    x: torch.Tensor,
    idx: torch.Tensor,
    wt: torch.Tensor,
    timeout: float,
) -> dict[str, Step]:
    """(dispatch, combine) of each implementation present, for one rank's fixed inputs."""
    impls: dict[str, Step] = {}
    if moe is not None:
        fabric = moe

        def fabric_dispatch() -> DispatchResult:
            fabric.dispatch_send(x, idx, wt)
            return fabric.dispatch_recv(timeout)

        def fabric_combine(outputs: torch.Tensor) -> torch.Tensor:
            fabric.combine_send(outputs)
            return fabric.combine_recv(timeout)

        impls["fabric"] = (fabric_dispatch, fabric_combine)
    if base is not None:
        collective = base
        impls["baseline"] = (lambda: collective.dispatch(x, idx, wt), collective.combine)
    return impls


def _rank_body(
    rank: int,
    spec: MoeBenchSpec,
    engine: Any,
    store: Any,
    barrier: Callable[[], None],
    collective: bool,
    group: Any = None,
) -> dict[str, Any]:
    """Every shape on one rank: ``{"times": {shape: {impl: {phase: [seconds per timed
    step]}}}}``. ``engine`` None: the baseline only. Raises ``MoeBenchError`` at the first step
    whose bits differ from the reference (the first step) or from the first step (the rest)."""
    from fabric_core.rendezvous import Rendezvous

    w, dev = spec.ranks, spec.device
    if dev == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    out: dict[str, Any] = {}
    for layer, (shape, tokens) in enumerate(spec.shapes):
        config = MoeConfig(w, rank, spec.experts, spec.hidden, spec.top_k, tokens, device=dev)
        inputs = random_inputs(config, spec.seed * 1000 + layer, [tokens] * w, kind=spec.routing)
        want_d = reference_dispatch(config, inputs.xs, inputs.idxs)[rank]
        want_y = reference_moe(config, inputs.xs, inputs.idxs, inputs.ws, scaled_expert)[rank]
        x, idx, wt = (t.to(dev) for t in (inputs.xs[rank], inputs.idxs[rank], inputs.ws[rank]))
        moe = None
        if engine is not None:
            moe = MoeAllToAll(engine, config, layer=layer + 1, timeout=spec.timeout)
            moe.connect_rendezvous(
                Rendezvous(store, rank=rank, world_size=w, prefix="moe-bench", timeout=spec.timeout)
            )
        base = CollectiveMoe(config, group) if collective else None
        impls = _implementations(moe, base, x, idx, wt, spec.timeout)
        times: dict[str, dict[str, list[float]]] = {impl: {"dispatch": [], "combine": []} for impl in impls}
        first: dict[str, tuple[DispatchResult, torch.Tensor]] = {}
        try:
            for step in range(spec.warmup + spec.steps):
                for impl, (dispatch, combine) in impls.items():
                    barrier()
                    t0 = time.perf_counter()
                    res = dispatch()
                    _sync(dev)
                    t1 = time.perf_counter()
                    outputs = apply_experts(res, scaled_expert)
                    _sync(dev)
                    barrier()
                    t2 = time.perf_counter()
                    y = combine(outputs)
                    _sync(dev)
                    t3 = time.perf_counter()
                    ref_d, ref_y = first.get(impl, (want_d, want_y))
                    problem = dispatch_mismatch(res, ref_d) or output_mismatch(y, ref_y)
                    if problem is not None:
                        raise MoeBenchError(f"rank {rank} {shape} step {step} ({impl}): {problem}")
                    first.setdefault(impl, (res, y))
                    if step >= spec.warmup:
                        times[impl]["dispatch"].append(t1 - t0)
                        times[impl]["combine"].append(t3 - t2)
        finally:
            if moe is not None:
                moe.close()
        out[shape] = times
    return {"times": out}


def _process_rank(rank: int, spec: MoeBenchSpec, port: int, conn: Any) -> None:
    """A spawned rank: join the parent's store, gloo for barriers and the baseline, an engine
    unless this is the baseline-only run; send back the rank body's result or the error."""
    torch.set_num_threads(1)  # one intra-op thread per rank, as torchrun sets
    import torch.distributed as dist

    from fabric_core import open_engine

    engine = None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=spec.timeout)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=spec.ranks, timeout=timedelta(seconds=spec.timeout)
        )
        if spec.device == "cuda":  # before the engine opens: it binds to the current device
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if spec.backend != "baseline":
            engine = open_engine(spec.backend, **spec.engine_options)

        def barrier() -> None:
            dist.barrier()

        # the baseline's collectives: gloo on host buffers, NCCL on GPU buffers (one GPU per rank)
        group = dist.new_group(backend="nccl") if spec.baseline and spec.device == "cuda" else None
        body = _rank_body(rank, spec, engine, store, barrier, spec.baseline, group)
        conn.send(("ok", body))
    except BaseException as exc:
        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    finally:
        if engine is not None:
            engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def _run_processes(spec: MoeBenchSpec) -> list[dict[str, Any]]:
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout)
    )
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(spec.ranks)]
    procs = [
        ctx.Process(target=_process_rank, args=(r, spec, store.port, pipes[r][1]), daemon=True)
        for r in range(spec.ranks)
    ]
    with child_env(GLOO_SOCKET_IFNAME="lo"):
        for p in procs:
            p.start()
    for _, there in pipes:
        there.close()  # a dead rank then reads as EOF here, not as a hang
    results: list[dict[str, Any] | None] = [None] * spec.ranks
    errors: list[str] = []
    waiting: dict[Any, int] = {here: r for r, (here, _) in enumerate(pipes)}
    deadline = time.monotonic() + spec.timeout * (3 + len(spec.shapes))
    try:
        # the first rank to fail ends the run: the others would wait at their next barrier
        while waiting and not errors:
            ready: list[Any] = mp_connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                errors.append(f"ranks {sorted(waiting.values())}: no result before the deadline")
                break
            for here in ready:
                r = waiting.pop(here)
                try:
                    status, body = here.recv()
                except EOFError:
                    procs[r].join(5)
                    errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
                    continue
                if status == "ok":
                    results[r] = body
                else:
                    errors.append(body)
    finally:
        reap(procs, kill=bool(errors))
    if errors:
        raise MoeBenchError("; ".join(errors))
    return [r for r in results if r is not None]


def _run_threads(spec: MoeBenchSpec) -> list[dict[str, Any]]:
    """The simulator: one engine per rank on one ``SimFabric``, ranks as threads."""
    import torch.distributed as dist

    from fabric_core.testing.ranks import run_ranks
    from fabric_sim import SimFabric

    fabric = SimFabric(spec.seed)
    nics = int(spec.engine_options.get("nics", 2))
    engines = [fabric.open_engine(nics) for _ in range(spec.ranks)]
    store = dist.HashStore()  # type: ignore[attr-defined]
    gate = threading.Barrier(spec.ranks)

    def barrier() -> None:
        gate.wait(spec.timeout)

    def rank(r: int) -> dict[str, Any]:
        try:
            return _rank_body(r, spec, engines[r], store, barrier, False)
        except BaseException:
            gate.abort()  # the others stop at their next barrier instead of waiting it out
            raise

    try:
        got = run_ranks(rank, spec.ranks, spec.timeout * (3 + len(spec.shapes)))
    finally:
        for e in engines:
            e.close(timeout=2.0)
    failed = [(r, x) for r, x in enumerate(got) if isinstance(x, BaseException)]
    # the rank that failed first, not the ones its abort broke out of their barrier
    first = [(r, x) for r, x in failed if not isinstance(x, threading.BrokenBarrierError)] or failed
    errors = [
        f"rank {r}: {x}" if isinstance(x, MoeBenchError) else f"rank {r}: {type(x).__name__}: {x}"
        for r, x in first
    ]
    if errors:
        raise MoeBenchError("; ".join(errors))
    return got  # type: ignore[return-value]  # no exception left


def run_moe_bench(spec: MoeBenchSpec) -> MoeBenchResult:
    """Run ``spec``; ``MoeBenchError`` if a rank fails, hangs or computes other bits."""
    start = time.perf_counter()
    note = None
    baseline = spec.baseline
    if baseline and spec.device == "cuda" and torch.cuda.device_count() < spec.ranks:
        baseline = False
        note = (
            f"not run: NCCL needs one GPU per rank ({spec.ranks} ranks, "
            f"{torch.cuda.device_count()} GPU(s) here)"
        )
    if spec.backend == "sim":
        ranks = _run_threads(spec)
        if baseline:
            base = _run_processes(replace(spec, backend="baseline"))
            for mine, theirs in zip(ranks, base, strict=True):
                for shape, impls in theirs["times"].items():
                    mine["times"][shape].update(impls)
    else:
        ranks = _run_processes(replace(spec, baseline=baseline))
    times: dict[str, dict[str, dict[str, PhaseTimes]]] = {}
    for shape, _ in spec.shapes:
        impls = ranks[0]["times"][shape]
        times[shape] = {
            impl: {
                phase: PhaseTimes.of([r["times"][shape][impl][phase] for r in ranks])
                for phase in ("dispatch", "combine")
            }
            for impl in impls
        }
    return MoeBenchResult(
        spec=spec,
        times=times,
        baseline_note=note,
        host=_host(),
        duration_s=time.perf_counter() - start,
    )
