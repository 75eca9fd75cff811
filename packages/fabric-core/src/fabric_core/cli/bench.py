"""``fabric bench``: a point-to-point sweep between two engines of this process.

Per size it measures
* latency: one write with an imm, then the target's counter wait for ``imms_at_target``;
* bandwidth and ops/s: a window of writes submitted back to back, then one wait for the total count;
* a data check: the first write of every size is compared byte for byte with its source.

Then a paged-write rate (pages of 4 KiB, one imm per page) and the Python cost of one submit call.
On the simulator with a link model it also reports virtual-clock numbers (``SimFabric.now`` deltas).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import selectors
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click
import numpy as np

from .. import registry
from ..api import TransferEngine
from ..errors import BackendNotInstalled, BackendUnavailable, ConfigError, FabricError, PeerUnreachable
from ..models import MemoryRegion
from ..settings import FabricSettings, load_settings
from ..stats import NicStats
from ..transfer import Transfer
from ._target import LocalTarget, RemoteTarget, Target, serve_target
from ._util import (
    SimFabricLike,
    dist_version,
    format_count,
    format_size,
    new_sim_fabric,
    sim_link_presets,
    size_option,
    sizes_option,
    write_json,
)

__all__ = [
    "DEFAULT_SIZES",
    "BenchReport",
    "Budget",
    "EnginePair",
    "PagedResult",
    "SizeResult",
    "bench",
    "open_pair",
    "run_sweep",
]

DEFAULT_SIZES: tuple[int, ...] = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20)
"""Powers-of-8 steps from 8 B, capped at 64 MiB."""
MAX_SIZE = 1 << 30
DEFAULT_SIM_LINK = "cx7-400g"
GUARD = 64
"""Bytes after each checked write that must stay untouched."""
PAGES = 1024
"""Pages per paged request in a full sweep: a prompt's KV cache moves in requests of 1,000+."""
PAGE_BYTES = 4096
IMM_BASE = 0xFAB0_0000


@dataclass(frozen=True, slots=True)
class Budget:
    """How much work each phase does. Phases stop at their time budget once past their minimum."""

    latency_s: float
    latency_min: int
    latency_max: int
    rate_s: float
    rate_min_rounds: int
    window_bytes: int
    window_max: int
    submit_calls: int
    paged_window: int
    pages: int = PAGES

    def window(self, size: int) -> int:
        return max(1, min(self.window_max, self.window_bytes // size))


DEFAULT_BUDGET = Budget(
    latency_s=1.0,
    latency_min=10,
    latency_max=2000,
    rate_s=1.5,
    rate_min_rounds=2,
    window_bytes=256 << 20,
    window_max=128,
    submit_calls=2000,
    paged_window=4,
)
QUICK_BUDGET = Budget(
    latency_s=0.04,
    latency_min=3,
    latency_max=50,
    rate_s=0.06,
    rate_min_rounds=1,
    window_bytes=32 << 20,
    window_max=16,
    submit_calls=200,
    paged_window=2,
    pages=256,
)


class BenchFailure(FabricError):
    """The backend moved wrong bytes or wrong counts: the numbers would be meaningless."""


def _present(result: Any) -> dict[str, Any]:
    """A result's fields, leaving out the simulated figures a backend did not report."""
    return {k: v for k, v in asdict(result).items() if v is not None}


@dataclass(slots=True)
class SizeResult:
    size: int
    iters: int
    ops: int
    window: int
    work_requests: int
    latency_us_p50: float
    latency_us_p99: float
    bandwidth_gbps: float
    bandwidth_gbytes_per_s: float
    ops_per_s: float
    sim_latency_us_p50: float | None = None
    sim_latency_us_p99: float | None = None
    sim_bandwidth_gbps: float | None = None
    sim_ops_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = _present(self)
        out["work_requests_per_write"] = out.pop("work_requests")
        return out


@dataclass(slots=True)
class PagedResult:
    pages: int
    page_bytes: int
    iters: int
    ops: int
    latency_us_p50: float
    latency_us_p99: float
    pages_per_s: float
    bandwidth_gbps: float
    submit_cost_us: float
    sim_latency_us_p50: float | None = None
    sim_pages_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"imms_per_write": self.pages, **_present(self)}


@dataclass(slots=True)
class BenchReport:
    backend: str
    backend_version: str
    nics: int
    link: str | None
    seed: int
    quick: bool
    fixed_iters: int | None
    started: str
    latency: str = "one-way"
    results: list[SizeResult] = field(default_factory=list)
    paged: PagedResult | None = None
    submit_cost_us: float = 0.0
    sim_throughput_wrs_per_s: float | None = None
    sim_events_per_s: float | None = None
    duration_s: float = 0.0
    per_nic: list[dict[str, int]] = field(default_factory=list)
    """The writer's NICs over the sweep: which carried how many bytes and work requests."""

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "backend_version": self.backend_version,
            "fabric_core_version": dist_version("fabric-core"),
            "nics": self.nics,
            "link": self.link,
            "seed": self.seed,
            "quick": self.quick,
            "iters": self.fixed_iters,
            "host": host_info(),
            "started": self.started,
            "latency": self.latency,
            "duration_s": self.duration_s,
            "results": [r.to_json() for r in self.results],
            "paged": self.paged.to_json() if self.paged is not None else None,
            "submit_cost_us": self.submit_cost_us,
            "sim_throughput_wrs_per_s": self.sim_throughput_wrs_per_s,
            "sim_events_per_s": self.sim_events_per_s,
            "per_nic": self.per_nic,
        }


