"""``fabric bench rl``: an RL weight update from T trainer ranks to I inference ranks, timed
against the raw-libfabric ceiling measured in the same run, every byte checked every step.

On a compiled backend (efa, verbs) each rank is a process of its own with its own engine, as
in a real deployment; on the simulator every rank is a thread of this process on one
``SimFabric``. The ranks meet through a ``torch.distributed`` Store (``WeightsSender.connect``
/ ``WeightsReceiver.connect``: every rank computes the plan and checks its digest).

The model: a transformer-like state dict of about ``model_bytes`` (bf16 at the trainers):
embedding and LM head, attention (fused QKV, output projection) in every layer, a dense MLP
or a mixture of experts (stacked ``[E, ...]`` expert weights and a router) in alternate layers,
norms. The trainers shard it FSDP (the experts expert-parallel); the inference ranks shard it
tensor-parallel (QKV and MLP-up by rows, each of q, k, v and of gate, up on its own as fused
layers are; output projection and MLP-down by columns), hold the
experts expert-parallel, replicate the norms and routers, and may hold the projections in
another dtype (``cast``: made at the trainers through their staging pools).

A step: every inference rank poisons its buffer, every rank reports ready, the coordinator
(this process) says go; the trainers ``send_step``, the inference ranks ``wait_step``, then
check their buffer (not timed). A step's time is from the first trainer's start to the last
inference rank's fence (``CLOCK_MONOTONIC``: one clock for every process of the host). The
bound is the step's bytes over the raw-libfabric ceiling's aggregate bandwidth for the same
fan: the ceiling program (``ceiling``: a built ``benchmarks/ceiling/fi_ceiling``) runs before
the ranks start and after they exit as T writer processes each writing a trainer's share round
robin to I target processes (``-f T:I``), and the bound takes its best size and run. It also
runs as one independent pair and as T pairs (``ratio_by_pairs``): T pairs have T receivers,
which on shm (the receiver copies) is more copying CPU than an update to I ranks can use.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import statistics
import subprocess
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Literal

from fabric_core.errors import ConfigError, FabricError

from .._spawn import child_env, reap
from .plan import PlanOptions, TransferPlan
from .reference import Pattern, full_tensors, real_elements, shard
from .spec import DType, ExpertPlacement, FleetSpec, FsdpShard, ParamSpec, Replicated, tp_column, tp_row

__all__ = ["RlBenchError", "RlBenchResult", "RlBenchSpec", "plan_for", "run_rl_bench", "synthetic_model"]

logger = logging.getLogger(__name__)

_POISON = 0x7F  # every byte of a destination before a step: bf16 3.4e38, fp8 NaN; never a pattern value


class RlBenchError(FabricError):
    """A rank failed, hung past the deadline, or landed bytes other than the reference's."""


_CASTS: dict[str, DType] = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


def cast_dtype(name: str) -> DType:
    """``name`` as a dtype the inference side may hold the projections in."""
    try:
        return _CASTS[name]
    except KeyError:
        raise ConfigError(f"cast must be one of {', '.join(_CASTS)}, got {name!r}") from None


# --- the model -----------------------------------------------------------------------------------
def _hidden(model_bytes: int, layers: int, vocab: int) -> int:
    """The hidden size (a multiple of 128) whose model is closest to ``model_bytes`` in bf16:
    every layer is about 16 h^2 parameters (attention 4 h^2, dense MLP or experts 12 h^2), the
    embedding and the head 2 V h."""
    params = model_bytes / 2
    h = (-2 * vocab + math.sqrt(4 * vocab * vocab + 64 * layers * params)) / (32 * layers)
    return max(128, round(h / 128) * 128)