def host_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "numpy": np.__version__,
    }


# --- engines --------------------------------------------------------------------------------


@dataclass(slots=True)
class EnginePair:
    """A writer engine and the target it writes to (an engine here, or one in a bench server);
    ``fabric`` is set when both run on a dedicated simulator."""

    backend: str
    backend_version: str
    writer: TransferEngine
    target: Target
    fabric: SimFabricLike | None = None
    link: str | None = None

    @property
    def clock(self) -> SimFabricLike | None:
        """The simulator when it has a virtual clock (a link model), else None."""
        return self.fabric if self.link is not None else None


def resolve_backend(name: str, settings: FabricSettings, notice: Callable[[str], None]) -> str:
    """The backend to run for ``name``; ``auto`` falls back to the simulator with a notice."""
    if name == "auto":
        try:
            return registry.select_backend(settings.model_copy(update={"backend": "auto"})).name
        except BackendUnavailable:
            reasons = "".join(f"\n  {n}: {registry.probe(n).reason}" for n in registry.AUTO_ORDER)
            notice(f"no RDMA backend can run here; falling back to the simulator (backend 'sim').{reasons}")
            registry.load_backend("sim")  # BackendNotInstalled (with its install hint) if it is absent
            return "sim"
    return registry.select_backend(settings.model_copy(update={"backend": name})).name


def backend_option(fn: Any) -> Any:
    """``--backend NAME`` of an application benchmark (resolved by ``app_backend``)."""
    return click.option(
        "--backend",
        metavar="NAME",
        default=None,
        help="efa, verbs, sim or auto.  [default: FABRIC_BACKEND, else auto]",
    )(fn)


def app_backend(backend: str | None) -> str:
    """The backend an application benchmark runs on: ``--backend``, else ``FABRIC_BACKEND``,
    else auto; a bad name is a usage error, a missing backend a clear one."""
    try:
        settings = load_settings()
        return resolve_backend(
            backend or settings.backend, settings, lambda t: click.echo(f"fabric bench: {t}", err=True)
        )
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--backend'") from None
    except (BackendNotInstalled, BackendUnavailable) as exc:
        raise click.ClickException(str(exc)) from None


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a (host, port) pair."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


SERVER_BANNER = "fabric bench server: listening on "