def synthetic_model(
    model_bytes: int,
    trainers: int,
    inference: int,
    *,
    layers: int = 8,
    experts: int = 8,
    vocab: int = 32768,
    cast: str | None = None,
) -> tuple[FleetSpec, FleetSpec]:
    """The benchmark's model as the two fleets hold it (see the module's docstring): odd
    layers are mixtures of ``experts`` experts, even ones dense."""
    if layers < 1 or experts < 1 or vocab < 1:
        raise ConfigError(f"layers, experts and vocab must be >= 1, got {layers}, {experts}, {vocab}")
    h = _hidden(model_bytes, layers, vocab)
    bf: DType = "bfloat16"
    proj = cast_dtype(cast or bf)
    fsdp = FsdpShard()
    src: list[ParamSpec] = [ParamSpec("embed", (vocab, h), bf, fsdp)]
    dst: list[ParamSpec] = [ParamSpec("embed", (vocab, h), bf, tp_row())]

    def both(name: str, shape: tuple[int, ...], s: Any, d: Any, dtype: DType = bf) -> None:
        src.append(ParamSpec(name, shape, bf, s))
        dst.append(ParamSpec(name, shape, dtype, d))

    for i in range(layers):
        pre = f"layers.{i}."
        both(pre + "attn_norm", (h,), fsdp, Replicated())
        # fused projections: each inference rank holds its slices of q, k and v (of gate and
        # up) back to back, as an inference engine's fused linear layers do
        both(pre + "attn.qkv", (3 * h, h), fsdp, tp_row(sections=(h, h, h)), proj)
        both(pre + "attn.o_proj", (h, h), fsdp, tp_column(), proj)
        both(pre + "mlp_norm", (h,), fsdp, Replicated())
        if i % 2:
            f = h // 2
            both(pre + "mlp.router", (experts, h), fsdp, Replicated())
            src_ep = ExpertPlacement.contiguous(experts, trainers)
            dst_ep = ExpertPlacement.contiguous(experts, inference)
            both(pre + "mlp.experts.w13", (experts, 2 * f, h), src_ep, dst_ep, proj)
            both(pre + "mlp.experts.w2", (experts, h, f), src_ep, dst_ep, proj)
        else:
            both(pre + "mlp.gate_up", (8 * h, h), fsdp, tp_row(sections=(4 * h, 4 * h)), proj)
            both(pre + "mlp.down", (h, 4 * h), fsdp, tp_column(), proj)
    both("norm", (h,), fsdp, Replicated())
    both("lm_head", (vocab, h), fsdp, tp_row())
    return FleetSpec(trainers, tuple(src)), FleetSpec(inference, tuple(dst))


# --- what to run -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RlBenchSpec:
    """What to run. ``source``/``destination`` replace the synthetic model (both or neither).
    ``content``: ``"pattern"`` (each rank fills or checks its pieces from ``Pattern``: any
    size) or ``"reference"`` (every rank builds the full tensors from the seed and cuts them
    with the torch reference: small models). ``engine_options`` go to ``open_engine``."""

    backend: str
    trainers: int = 4
    inference: int = 2
    model_bytes: int = 2 << 30
    layers: int = 8
    experts: int = 8
    vocab: int = 32768
    cast: str | None = None
    steps: int = 3
    warmup: int = 1
    staging_bytes: int = 256 << 20
    max_write_bytes: int = 1 << 30
    content: Literal["pattern", "reference"] = "pattern"
    source: FleetSpec | None = None
    destination: FleetSpec | None = None
    seed: int = 0
    timeout: float = 300.0
    ceiling: str | None = None
    ceiling_provider: str = "shm"
    sender_nice: int = 0
    """Nice value of the trainer processes, and of the ceiling program's writers alike (0-19).
    On one host over shm the receivers do the copies, and a sender waiting in the provider on
    a receiver's queue lock spins on a CPU the copy needs (6 ranks on 2 cores: the trainers
    took 68% of the CPU during the steps). Fleets on separate hosts do not compete so."""
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.trainers < 1 or self.inference < 1:
            raise ConfigError(f"trainers and inference must be >= 1, got {self.trainers}, {self.inference}")
        if self.steps < 1 or self.warmup < 0:
            raise ConfigError(f"steps must be >= 1 and warmup >= 0, got {self.steps} and {self.warmup}")
        if self.content not in ("pattern", "reference"):
            raise ConfigError(f"content must be 'pattern' or 'reference', got {self.content!r}")
        if (self.source is None) != (self.destination is None):
            raise ConfigError("give both source and destination fleets, or neither")
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be > 0, got {self.timeout}")
        if (
            isinstance(self.sender_nice, bool)
            or not isinstance(self.sender_nice, int)
            or not 0 <= self.sender_nice <= 19
        ):
            raise ConfigError(f"sender_nice must be an int from 0 to 19, got {self.sender_nice!r}")
        if self.sender_nice and self.backend == "sim":
            raise ConfigError("sender_nice needs ranks in processes: the simulator runs them as threads")
        self.options()  # the plan's own checks of staging_bytes and max_write_bytes
        if self.model_bytes < 1 << 20:
            raise ConfigError(f"model_bytes must be at least 1 MiB, got {self.model_bytes}")
        if self.cast is not None:
            cast_dtype(self.cast)
        src, dst = self.fleets()
        if src.world_size != self.trainers or dst.world_size != self.inference:
            raise ConfigError(
                f"the fleets have {src.world_size} and {dst.world_size} ranks, "
                f"the spec {self.trainers} and {self.inference}"
            )

    def fleets(self) -> tuple[FleetSpec, FleetSpec]:
        if self.source is not None and self.destination is not None:
            return self.source, self.destination
        return synthetic_model(
            self.model_bytes,
            self.trainers,
            self.inference,
            layers=self.layers,
            experts=self.experts,
            vocab=self.vocab,
            cast=self.cast,
        )

    def options(self) -> PlanOptions:
        return PlanOptions(staging_bytes=self.staging_bytes, max_write_bytes=self.max_write_bytes)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["source"] = None if self.source is None else self.source.to_dict()
        out["destination"] = None if self.destination is None else self.destination.to_dict()
        return out


def plan_for(spec: RlBenchSpec, nics: int = 1) -> TransferPlan:
    """The plan of ``spec``'s model over ``nics`` NICs per rank (what ``--explain`` prints;
    a run's ranks cap ``max_write_bytes`` at their engines' ``max_msg_size``)."""
    from .plan import make_plan

    src, dst = spec.fleets()
    return make_plan(src, dst, PlanOptions(**{**spec.options().to_dict(), "num_nics": nics}))


# --- one rank --------------------------------------------------------------------------------------
_PREFIX = "rl-bench"


def _key(*parts: object) -> str:
    return "/".join((_PREFIX, *map(str, parts)))


class _Contents:
    """Fills a source rank's buffer and checks a destination rank's, by ``spec.content``."""

    def __init__(self, spec: RlBenchSpec, src: FleetSpec, dst: FleetSpec) -> None:
        self.spec, self.src, self.dst = spec, src, dst
        self._pattern = Pattern(spec.seed) if spec.content == "pattern" else None
        self._fulls: dict[str, Any] | None = None

    def fulls(self) -> dict[str, Any]:
        if self._fulls is None:
            self._fulls = full_tensors(self.src, self.spec.seed)
        return self._fulls

    def fill(self, rank: int, views: dict[str, Any]) -> None:
        if self._pattern is not None:
            self._pattern.fill(views, self.src, rank)
            return
        for p in self.src.params:
            views[p.name].copy_(shard(self.fulls()[p.name], p, self.src.world_size, rank))

    def mismatch(self, rank: int, views: dict[str, Any]) -> str | None:
        if self._pattern is not None:
            return self._pattern.mismatch(views, self.dst, rank)
        import torch

        for p in self.dst.params:
            full = self.fulls()[p.name].to(getattr(torch, p.dtype))
            want = shard(full, p, self.dst.world_size, rank).reshape(-1)
            real = real_elements(p, self.dst.world_size, rank)
            got = views[p.name].reshape(-1)[:real]
            if not torch.equal(got.view(torch.uint8), want[:real].contiguous().view(torch.uint8)):
                return f"rank {rank}: {p.name} differs from the torch reference reshard"
        return None