def _launch_server(backend: str, nics: int | None, timeout: float) -> tuple[subprocess.Popen[str], str]:
    """Start ``fabric bench --server`` as a child process on loopback; its endpoint."""
    cmd = [sys.executable, "-m", "fabric_core.cli", "bench", "--server", "--listen", "127.0.0.1:0"]
    cmd += ["--backend", backend, *([] if nics is None else ["--nics", str(nics)])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(SERVER_BANNER):
                return proc, line[len(SERVER_BANNER) :].split()[0]
    proc.kill()
    proc.wait()
    raise BackendUnavailable(
        backend, f"the bench server process did not start (exit status {proc.returncode})"
    )


@contextmanager
def open_pair(
    backend: str,
    *,
    nics: int | None,
    link: str | None,
    seed: int,
    settings: FabricSettings,
    connect: str | None = None,
) -> Iterator[EnginePair]:
    """Open the writer and its target. On ``sim`` both engines live on a fresh ``SimFabric`` in
    this process; on any other backend the target is a bench server: the one at ``connect``, or
    else a child process started here (two processes, as on two hosts)."""
    engines: list[TransferEngine] = []
    target: Target | None = None
    server: subprocess.Popen[str] | None = None
    try:
        if backend == "sim":
            fabric = new_sim_fabric(seed, chunk_bytes=settings.sim_chunk_bytes, link=link)
            count = nics or settings.nics or 2
            for _ in range(2):
                engines.append(fabric.open_engine(count))
            target = LocalTarget(engines[1])
            pair = EnginePair("sim", dist_version("fabric-sim"), engines[0], target, fabric, link)
        else:
            cls = registry.load_backend(backend)
            writer = registry.open_engine(backend, **({} if nics is None else {"nics": nics}))
            engines.append(writer)
            if connect is None:
                server, connect = _launch_server(backend, writer.num_nics, max(60.0, settings.timeout_s))
            host, port = parse_endpoint(connect)
            try:
                sock = socket.create_connection((host, port), timeout=30.0)
            except OSError as exc:
                raise PeerUnreachable(f"cannot reach the bench server at {connect}: {exc}") from None
            target = RemoteTarget(writer, sock, settings.timeout_s)
            theirs = target.hello
            if theirs.get("backend") != backend or theirs.get("nics") != writer.num_nics:
                raise ConfigError(
                    f"the bench server runs {theirs.get('backend')} with {theirs.get('nics')} NICs, "
                    f"this side {backend} with {writer.num_nics}: start both with the same --backend "
                    "and --nics"
                )
            pair = EnginePair(backend, registry.backend_version(cls), writer, target)
        yield pair
    finally:
        if target is not None:
            with suppress(FabricError, OSError):
                target.close()
        for engine in reversed(engines):
            engine.close(timeout=5.0)
        if server is not None:
            try:
                server.wait(10.0)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def run_server(
    backend: str, nics: int | None, listen: str, timeout: float, echo: Callable[[str], None]
) -> None:
    """``fabric bench --server``: one engine, one client, then exit."""
    host, port = parse_endpoint(listen)
    cls = registry.load_backend(backend)
    engine = registry.open_engine(backend, **({} if nics is None else {"nics": nics}))
    try:
        with socket.create_server((host, port)) as srv:
            srv.settimeout(timeout)
            bound = srv.getsockname()
            echo(f"{SERVER_BANNER}{host}:{bound[1]} (backend {backend}, {engine.num_nics} NICs)")
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                raise PeerUnreachable(f"no bench client connected within {timeout:g} s") from None
        with conn, conn.makefile("rwb") as stream:
            conn.settimeout(None)
            serve_target(engine, stream, backend=backend, version=registry.backend_version(cls))
        echo(f"fabric bench server: client {peer[0]}:{peer[1]} done")
    finally:
        engine.close(timeout=5.0)


# --- measurement ----------------------------------------------------------------------------


def _percentiles_us(samples: Sequence[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.asarray(samples, dtype=np.float64), [50, 99])
    return float(p50) * 1e6, float(p99) * 1e6


class _Sweep:
    """State of one run: the engines, the registered buffers and the budget."""

    def __init__(
        self, pair: EnginePair, buf_bytes: int, budget: Budget, iters: int | None, seed: int, timeout: float
    ) -> None:
        self.pair = pair
        self.writer, self.target = pair.writer, pair.target
        self.budget = budget
        self.iters = iters
        self.timeout = timeout
        self.src = np.random.default_rng(seed).integers(0, 256, buf_bytes + PAGE_BYTES, dtype=np.uint8)
        self.src_mr: MemoryRegion = self.writer.register(self.src)
        self.desc = self.target.setup(buf_bytes + PAGE_BYTES)
        self.next_imm = IMM_BASE
        self.rate_wall = 0.0
        self.rate_wrs = 0
        self.rate_events = 0

    # -- helpers
    def imm(self) -> int:
        self.next_imm += 1
        return self.next_imm

    def settle(self) -> None:
        """On the simulator, wait until no event is pending so ``now`` is the end of the last op."""
        fabric = self.pair.fabric
        if fabric is not None and not fabric.quiesce(self.timeout):
            raise BenchFailure(f"the simulated fabric did not go idle within {self.timeout:g} s")

    def paused(self) -> AbstractContextManager[None]:
        fabric = self.pair.fabric
        return fabric.paused() if fabric is not None else nullcontext()

    def check_drained(self, imm: int, what: str) -> None:
        extra = self.target.leftover(imm)
        if extra:
            raise BenchFailure(
                f"{what}: the target counted {extra} more imm {imm:#x} than imms_at_target promised"
            )

    def complete(self, transfers: Sequence[Transfer], imm: int) -> None:
        self.target.counted(imm, sum(t.imms_at_target for t in transfers), self.timeout)
        for t in transfers:
            t.wait(self.timeout)

    # -- phases
    def latency(self, submit: Callable[[], Transfer], imm: int) -> tuple[list[float], list[float]]:
        """Wall and (with a clock) virtual seconds of single submit → counter-wait samples (round
        trips on the fabric when the target is in a server: write, then an imm back)."""
        b, clock = self.budget, self.pair.clock
        wall: list[float] = []
        virt: list[float] = []
        limit = self.iters if self.iters is not None else b.latency_max
        start = time.perf_counter()
        while len(wall) < limit:
            if (
                self.iters is None
                and len(wall) >= b.latency_min
                and time.perf_counter() - start > b.latency_s
            ):
                break
            v0 = 0.0
            if clock is not None:
                self.settle()
                v0 = clock.now
            t0 = time.perf_counter()
            transfer = self.target.ping(submit, imm, self.timeout)
            wall.append(time.perf_counter() - t0)
            transfer.wait(self.timeout)
            if clock is not None:
                self.settle()
                virt.append(clock.now - v0)
        self.target.end_ping(imm)
        return wall, virt

    def rate(
        self, submit: Callable[[], Transfer], imm: int, window: int, *, baseline: bool = True
    ) -> tuple[int, float, float]:
        """Pipelined windows: (ops, wall seconds, virtual seconds or 0). With ``baseline`` the
        phase counts towards the simulator's work-requests-per-second figure."""
        b, fabric, clock = self.budget, self.pair.fabric, self.pair.clock
        if clock is None:
            ops, wall = self.stream(submit, imm, window)
            self.rate_wall += wall if baseline else 0.0
            return ops, wall, 0.0
        ops, wall, virt, rounds = 0, 0.0, 0.0, 0
        self.settle()
        wrs0 = fabric.wrs_delivered if fabric is not None else 0
        ev0 = fabric.events if fabric is not None else 0
        while True:
            if self.iters is not None:
                n = min(window, self.iters - ops)
                if n <= 0:
                    break
            else:
                if rounds >= b.rate_min_rounds and wall > b.rate_s:
                    break
                n = window
            v0 = clock.now if clock is not None else 0.0
            t0 = time.perf_counter()
            transfers = [submit() for _ in range(n)]
            self.complete(transfers, imm)
            wall += time.perf_counter() - t0
            if clock is not None:
                self.settle()
                virt += clock.now - v0
            ops += n
            rounds += 1
        self.settle()
        if not baseline:
            return ops, wall, virt
        if fabric is not None:
            self.rate_wrs += fabric.wrs_delivered - wrs0
            self.rate_events += fabric.events - ev0
        self.rate_wall += wall
        return ops, wall, virt

    def stream(self, submit: Callable[[], Transfer], imm: int, window: int) -> tuple[int, float]:
        """A sliding window, as the raw-libfabric ceiling keeps one: ``window`` transfers in
        flight, a new one submitted as the oldest completes, the target's count checked once at
        the end (exactly what ``imms_at_target`` promised). Returns (ops, wall seconds)."""
        b = self.budget
        limit = self.iters if self.iters is not None else math.inf
        pending: deque[Transfer] = deque()
        ops = imms = 0
        start = time.perf_counter()
        while ops < limit:
            if (
                self.iters is None
                and ops >= window * b.rate_min_rounds
                and time.perf_counter() - start > b.rate_s
            ):
                break
            if len(pending) >= window:
                pending.popleft().wait(self.timeout)
            transfer = submit()
            pending.append(transfer)
            imms += transfer.imms_at_target
            ops += 1
        for transfer in pending:
            transfer.wait(self.timeout)
        self.target.counted(imm, imms, self.timeout)
        return ops, time.perf_counter() - start

    def verify_write(self, size: int, imm: int) -> int:
        """One write checked byte for byte (source offset and guard bytes included); its WR count."""
        src_off = 8 + (size % 4001)  # unaligned, so a misplaced copy cannot look right
        self.target.zero(size + GUARD)
        before = self.writer.stats().work_requests
        transfer = self.writer.submit_write(self.src_mr, src_off, size, self.desc, 0, imm=imm)
        self.complete([transfer], imm)
        wrong = self.target.mismatch(0, self.src[src_off : src_off + size])
        if wrong is not None:
            raise BenchFailure(f"data check failed for a {format_size(size)} write: {wrong}")
        if self.target.mismatch(size, np.zeros(GUARD, dtype=np.uint8)) is not None:
            raise BenchFailure(
                f"data check failed for a {format_size(size)} write: bytes past its end changed"
            )
        return max(1, self.writer.stats().work_requests - before)

    def size(self, size: int) -> SizeResult:
        desc = self.desc
        work_requests = self.verify_write(size, self.imm())

        lat_imm = self.imm()
        wall, virt = self.latency(
            lambda: self.writer.submit_write(self.src_mr, 0, size, desc, 0, imm=lat_imm), lat_imm
        )
        self.check_drained(lat_imm, f"{format_size(size)} latency")

        rate_imm = self.imm()
        window = self.budget.window(size)
        ops, rate_wall, rate_virt = self.rate(
            lambda: self.writer.submit_write(self.src_mr, 0, size, desc, 0, imm=rate_imm),
            rate_imm,
            window,
        )
        self.check_drained(rate_imm, f"{format_size(size)} bandwidth")

        p50, p99 = _percentiles_us(wall)
        bytes_per_s = ops * size / rate_wall
        result = SizeResult(
            size=size,
            iters=len(wall),
            ops=ops,
            window=window,
            work_requests=work_requests,
            latency_us_p50=p50,
            latency_us_p99=p99,
            bandwidth_gbps=bytes_per_s * 8 / 1e9,
            bandwidth_gbytes_per_s=bytes_per_s / 1e9,
            ops_per_s=ops / rate_wall,
        )
        if virt and rate_virt > 0:
            result.sim_latency_us_p50, result.sim_latency_us_p99 = _percentiles_us(virt)
            result.sim_bandwidth_gbps = ops * size * 8 / rate_virt / 1e9
            result.sim_ops_per_s = ops / rate_virt
        return result

    def paged(self) -> PagedResult:
        """``budget.pages`` pages of 4 KiB to a shuffled page list, one imm per page."""
        pages = self.budget.pages
        src_pages = np.arange(pages, dtype=np.int64)
        dst_pages = np.random.default_rng(self.next_imm).permutation(pages).astype(np.int64)
        desc = self.desc

        def submit(imm: int) -> Transfer:
            return self.writer.submit_paged_write(
                self.src_mr, src_pages, PAGE_BYTES, desc, dst_pages, PAGE_BYTES, PAGE_BYTES, imm=imm
            )

        check_imm = self.imm()
        self.target.zero(pages * PAGE_BYTES)
        self.complete([submit(check_imm)], check_imm)
        expected = np.empty((pages, PAGE_BYTES), dtype=np.uint8)
        expected[dst_pages] = self.src[: pages * PAGE_BYTES].reshape(pages, PAGE_BYTES)
        if self.target.mismatch(0, expected.reshape(-1)) is not None:
            raise BenchFailure("data check failed for the paged write: pages landed in the wrong place")

        lat_imm = self.imm()
        wall, virt = self.latency(lambda: submit(lat_imm), lat_imm)
        rate_imm = self.imm()
        ops, rate_wall, rate_virt = self.rate(lambda: submit(rate_imm), rate_imm, self.budget.paged_window)
        cost_imm = self.imm()
        costs = self.submit_costs(lambda: submit(cost_imm), cost_imm, max(8, self.budget.submit_calls // 40))
        for imm in (lat_imm, rate_imm, cost_imm):
            self.check_drained(imm, "paged write")

        p50, p99 = _percentiles_us(wall)
        result = PagedResult(
            pages=pages,
            page_bytes=PAGE_BYTES,
            iters=len(wall),
            ops=ops,
            latency_us_p50=p50,
            latency_us_p99=p99,
            pages_per_s=ops * pages / rate_wall,
            bandwidth_gbps=ops * pages * PAGE_BYTES * 8 / rate_wall / 1e9,
            submit_cost_us=float(np.median(costs)) * 1e6,
        )
        if virt and rate_virt > 0:
            result.sim_latency_us_p50 = _percentiles_us(virt)[0]
            result.sim_pages_per_s = ops * pages / rate_virt
        return result

    def submit_costs(self, submit: Callable[[], Transfer], imm: int, calls: int) -> list[float]:
        """Seconds spent in each of ``calls`` submit calls alone. On the simulator delivery is
        paused meanwhile, so the progress thread does not compete for the GIL."""
        costs: list[float] = []
        while len(costs) < calls:
            transfers = []
            with self.paused():
                for _ in range(min(250, calls - len(costs))):
                    t0 = time.perf_counter()
                    transfers.append(submit())
                    costs.append(time.perf_counter() - t0)
            self.complete(transfers, imm)
        self.check_drained(imm, "submit cost")
        return costs

    def close(self) -> None:
        self.writer.deregister(self.src_mr)


def run_sweep(
    pair: EnginePair,
    sizes: Sequence[int],
    *,
    budget: Budget = DEFAULT_BUDGET,
    iters: int | None = None,
    seed: int = 0,
    quick: bool = False,
    timeout: float = 60.0,
    on_result: Callable[[SizeResult], None] = lambda r: None,
) -> BenchReport:
    """Run every phase on ``pair``; ``on_result`` sees each size's row as soon as it is measured."""
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    report = BenchReport(
        backend=pair.backend,
        backend_version=pair.backend_version,
        nics=pair.writer.num_nics,
        link=pair.link,
        seed=seed,
        quick=quick,
        fixed_iters=iters,
        started=started.isoformat(timespec="seconds"),
        latency="round-trip" if pair.target.round_trip else "one-way",
    )
    sweep = _Sweep(pair, max(max(sizes), budget.pages * PAGE_BYTES), budget, iters, seed, timeout)
    nics_before = pair.writer.stats().nics
    try:
        cost_imm = sweep.imm()
        desc = sweep.desc
        costs = sweep.submit_costs(
            lambda: pair.writer.submit_write(sweep.src_mr, 0, 8, desc, 0, imm=cost_imm),
            cost_imm,
            budget.submit_calls,
        )
        report.submit_cost_us = float(np.median(costs)) * 1e6
        for size in sizes:
            result = sweep.size(size)
            report.results.append(result)
            on_result(result)
        report.paged = sweep.paged()
        report.per_nic = _nic_deltas(nics_before, pair.writer.stats().nics)
    finally:
        sweep.close()
    if pair.fabric is not None and sweep.rate_wall > 0:
        report.sim_throughput_wrs_per_s = sweep.rate_wrs / sweep.rate_wall
        report.sim_events_per_s = sweep.rate_events / sweep.rate_wall
    report.duration_s = time.perf_counter() - t0
    return report


def _nic_deltas(before: Sequence[NicStats], after: Sequence[NicStats]) -> list[dict[str, int]]:
    """What each NIC carried between two ``stats().nics`` readings."""
    start = {n.nic: n for n in before}
    out = []
    for n in after:
        b = start.get(n.nic, NicStats(n.nic))
        out.append(
            {
                "nic": n.nic,
                "bytes_written": n.bytes_written - b.bytes_written,
                "work_requests": n.work_requests - b.work_requests,
                "errors": n.errors - b.errors,
                "retries": n.retries - b.retries,
            }
        )
    return out


# --- presentation ---------------------------------------------------------------------------


def _num(x: float) -> str:
    """A positive quantity with about three significant digits, never in exponent form."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    digits = 2 - math.floor(math.log10(x)) if x > 0 else 2
    return f"{x:.{min(digits, 8)}f}"


@dataclass(frozen=True, slots=True)
class _Column:
    header: str
    cell: Callable[[SizeResult], str]
    min_width: int = 8

    @property
    def width(self) -> int:
        return max(len(self.header), self.min_width)


def _columns(clock: bool) -> list[_Column]:
    cols = [
        _Column("size", lambda r: format_size(r.size), 7),
        _Column("iters", lambda r: str(r.iters), 5),
        _Column("lat p50 us", lambda r: _num(r.latency_us_p50)),
        _Column("lat p99 us", lambda r: _num(r.latency_us_p99)),
        _Column("ops", lambda r: str(r.ops), 6),
        _Column("GB/s", lambda r: _num(r.bandwidth_gbytes_per_s)),
        _Column("Gbit/s", lambda r: _num(r.bandwidth_gbps)),
        _Column("ops/s", lambda r: format_count(r.ops_per_s), 6),
    ]
    if clock:
        cols += [
            _Column("sim lat us", lambda r: _num(r.sim_latency_us_p50 or 0.0)),
            _Column("sim Gbit/s", lambda r: _num(r.sim_bandwidth_gbps or 0.0)),
            _Column("sim ops/s", lambda r: format_count(r.sim_ops_per_s or 0.0)),
        ]
    return cols


def _row(cols: Sequence[_Column], cells: Sequence[str]) -> str:
    first = cells[0].ljust(cols[0].width)
    return "  ".join([first, *(c.rjust(col.width) for c, col in zip(cells[1:], cols[1:], strict=True))])


def _sizes(sizes: tuple[int, ...] | None, min_size: int | None, max_size: int | None) -> tuple[int, ...]:
    chosen = [s for s in (sizes or DEFAULT_SIZES) if (min_size is None or s >= min_size)]
    chosen = [s for s in chosen if max_size is None or s <= max_size]
    if min_size is not None and max_size is not None and min_size > max_size:
        raise click.UsageError(
            f"--min-size ({format_size(min_size)}) exceeds --max-size ({format_size(max_size)})"
        )
    if not chosen:
        raise click.UsageError("no size left to measure between --min-size and --max-size")
    too_big = [s for s in chosen if s > MAX_SIZE]
    if too_big:
        raise click.BadParameter(
            f"{format_size(too_big[0])} is above the largest size the bench runs ({format_size(MAX_SIZE)})",
            param_hint="'--sizes'",
        )
    return tuple(chosen)


_COMMANDLINE = click.core.ParameterSource.COMMANDLINE


def _print_summary(report: BenchReport) -> None:
    paged = report.paged
    if paged is not None:
        line = (
            f"paged write ({paged.pages} x {format_size(paged.page_bytes)}, one imm per page): "
            f"{format_count(paged.pages_per_s)} pages/s ({_num(paged.bandwidth_gbps)} Gbit/s), "
            f"latency p50 {_num(paged.latency_us_p50)} us, submit {_num(paged.submit_cost_us)} us"
        )
        if paged.sim_pages_per_s is not None and paged.sim_latency_us_p50 is not None:
            sim_rate, sim_lat = format_count(paged.sim_pages_per_s), _num(paged.sim_latency_us_p50)
            line += f"; simulated {sim_rate} pages/s, latency {sim_lat} us"
        click.echo(line)
    click.echo(
        f"submit cost (one 8 B write with imm, median of Python call): {_num(report.submit_cost_us)} us"
    )
    if report.sim_throughput_wrs_per_s is not None:
        click.echo(
            f"simulator throughput (bandwidth phases): {format_count(report.sim_throughput_wrs_per_s)} work "
            f"requests/s, {format_count(report.sim_events_per_s or 0.0)} events/s of wall time"
        )
    total = sum(n["bytes_written"] for n in report.per_nic)
    if total > 0:
        parts = [
            f"NIC {n['nic']} {format_size(n['bytes_written'])} ({100 * n['bytes_written'] / total:.0f}%, "
            f"{format_count(n['work_requests'])} WRs"
            + (f", {n['errors']} errors, {n['retries']} retried" if n["errors"] or n["retries"] else "")
            + ")"
            for n in report.per_nic
        ]
        click.echo("writer per NIC: " + "; ".join(parts))
    click.echo(f"sweep took {report.duration_s:.1f} s")


@click.group(invoke_without_command=True, context_settings={"max_content_width": 110})
@click.option(
    "--backend",
    metavar="NAME",
    default=None,
    help="Backend to measure: auto (an RDMA backend if one can run, else the simulator), efa, verbs "
    "or sim.  [default: FABRIC_BACKEND, else auto]",
)
@click.option(
    "--nics",
    type=click.IntRange(1, 64),
    default=None,
    help="NICs per engine.  [default: FABRIC_NICS, else 2 on the simulator, else the backend's topology]",
)
@click.option(
    "--sizes",
    metavar="LIST",
    callback=sizes_option,
    default=None,
    help="Comma-separated write sizes, K/M/G binary suffixes allowed (8,4K,1M).  "
    "[default: 8,64,512,4K,32K,256K,2M,16M,64M]",
)
@click.option(
    "--min-size", metavar="SIZE", callback=size_option, default=None, help="Skip sizes below this (e.g. 4K)."
)
@click.option(
    "--max-size", metavar="SIZE", callback=size_option, default=None, help="Skip sizes above this (e.g. 1M)."
)
@click.option(
    "--iters",
    type=click.IntRange(min=1),
    default=None,
    help="Fixed number of timed writes per size in each phase.  [default: adaptive, time-bounded]",
)
@click.option(
    "--link",
    metavar="PRESET",
    default=None,
    help="Simulator only: link-model preset giving a virtual clock (cx7-400g, efa-p5, efa-p5en) or 'none'.  "
    "[default: FABRIC_SIM_LINK, else cx7-400g]",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Simulator seed, also seeds the data pattern.  [default: FABRIC_SIM_SEED, else 0]",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the results as one JSON document to this file.",
)
@click.option("--quick", is_flag=True, help="A sweep of a few seconds: fewer iterations and smaller windows.")
@click.option(
    "--pages",
    type=click.IntRange(1, 1 << 20),
    default=None,
    help=f"Pages of {PAGE_BYTES // 1024} KiB per paged write.  [default: {PAGES}, 256 with --quick]",
)
@click.option(
    "--server",
    is_flag=True,
    help="Run the target side only: open an engine, wait for one client on --listen, serve it, exit.",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    default="127.0.0.1:0",
    show_default=True,
    help="With --server: where to accept the client (0.0.0.0:PORT for other hosts; port 0 picks one).",
)
@click.option(
    "--connect",
    metavar="HOST:PORT",
    default=None,
    help="Run the writer side against the bench server at HOST:PORT (the address it printed).  "
    "[default: start a server as a child process on this host]",
)
@click.pass_context
def bench(
    ctx: click.Context,
    backend: str | None,
    nics: int | None,
    sizes: tuple[int, ...] | None,
    min_size: int | None,
    max_size: int | None,
    iters: int | None,
    link: str | None,
    seed: int | None,
    json_path: Path | None,
    quick: bool,
    pages: int | None,
    server: bool,
    listen: str,
    connect: str | None,
) -> None:
    """Measure point-to-point latency, bandwidth, ops/s and the paged-write rate.

    A writer engine and a target engine. On the simulator both live in this process. On a real
    backend the target runs in a bench server, a second process: started here on loopback by
    default, or on another host with `--server --listen HOST:PORT` and reached with
    `--connect HOST:PORT`. For every size: latency is one write with an imm followed by the
    target's counter wait (median and p99; with a server, a round trip on the fabric: the server
    writes an imm back); bandwidth and ops/s come from windows of writes submitted back to back,
    then one wait for their total count. The first write of every size is checked byte for byte
    (against a SHA-256 taken at the server), so a broken backend fails loudly.

    Wall-clock numbers are always reported. On the simulator with a link model, "sim" columns
    give the virtual clock: latency from post until both ends saw completion, bandwidth from
    the virtual time of the windows.

    `fabric bench moe` measures the MoE app instead (its own options: `fabric bench moe -h`).
    """
    if ctx.invoked_subcommand is not None:
        given = [p.name for p in ctx.command.params if ctx.get_parameter_source(p.name or "") is _COMMANDLINE]
        if given:
            raise click.UsageError(
                f"options before {ctx.invoked_subcommand!r} belong to the point-to-point sweep "
                f"({', '.join('--' + (g or '').replace('_', '-') for g in given)}): "
                f"give {ctx.invoked_subcommand}'s options after its name"
            )
        return
    try:
        settings = load_settings()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    chosen = _sizes(sizes, min_size, max_size)
    name = backend or settings.backend

    def notice(text: str) -> None:
        click.echo(f"fabric bench: {text}", err=True)

    try:
        resolved = resolve_backend(name, settings, notice)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--backend'") from None
    except (BackendNotInstalled, BackendUnavailable) as exc:
        raise click.ClickException(str(exc)) from None

    if resolved == "sim":
        wanted = link if link is not None else (settings.sim_link or DEFAULT_SIM_LINK)
        link_name = None if wanted.lower() == "none" else wanted
        presets = sim_link_presets()
        if link_name is not None and link_name not in presets:
            raise click.BadParameter(
                f"unknown link preset {link_name!r}; presets: {', '.join(presets)}, or none",
                param_hint="'--link'" if link is not None else "FABRIC_SIM_LINK",
            )
    elif link is not None:
        raise click.UsageError(f"--link sets the simulator's link model; backend {resolved!r} has a real one")
    else:
        link_name = None
    run_seed = settings.sim_seed if seed is None else seed
    budget = QUICK_BUDGET if quick else DEFAULT_BUDGET
    if pages is not None:
        budget = replace(budget, pages=pages)
    if server and connect is not None:
        raise click.UsageError("--server and --connect name the two sides: give one of them")
    if (server or connect is not None) and resolved == "sim":
        raise click.UsageError(
            "the simulator runs both engines in one process: --server/--connect need efa or verbs"
        )
    try:
        if server:
            run_server(resolved, nics, listen, max(60.0, 10 * settings.timeout_s), lambda t: click.echo(t))
            return
        if connect is not None:
            parse_endpoint(connect)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--listen'" if server else "'--connect'") from None
    except FabricError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    try:
        with open_pair(
            resolved, nics=nics, link=link_name, seed=run_seed, settings=settings, connect=connect
        ) as pair:
            cols = _columns(pair.clock is not None)
            where = (
                "target in a bench server, latency is a round trip"
                if pair.target.round_trip
                else ("both engines in this process")
            )
            click.echo(
                f"fabric bench: backend {pair.backend} {pair.backend_version}, {pair.writer.num_nics} NICs, "
                f"link {pair.link or 'none'}, seed {run_seed}, {'quick' if quick else 'full'} sweep "
                f"of {len(chosen)} sizes ({where})"
            )
            click.echo(_row(cols, [c.header for c in cols]))
            click.echo(_row(cols, ["-" * c.width for c in cols]))
            report = run_sweep(
                pair,
                chosen,
                budget=budget,
                iters=iters,
                seed=run_seed,
                quick=quick,
                timeout=settings.timeout_s,
                on_result=lambda r: click.echo(_row(cols, [c.cell(r) for c in cols])),
            )
    except FabricError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    _print_summary(report)
    if json_path is not None:
        write_json(json_path, report.to_json(), indent=2)