def _sync(store: Any, step: int, timeout: float) -> None:
    """Report ready for ``step`` and wait for the coordinator's go."""
    store.add(_key("ready", step), 1)
    store.wait([_key("go", step)], timedelta(seconds=timeout))


def _wait_count(store: Any, key: str, ranks: int, timeout: float, late: str, alive: Any = None) -> None:
    """Wait until the Store counter ``key`` reaches ``ranks`` (``alive()`` between polls);
    ``RlBenchError`` saying ``late`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < ranks:
        if time.monotonic() > deadline:
            raise RlBenchError(f"{late} within {timeout} s")
        if alive is not None:
            alive()
        time.sleep(0.001)


def _source_body(rank: int, spec: RlBenchSpec, engine: Any, store: Any) -> dict[str, Any]:
    from .sender import WeightsSender

    src, dst = spec.fleets()
    layout = src.layout(rank)
    buf = layout.allocate("cpu")
    _Contents(spec, src, dst).fill(rank, layout.views(buf))
    sender = WeightsSender.connect(
        engine,
        store,
        rank=rank,
        source=src,
        buffer=buf,
        options=spec.options(),
        prefix=_PREFIX,
        timeout=spec.timeout,
    )
    starts, ends, high = [], [], 0
    try:
        for step in range(spec.warmup + spec.steps):
            _sync(store, step, spec.timeout)
            t0 = time.monotonic()
            report = sender.send_step(step, timeout=spec.timeout)
            ends.append(time.monotonic())
            starts.append(t0)
            high = max(high, report.staging_high_water)
            store.add(_key("done", step), 1)
    finally:
        sender.close()
    return {
        "starts": starts,
        "ends": ends,
        "bytes": sender.bytes_per_step,
        "writes": sender.writes_per_step,
        "staged": sender.staged_per_step,
        "staging_high_water": high,
        "staging_capacity": sender.staging.capacity if sender.staging is not None else 0,
        "nic_bytes_written": _per_nic(engine, "bytes_written"),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "plan": sender.plan.to_bytes() if rank == 0 else None,
    }


def _destination_body(rank: int, spec: RlBenchSpec, engine: Any, store: Any) -> dict[str, Any]:
    from .receiver import WeightsReceiver

    src, dst = spec.fleets()
    layout = dst.layout(rank)
    buf = layout.allocate("cpu")
    views = layout.views(buf)
    contents = _Contents(spec, src, dst)
    receiver = WeightsReceiver.connect(
        engine, store, rank=rank, destination=dst, buffer=buf, prefix=_PREFIX, timeout=spec.timeout
    )
    ends: list[float] = []
    try:
        for step in range(spec.warmup + spec.steps):
            buf.fill_(_POISON)
            _sync(store, step, spec.timeout)
            receiver.wait_step(step, timeout=spec.timeout)
            ends.append(time.monotonic())
            # The check reads every byte: begun while another rank still takes the step, it
            # would take that rank's CPU and memory bandwidth and time the check, not the step
            store.add(_key("landed", step), 1)
            late = f"step {step}: not every inference rank had fenced"
            _wait_count(store, _key("landed", step), spec.inference, spec.timeout, late)
            problem = contents.mismatch(rank, views)
            if problem is not None:
                raise RlBenchError(f"step {step}: {problem}")
            store.add(_key("done", step), 1)
    finally:
        receiver.close()
    return {"ends": ends, "bytes": receiver.bytes_per_step, "nic_imms": _per_nic(engine, "imms_received")}


def _per_nic(engine: Any, what: str) -> list[int]:
    """``what`` (a ``NicStats`` field) of each NIC of the engine, measured by the engine."""
    return [int(getattr(n, what)) for n in engine.stats().nics]


def _coordinate(store: Any, spec: RlBenchSpec, alive: Any = None) -> None:
    """Say go for every step once every rank is ready, and wait for every rank to finish it."""
    ranks = spec.trainers + spec.inference
    for step in range(spec.warmup + spec.steps):
        for what in ("ready", "done"):
            late = f"step {step}: not every rank was {what}"
            _wait_count(store, _key(what, step), ranks, spec.timeout, late, alive)
            if what == "ready":
                store.set(_key("go", step), "1")


# --- processes and threads ---------------------------------------------------------------------------
def _process_rank(role: str, rank: int, spec: RlBenchSpec, port: int, conn: Any) -> None:
    """A spawned rank: its engine, the parent's store, the body; the result or the error back."""
    import torch
    import torch.distributed as dist

    from fabric_core import open_engine
    from fabric_core.diagnostics import install_state_dump

    torch.set_num_threads(1)
    if role == "source" and spec.sender_nice:
        os.setpriority(os.PRIO_PROCESS, 0, spec.sender_nice)  # before the engine: its threads inherit it
    install_state_dump()  # `fabric info --pending PID` shows what a rank waits for
    engine = None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=spec.timeout)
        )
        engine = open_engine(spec.backend, **spec.engine_options)
        body = _source_body if role == "source" else _destination_body
        conn.send(("ok", body(rank, spec, engine, store)))
    except BaseException as exc:
        conn.send(("error", f"{role} {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    finally:
        if engine is not None:
            engine.close()
        conn.close()


def _run_processes(spec: RlBenchSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout)
    )
    ctx = mp.get_context("spawn")
    roles = [("source", r) for r in range(spec.trainers)] + [
        ("destination", r) for r in range(spec.inference)
    ]
    pipes = [ctx.Pipe(duplex=False) for _ in roles]
    procs = [
        ctx.Process(target=_process_rank, args=(role, r, spec, store.port, pipes[i][1]), daemon=True)
        for i, (role, r) in enumerate(roles)
    ]
    with child_env():
        for p in procs:
            p.start()
    for _, there in pipes:
        there.close()  # a dead rank reads as EOF here, not as a hang
    results: list[dict[str, Any] | None] = [None] * len(roles)
    errors: list[str] = []
    waiting = {here: i for i, (here, _) in enumerate(pipes)}

    def collect(block: float) -> None:
        ready: list[Any] = mp_connection.wait(list(waiting), block)
        for here in ready:
            i = waiting.pop(here)
            try:
                status, body = here.recv()
            except EOFError:
                procs[i].join(5)
                errors.append(
                    f"{roles[i][0]} {roles[i][1]}: exited with code {procs[i].exitcode} and no result"
                )
                continue
            if status == "ok":
                results[i] = body
            else:
                errors.append(body)

    def alive() -> None:  # a failed rank ends the run instead of the deadline
        collect(0)
        if errors:
            raise RlBenchError("; ".join(errors))

    try:
        try:
            _coordinate(store, spec, alive)
        except RlBenchError as exc:
            if not errors:
                errors.append(str(exc))
        deadline = time.monotonic() + spec.timeout
        while waiting and not errors and time.monotonic() < deadline:
            collect(max(0.0, deadline - time.monotonic()))
        if waiting and not errors:
            errors.append(
                f"ranks {sorted(roles[i] for i in waiting.values())}: no result before the deadline"
            )
    finally:
        reap(procs, kill=bool(errors))
    if errors:
        raise RlBenchError("; ".join(errors))
    done = [r for r in results if r is not None]
    return done[: spec.trainers], done[spec.trainers :]


def _run_threads(spec: RlBenchSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The simulator: one engine per rank on one ``SimFabric``, every rank a thread."""
    import torch.distributed as dist

    from fabric_sim import SimFabric

    fabric = SimFabric(spec.seed)
    nics = int(spec.engine_options.get("nics", 2))
    n = spec.trainers + spec.inference
    engines = [fabric.open_engine(nics) for _ in range(n)]
    store = dist.HashStore()  # type: ignore[attr-defined]
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            if i < spec.trainers:
                out[i] = _source_body(i, spec, engines[i], store)
            else:
                out[i] = _destination_body(i - spec.trainers, spec, engines[i], store)
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()

    def alive() -> None:
        failed = [x for x in out if isinstance(x, BaseException)]
        if failed:
            raise RlBenchError("; ".join(f"{type(x).__name__}: {x}" for x in failed))

    try:
        _coordinate(store, spec, alive)
        for th in threads:
            th.join(spec.timeout)
    finally:
        for e in engines:
            e.close(timeout=2.0)
    alive()
    if any(th.is_alive() for th in threads):
        raise RlBenchError(f"ranks still running after {spec.timeout} s")
    return out[: spec.trainers], out[spec.trainers :]


# --- the ceiling -------------------------------------------------------------------------------------
CEILING_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
"""Write sizes the ceiling runs at (the bound takes the best)."""


def _ceiling_run(spec: RlBenchSpec, pairs: int, size: int, span: int, per_rep: int) -> float:
    """Aggregate GB/s of ``pairs`` copies of the ceiling program at once (each a writer and
    a target process, ``per_rep`` bytes a repetition): all their bytes over the union of
    their times."""
    args = ["-s", str(size), "-r", "3", "-l", "0", "-b", str(span), "-n", str(per_rep)]
    bw = [r for r in _run_ceiling_program(spec, args, pairs) if r.get("kind") == "bandwidth"]
    moved = sum(r["size"] * r["writes"] * r["reps"] for r in bw)
    return float(moved / (max(r["t_end"] for r in bw) - min(r["t_start"] for r in bw)) / 1e9)


def _run_ceiling_program(spec: RlBenchSpec, args: list[str], copies: int) -> list[dict[str, Any]]:
    """Run ``copies`` of the ceiling program at once with ``args``; their JSON rows."""
    assert spec.ceiling is not None
    cmd = [spec.ceiling, "-p", spec.ceiling_provider, *args]
    if spec.sender_nice:
        cmd += ["-N", str(spec.sender_nice)]  # its writers, as the trainers
    env = {**os.environ, "FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo")}
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(copies):
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outs = [p.communicate(timeout=600) for p in procs]
    except (OSError, subprocess.SubprocessError) as exc:
        raise RlBenchError(f"the ceiling program {spec.ceiling} failed: {exc}") from None
    finally:
        for p in procs:  # none outlives the run (a copy that hangs would load the next phase)
            if p.poll() is None:
                p.kill()
                p.wait(5)
    rows = []
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RlBenchError(f"the ceiling program exited with {p.returncode}: {err.strip()[-300:]}")
        rows += [json.loads(line) for line in out.splitlines() if line.strip()]
    return rows


FAN_WINDOWS: dict[str, list[str]] = {"shared 64": ["-w", "64"], "2 per target": ["-W", "2"]}
"""How the ceiling's fan keeps writes in flight: its window shared by the targets, and two per
target (the raw form of the engine's queue depth on shm). The bound takes the better."""


def _fan_run(spec: RlBenchSpec, per_rep: int, span: int, window: list[str]) -> dict[str, float]:
    """GB/s by size of the ceiling program as this update's fan: ``trainers`` writers, each
    writing ``per_rep`` bytes round robin to ``inference`` targets, timed from the first
    writer's start to the last target's count."""
    args = [
        "-f",
        f"{spec.trainers}:{spec.inference}",
        "-n",
        str(per_rep),
        "-r",
        "3",
        "-b",
        str(span),
        *window,
    ]
    rows = _run_ceiling_program(spec, [*args, "-s", ",".join(map(str, CEILING_SIZES))], 1)
    fan = [r for r in rows if r.get("kind") == "fan_bandwidth"]
    if len(fan) != len(CEILING_SIZES):
        raise RlBenchError(f"the ceiling program {spec.ceiling} gave no fan rows (built before -f?)")
    return {str(r["size"]): float(r["gbytes_per_s"]) for r in fan}


def _ceiling(
    spec: RlBenchSpec, per_source: int
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """GB/s by pairs and size (one pair, and as many pairs as trainers), and by fan window
    (``FAN_WINDOWS``) and size for the update's own fan. Each writer writes a trainer's share
    a repetition (4 MiB to 1 GiB)."""
    span = max(CEILING_SIZES[-1], min(per_source, 512 << 20))
    per_rep = min(max(per_source, 4 << 20), 1 << 30)
    pairs_out: dict[str, dict[str, float]] = {}
    for pairs in sorted({1, spec.trainers}):
        pairs_out[str(pairs)] = {
            str(size): _ceiling_run(spec, pairs, size, span, per_rep) for size in CEILING_SIZES
        }
    return pairs_out, {name: _fan_run(spec, per_rep, span, w) for name, w in FAN_WINDOWS.items()}


# --- results --------------------------------------------------------------------------------------------
@dataclass
class RlBenchResult:
    """What one run measured (``to_json`` for the file)."""

    spec: RlBenchSpec
    plan: TransferPlan
    step_seconds: list[float]
    """Per timed step: first trainer's start to last inference rank's fence."""
    sources: list[dict[str, Any]]
    destinations: list[dict[str, Any]]
    ceiling: dict[str, Any] | None
    host: dict[str, Any]
    duration_s: float

    @property
    def bytes_per_step(self) -> int:
        return self.plan.total_bytes

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes_per_step / self.median_s / 1e9

    @property
    def ceiling_gbytes_per_s(self) -> float | None:
        """The best aggregate the ceiling reached as this update's fan (any size, before or
        after); the best of its pair runs where it has no fan runs."""
        if not self.ceiling:
            return None
        fan: list[dict[str, float]] = self.ceiling.get("fan_runs") or []
        if fan:
            return max(v for run in fan for v in run.values())
        return self.pairs_gbytes_per_s

    @property
    def pairs_gbytes_per_s(self) -> float | None:
        """The best aggregate of the independent pairs (any count, size, before or after)."""
        if not self.ceiling:
            return None
        runs: list[dict[str, dict[str, float]]] = self.ceiling["runs"]
        return max(v for run in runs for by_size in run.values() for v in by_size.values())

    @property
    def bound_s(self) -> float | None:
        c = self.ceiling_gbytes_per_s
        return None if c is None else self.bytes_per_step / (c * 1e9)

    @property
    def ratio(self) -> float | None:
        """Median update time over the bound (target <= 1.25)."""
        b = self.bound_s
        return None if b is None else self.median_s / b

    def ratio_by_pairs(self) -> dict[str, float]:
        """Median update time over the bound that each pair count of the ceiling alone gives
        (its best size, before or after): how much of the gap the host's oversubscription
        explains, since the raw program too loses bandwidth with more processes than cores."""
        if not self.ceiling:
            return {}
        runs: list[dict[str, dict[str, float]]] = self.ceiling["runs"]
        best: dict[str, float] = {}
        for run in runs:
            for pairs, by_size in run.items():
                best[pairs] = max(best.get(pairs, 0.0), *by_size.values())
        return {p: self.median_s / (self.bytes_per_step / (g * 1e9)) for p, g in best.items()}

    @property
    def staging_high_water(self) -> int:
        return max((s["staging_high_water"] for s in self.sources), default=0)

    def timeline(self) -> list[dict[str, Any]]:
        """Per timed step, in ms from the first trainer's start: when each trainer started,
        when each trainer's writes had all completed there, and when each inference rank's
        fence passed (the step ends at the last of these). Empty without per-rank times."""
        out: list[dict[str, Any]] = []
        if not (self.sources and self.destinations):
            return out
        for i in range(self.spec.warmup, self.spec.warmup + self.spec.steps):
            t0 = min(s["starts"][i] for s in self.sources)
            out.append(
                {
                    "trainers_started": [(s["starts"][i] - t0) * 1e3 for s in self.sources],
                    "trainers_done": [(s["ends"][i] - t0) * 1e3 for s in self.sources],
                    "inference_fenced": [(d["ends"][i] - t0) * 1e3 for d in self.destinations],
                }
            )
        return out

    def to_json(self) -> dict[str, Any]:
        b = self.plan.balance()
        return {
            "kind": "rl",
            "spec": self.spec.to_json(),
            "host": self.host,
            "duration_s": self.duration_s,
            "plan": {
                "digest": self.plan.digest(),
                "writes": len(self.plan),
                "bytes": self.plan.total_bytes,
                "staged_bytes": self.plan.staged_bytes,
                "packed_bytes": self.plan.packed_bytes,
                "serialized_bytes": len(self.plan.to_bytes()),
                "parameters": len(self.plan.destination.params),
                "bytes_per_source": list(b.bytes_per_source),
                "bytes_per_destination": list(b.bytes_per_destination),
                "bytes_per_source_nic": [list(x) for x in b.bytes_per_source_nic],
                "bytes_per_destination_nic": [list(x) for x in b.bytes_per_destination_nic],
                "writes_per_source": list(b.writes_per_source),
                "source_imbalance": b.source_imbalance,
                "source_nic_imbalance": b.source_nic_imbalance,
                "destination_nic_imbalance": b.destination_nic_imbalance,
            },
            "step_seconds": self.step_seconds,
            "timeline_ms": self.timeline(),
            "median_s": self.median_s,
            "gbytes_per_s": self.gbytes_per_s,
            "ceiling": self.ceiling,
            "ceiling_gbytes_per_s": self.ceiling_gbytes_per_s,
            "pairs_gbytes_per_s": self.pairs_gbytes_per_s,
            "ratio_by_pairs": self.ratio_by_pairs(),
            "bound_s": self.bound_s,
            "ratio_to_bound": self.ratio,
            "staging": {
                "watermark": self.plan.options.staging_bytes,
                "high_water": self.staging_high_water,
                "per_source": [s["staging_high_water"] for s in self.sources],
            },
            "checked_steps": self.spec.warmup + self.spec.steps,
            "measured": {
                "nic_bytes_written_per_source": [s["nic_bytes_written"] for s in self.sources],
                "nic_imms_per_destination": [d["nic_imms"] for d in self.destinations],
                "writes_per_source": [s["writes"] for s in self.sources],
                "nice_per_source": [s["nice"] for s in self.sources],
                "bytes_per_destination": [d["bytes"] for d in self.destinations],
            },
        }


def run_rl_bench(spec: RlBenchSpec) -> RlBenchResult:
    """Run ``spec``; ``RlBenchError`` if a rank fails, hangs or lands other bytes."""
    from fabric_core.cli.bench import host_info

    start = time.perf_counter()
    src, _dst = spec.fleets()
    runs: list[dict[str, dict[str, float]]] = []
    fan_runs: list[dict[str, float]] = []
    fan_windows: list[dict[str, dict[str, float]]] = []
    per_source = max(1, sum(p.nbytes for p in src.params) // spec.trainers)

    def measure_ceiling() -> None:
        pairs, fans = _ceiling(spec, per_source)
        runs.append(pairs)
        fan_windows.append(fans)
        # per size, the better window
        fan_runs.append({size: max(f[size] for f in fans.values()) for size in next(iter(fans.values()))})

    if spec.ceiling:  # before the ranks start and after they exit: nothing else running
        measure_ceiling()
    if spec.backend == "sim":
        sources, destinations = _run_threads(spec)
    else:
        sources, destinations = _run_processes(spec)
    if spec.ceiling:
        measure_ceiling()
    plan = TransferPlan.from_bytes(sources[0]["plan"])  # the one every rank computed and agreed on
    first = spec.warmup
    steps = [
        max(d["ends"][i] for d in destinations) - min(s["starts"][i] for s in sources)
        for i in range(first, first + spec.steps)
    ]
    ceiling = None
    if spec.ceiling:
        ceiling = {
            "provider": spec.ceiling_provider,
            "program": os.path.basename(spec.ceiling),
            "sizes": list(CEILING_SIZES),
            "runs": runs,
            "fan": f"{spec.trainers}:{spec.inference}",
            "fan_runs": fan_runs,
            "fan_windows": fan_windows,
        }
    return RlBenchResult(
        spec, plan, steps, sources, destinations, ceiling, host_info(), time.perf_counter() - start
    )
