"""Engines in other processes: the conformance suite between separate processes.

``WorkerPool`` starts worker processes (``python -m fabric_core.testing._worker``) that all map
one shared memory arena (a memfd). ``RemoteHarness`` opens the engines of a test in the
workers, round robin, so two engines of a test never share a process, and hands the test a
``RemoteEngine``: a ``TransferEngine`` whose every call runs in the worker, over a socket.

Buffers a test registers with a remote engine come from ``harness.alloc()`` (the arena): the
worker registers its own mapping of the same pages, so the bytes a peer process writes into
that registration show in the test's numpy array. Immutable ``bytes`` are copied into the
arena (a copy of immutable bytes is exact); other memory outside the arena is refused with
``ConfigError``.

Transfers, counter waits, ``expect`` callbacks and control messages behave as on a local
engine: completions come back as events and resolve local ``Transfer`` objects, whose
callbacks run on this process's callback thread. Nothing here is backend specific; a backend
whose engines reach each other across processes (efa, verbs) runs its suite through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import itertools
import math
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..api import EngineStats, TransferEngine
from ..counters import CountWait, Expectation, ImmCounter, check_count_waits, check_imm, check_wait_timeout
from ..device_counter import DeviceCounter
from ..errors import (
    CapabilityError,
    ConfigError,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    TransferCancelled,
)
from ..memory import memory_span
from ..models import Capabilities, DomainAddress, DomainInfo, MemoryRegion, MemoryRegionDescriptor
from ..ops import Message, PeerGroup, Request
from ..settings import load_settings
from ..transfer import CallbackDispatcher, Transfer
from .harness import Harness

__all__ = ["RemoteEngine", "RemoteHarness", "WorkerPool"]

_PAGE = 4096
_RPC_SLACK = 30.0  # a blocking call may overrun its own timeout by this much before we give up
_RPC_DEFAULT = 120.0  # bound on any call that names no timeout: a wedged worker never hangs a test
U8Array = np.ndarray[Any, np.dtype[np.uint8]]


class WorkerDied(PeerUnreachable):
    """The worker process hosting a remote engine exited."""


# --- wire format ------------------------------------------------------------------------
def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (Linux: ``T`` in
    ``/proc/<pid>/task/*/stat``). ``kill`` returns before the signal has taken effect, and a
    process still running meanwhile may take what a test means to leave pending. Raises
    ``TimeoutError`` if it has not stopped within ``timeout``; elsewhere than Linux it only
    sends the signal."""
    os.kill(pid, signal.SIGSTOP)
    tasks = f"/proc/{pid}/task"
    if not os.path.isdir(tasks):
        return

    def state(task: str) -> str:
        try:
            with open(f"{tasks}/{task}/stat") as f:  # "tid (comm) state ...": comm may hold ")"
                return f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "T"  # a thread that ended meanwhile

    deadline = time.monotonic() + timeout
    while not all(state(t) == "T" for t in os.listdir(tasks)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout:g} s")
        time.sleep(0.001)


class _Pickler(pickle.Pickler):
    """Regions and peer groups travel by reference (plus a plain copy of a region's fields, so
    the worker can build a stand-in for a region that no engine there registered)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, MemoryRegion):
            return ("mr", obj.handle, obj.model_dump())
        if isinstance(obj, PeerGroup):
            return ("group", obj.handle, tuple(p.raw for p in obj.peers))
        return None


def dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dump_error(exc: BaseException) -> bytes:
    """Pickle an exception, degrading to ``RuntimeError(repr)`` when it cannot travel."""
    try:
        return pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


# --- the pool of worker processes --------------------------------------------------------
@dataclasses.dataclass
class _Call:
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    ok: bool = False
    value: Any = None


class _Worker:
    """This side of one worker process: a socket, a reader thread, calls awaiting replies."""

    def __init__(
        self, pool: WorkerPool, index: int, env: dict[str, str] | None, prefix: Sequence[str] = ()
    ) -> None:
        self.pool, self.index = pool, index
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [
                *prefix,  # a launcher that execs the rest, e.g. ip netns exec NS (fds pass through)
                sys.executable,
                "-m",
                "fabric_core.testing._worker",
                str(theirs.fileno()),
                str(pool.fd),
                str(pool.size),
            ],
            pass_fds=(theirs.fileno(), pool.fd),
            env=env,
        )
        theirs.close()
        self.sock = ours  # kept for shutdown(): closing an fd does not wake a blocked reader
        self.conn = Connection(os.dup(ours.fileno()))
        self.dead: str | None = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._calls_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name=f"remote-harness-{index}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, eid: int, method: str, *args: Any, limit: float | None = _RPC_DEFAULT) -> Any:
        if self.dead is not None:
            raise WorkerDied(f"worker {self.index} is gone: {self.dead}")
        cid = next(self._ids)
        slot = _Call()
        with self._calls_lock:
            self._calls[cid] = slot
        data = dumps((cid, eid, method, args))
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except OSError as exc:
            with self._calls_lock:
                self._calls.pop(cid, None)
            raise WorkerDied(f"worker {self.index} is gone: {exc}") from exc
        if not slot.event.wait(limit):
            with self._calls_lock:
                self._calls.pop(cid, None)
            raise TimeoutError(f"worker {self.index} did not answer {method} within {limit:g} s")
        if not slot.ok:
            raise slot.value
        return slot.value

    def _read(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError) as exc:
                self._lost(f"its socket closed ({type(exc).__name__})")
                return
            msg = pickle.loads(data)
            if msg[0] == "reply":
                _, cid, ok, payload = msg
                with self._calls_lock:
                    slot = self._calls.pop(cid, None)
                if slot is not None:
                    slot.ok = ok
                    slot.value = payload if ok else pickle.loads(payload)
                    slot.event.set()
            else:
                self.pool._event(msg)

    def _lost(self, why: str) -> None:
        code = self.proc.poll()
        self.dead = why if code is None else f"{why}; exit status {code}"
        with self._calls_lock:
            calls, self._calls = self._calls, {}
        for slot in calls.values():
            slot.ok, slot.value = False, WorkerDied(f"worker {self.index} is gone: {self.dead}")
            slot.event.set()
        self.pool._worker_lost(self)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:  # a stopped (SIGSTOP) worker would never read the EOF
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the worker reads EOF: it closes its engines and exits
        with contextlib.suppress(OSError):
            self.conn.close()
        self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout)


class WorkerPool:
    """``workers`` processes sharing an arena of ``arena_bytes`` (sparse until touched).

    Start it once per test session; ``RemoteHarness`` objects borrow it per test. Worker
    processes inherit ``env`` (default: this process's environment). ``workers=0`` starts none:
    add each with ``add_worker()`` (with its own launcher and environment, e.g. in a network
    namespace of ``fabric_core.testing.netns``).
    """

    def __init__(
        self, workers: int = 2, arena_bytes: int = 1 << 30, env: dict[str, str] | None = None
    ) -> None:
        if workers < 2 and workers != 0:
            raise ConfigError("a worker pool needs at least two processes (or none, see add_worker)")
        self.size = arena_bytes
        self.fd = os.memfd_create("fabric-test-arena")
        os.ftruncate(self.fd, arena_bytes)
        self._map = mmap.mmap(self.fd, arena_bytes)
        self.arena: U8Array = np.frombuffer(self._map, dtype=np.uint8)
        self.base = int(self.arena.ctypes.data)
        self._top = 0
        self._alloc_lock = threading.Lock()
        self._engines: dict[int, RemoteEngine] = {}
        self._eids = itertools.count(1)
        self.handles = itertools.count(1)
        self.workers = [_Worker(self, i, env) for i in range(workers)]
        for w in self.workers:
            w.call(0, "ping", limit=60.0)

    def add_worker(self, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> _Worker:
        """Start one more worker, as ``[*prefix, python, -m, ...]`` with ``env`` (default: this
        process's environment), and wait until it answers. ``prefix`` must exec the rest of the
        command line (keeping the pid and the inherited descriptors), as ``ip netns exec`` does."""
        worker = _Worker(self, len(self.workers), env, prefix)
        self.workers.append(worker)
        worker.call(0, "ping", limit=60.0)
        return worker

    # arena ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> U8Array:
        """Zeroed, page-aligned bytes of the shared arena."""
        if nbytes < 0:
            raise ConfigError(f"cannot allocate {nbytes} bytes")
        with self._alloc_lock:
            start = self._top
            end = start + max(nbytes, 1)
            if end > self.size:
                raise ConfigError(
                    f"the test arena ({self.size} bytes) is full; enlarge WorkerPool(arena_bytes=)"
                )
            self._top = -(-end // _PAGE) * _PAGE
        view: U8Array = self.arena[start : start + nbytes]
        view[:] = 0
        return view

    def offset_of(self, ptr: int, length: int) -> int | None:
        off = ptr - self.base
        return off if off >= 0 and off + length <= self.size else None

    def reset(self) -> None:
        """Forget every allocation (call when no engine holds a registration any more)."""
        with self._alloc_lock:
            self._top = 0

    # engines and events ---------------------------------------------------------------
    def _adopt(self, engine: RemoteEngine) -> int:
        eid = next(self._eids)
        self._engines[eid] = engine
        return eid

    def _forget(self, eid: int) -> None:
        engine = self._engines.pop(eid, None)
        if engine is not None and engine._worker.dead is None:
            with contextlib.suppress(FabricError, TimeoutError):
                engine._worker.call(eid, "forget", limit=30.0)

    def _event(self, msg: tuple[Any, ...]) -> None:
        kind, eid, key, payload = msg
        engine = self._engines.get(eid)
        if engine is None:
            return
        exc = None if payload is None else pickle.loads(payload)
        if kind == "xfer":
            engine._transfer_event(key, exc)
        elif kind == "expect":
            engine._expect_event(key, exc)

    def _worker_lost(self, worker: _Worker) -> None:
        for engine in list(self._engines.values()):
            if engine._worker is worker:
                engine._fail_all(WorkerDied(f"worker {worker.index} is gone: {worker.dead}"))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers.clear()
        del self.arena
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self.fd)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the engine proxy --------------------------------------------------------------------
class _RemoteExpectation(Expectation):
    def __init__(self, engine: RemoteEngine, xid: int) -> None:
        self._engine, self._xid = engine, xid

    @property
    def fired(self) -> bool:
        return bool(self._engine._call("expect_fired", self._xid))

    def cancel(self) -> bool:
        cancelled = bool(self._engine._call("expect_cancel", self._xid))
        if cancelled:
            self._engine._expects.pop(self._xid, None)
        return cancelled


class _RemoteCounter(ImmCounter):
    def __init__(self, engine: RemoteEngine, imm: int) -> None:
        self._engine, self.imm = engine, imm

    @property
    def value(self) -> int:
        return int(self._engine._call("counter_value", self.imm))

    def wait(self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None) -> None:
        self._engine._call("counter_wait", self.imm, n, timeout, peer, limit=self._engine._bound(timeout))

    async def wait_async(
        self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None
    ) -> None:
        await asyncio.to_thread(self.wait, n, timeout, peer=peer)

    def expect(
        self,
        n: int,
        callback: Callable[[], None],
        *,
        on_error: Callable[[BaseException], None] | None = None,
        peer: DomainAddress | None = None,
    ) -> Expectation:
        engine = self._engine
        xid = next(engine._xids)
        engine._expects[xid] = (callback, on_error)
        try:
            engine._call("expect", self.imm, n, xid, peer)
        except BaseException:
            engine._expects.pop(xid, None)
            raise
        return _RemoteExpectation(engine, xid)

    def __repr__(self) -> str:
        return f"<RemoteImmCounter imm={self.imm:#x}>"


class RemoteEngine(TransferEngine):
    """A ``TransferEngine`` living in a worker process of ``pool``."""

    def __init__(self, pool: WorkerPool, worker: _Worker, config: dict[str, Any]) -> None:
        self._pool, self._worker = pool, worker
        self._timeout = load_settings(**config).timeout_s
        self._lock = threading.Lock()
        self._transfers: dict[int, Transfer] = {}
        self._early: dict[int, BaseException | None] = {}
        self._expects: dict[int, tuple[Callable[[], None], Callable[[BaseException], None] | None]] = {}
        self._xids = itertools.count(1)
        self._closed = False
        self._eid = pool._adopt(self)
        try:
            opened = worker.call(self._eid, "open", config)
        except BaseException:
            pool._engines.pop(self._eid, None)
            raise
        self._addresses: tuple[DomainAddress, ...] = tuple(opened[0])
        self._caps: Capabilities = opened[1]
        self._domains: tuple[DomainInfo, ...] = tuple(opened[2])
        self._dispatch = CallbackDispatcher(f"fabric-remote-cb-{self._eid}")

    @property
    def pid(self) -> int:
        """The worker process this engine lives in."""
        return self._worker.pid

    def _call(self, method: str, *args: Any, limit: float | None = _RPC_DEFAULT) -> Any:
        return self._worker.call(self._eid, method, *args, limit=limit)

    def _bound(self, timeout: float | None) -> float | None:
        """How long to await the reply of a call that itself waits up to ``timeout``."""
        checked = check_wait_timeout(timeout)  # the local engine's ConfigError, before any call
        limit = self._timeout if checked is None else checked
        return None if math.isinf(limit) else max(limit, 0) + _RPC_SLACK

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed")

    # identity ----------------------------------------------------------------------------
    @property
    def address(self) -> DomainAddress:
        return self._addresses[0]

    @property
    def addresses(self) -> tuple[DomainAddress, ...]:
        return self._addresses

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def domains(self) -> tuple[DomainInfo, ...]:
        return self._domains

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> EngineStats:
        remote: EngineStats = self._call("stats")
        return dataclasses.replace(remote, callback_errors=remote.callback_errors + self._dispatch.errors)

    # memory ------------------------------------------------------------------------------
    def register(self, memory: object, *, writable: bool | None = None) -> MemoryRegion:
        self._check_open()
        span = memory_span(memory)  # the same typed errors as a local engine, before any call
        handle = next(self._pool.handles)
        keep: object = memory
        if span.device.kind != "cpu":
            fields = self._call("register_raw", handle, span.ptr, span.length, str(span.device), writable)
        else:
            offset = self._pool.offset_of(span.ptr, span.length)
            if offset is None:
                if not isinstance(memory, bytes):
                    raise ConfigError(
                        "a RemoteEngine registers memory from the harness arena only "
                        "(harness.alloc()); this buffer lives outside it"
                    )
                copy = self._pool.alloc(len(memory))
                copy[:] = np.frombuffer(memory, dtype=np.uint8)
                offset, keep = int(copy.ctypes.data) - self._pool.base, copy
            fields = self._call("register", handle, offset, span.length, span.writable, writable)
        return self._region(handle, fields, keep)

    def _region(self, handle: int, fields: dict[str, Any], keep: object) -> MemoryRegion:
        region = MemoryRegion(
            handle=handle,
            ptr=fields["ptr"],
            length=fields["length"],
            device=fields["device"],
            writable=fields["writable"],
            descriptor=MemoryRegionDescriptor.model_validate(fields["descriptor"]),
        )
        region._keepalive = keep
        region._engine_id = id(self)
        return region

    def deregister(self, region: MemoryRegion) -> None:
        self._check_open()
        self._call("deregister", region)

    def rekey(self, region: MemoryRegion) -> MemoryRegion:
        self._check_open()
        handle = next(self._pool.handles)
        return self._region(handle, self._call("rekey", region, handle), region._keepalive)

    def fence(
        self, peers: Sequence[DomainAddress | MemoryRegionDescriptor], *, timeout: float | None = None
    ) -> None:
        self._check_open()
        self._call("fence", list(peers), timeout, limit=self._bound(timeout))

    def dump_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._call("dump_state")
        return state

    # one-sided ---------------------------------------------------------------------------
    def _track(self, reply: tuple[int, tuple[int, ...]]) -> Transfer:
        tid, per_target = reply
        transfer = Transfer(per_target, dispatcher=self._dispatch, default_timeout=self._timeout)
        transfer._cancel = functools.partial(self._cancel_remote, tid)
        with self._lock:
            if tid in self._early:
                early = self._early.pop(tid)
            else:
                self._transfers[tid] = transfer
                return transfer
        transfer._resolve(early)
        return transfer

    def submit(self, request: Request, *, timeout: float | None = None) -> Transfer:
        self._check_open()
        return self._track(self._call("submit", request, timeout))

    def _cancel_remote(self, tid: int, transfer: Transfer, timeout: float | None) -> bool:
        running: bool = self._call("cancel", tid, timeout, limit=self._bound(timeout))
        if running:
            with self._lock:
                self._transfers.pop(tid, None)
            transfer._resolve(TransferCancelled(f"transfer {transfer.id} cancelled", transfer_id=transfer.id))
        return running

    def peer_group(self, peers: Sequence[DomainAddress | MemoryRegionDescriptor]) -> PeerGroup:
        self._check_open()
        handle = next(self._pool.handles)
        resolved: tuple[DomainAddress, ...] = self._call("peer_group", handle, list(peers))
        return PeerGroup(handle, resolved, frozenset(p.raw for p in resolved))

    def wait_counts(self, waits: Sequence[CountWait], timeout: float | None = None) -> None:
        self._check_open()
        check_count_waits(waits)  # the local engine's ConfigError, before any call
        self._call("wait_counts", list(waits), timeout, limit=self._bound(timeout))

    def counter(self, imm: int) -> ImmCounter:
        return _RemoteCounter(self, check_imm(imm))

    def device_counter(self, imm: int, *, peer: DomainAddress | None = None) -> DeviceCounter:
        raise CapabilityError("a remote engine's GPU-side waits belong to its own process: make them there")

    # two-sided ---------------------------------------------------------------------------
    def submit_send(
        self, peer: DomainAddress, data: bytes | bytearray | memoryview, *, timeout: float | None = None
    ) -> Transfer:
        self._check_open()
        return self._track(self._call("submit_send", peer, bytes(data), timeout))

    def recv(self, timeout: float | None = None) -> Message:
        self._check_open()
        message: Message = self._call("recv", timeout, limit=self._bound(timeout))
        return message

    # lifecycle ---------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call("close", timeout, limit=self._bound(timeout))
        except WorkerDied:
            pass
        finally:
            self._fail_all(EngineClosed("engine closed with this transfer in flight"))
            self._dispatch.close()

    # events ------------------------------------------------------------------------------
    def _transfer_event(self, tid: int, exc: BaseException | None) -> None:
        with self._lock:
            transfer = self._transfers.pop(tid, None)
            if transfer is None:
                self._early[tid] = exc
                return
        transfer._resolve(exc)

    def _expect_event(self, xid: int, exc: BaseException | None) -> None:
        entry = self._expects.pop(xid, None)
        if entry is None:
            return
        callback, on_error = entry

        def run() -> None:
            if exc is None:
                callback()
            elif on_error is not None:
                on_error(exc)

        self._dispatch.submit(run)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            left = list(self._transfers.values())
            self._transfers.clear()
        for transfer in left:
            transfer._resolve(exc)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<RemoteEngine pid={self.pid} {self.address} {state}>"


# --- the harness ---------------------------------------------------------------------------
class RemoteHarness(Harness):
    """Opens engine *i* of a test in worker ``i % len(pool.workers)``: with two or more workers,
    the two engines of a pair always live in different processes.

    ``config`` holds ``FabricSettings`` fields (backend, provider, chaos seed...) for every
    engine; per-engine ``open_engine`` keywords override them. ``spread=False`` opens every
    engine in the first worker instead (for a backend whose engines reach each other only
    within one process, such as the simulator: it tests this proxy layer itself).
    """

    def __init__(
        self,
        pool: WorkerPool,
        config: dict[str, Any],
        *,
        max_nics: int = 1,
        reports_remote_access_errors: bool = True,
        detects_closed_peers: bool = True,
        survives_refused_writes: bool = True,
        spread: bool = True,
        supports_stall: bool = False,
    ) -> None:
        super().__init__()
        self.pool, self.config, self.spread = pool, dict(config), spread
        # stall = SIGSTOP of the engine's worker: only where each engine has its own process
        self.supports_stall = supports_stall and spread
        self._stopped: set[int] = set()
        self.max_nics = max_nics
        self.reports_remote_access_errors = reports_remote_access_errors
        self.detects_closed_peers = detects_closed_peers
        self.survives_refused_writes = survives_refused_writes

    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine:
        index = len(self._engines) % len(self.pool.workers) if self.spread else 0
        worker = self.pool.workers[index]
        return RemoteEngine(self.pool, worker, {**self.config, "nics": nics, **config})

    def alloc(self, nbytes: int) -> U8Array:
        return self.pool.alloc(nbytes)

    def stall_peer(self, engine: TransferEngine) -> None:
        if not self.supports_stall or not isinstance(engine, RemoteEngine):
            super().stall_peer(engine)
            return
        self._stopped.add(engine.pid)
        stop_process(engine.pid)

    def resume_peer(self, engine: TransferEngine) -> None:
        if not isinstance(engine, RemoteEngine):
            super().resume_peer(engine)
            return
        self._stopped.discard(engine.pid)
        os.kill(engine.pid, signal.SIGCONT)

    def close(self) -> None:
        for pid in self._stopped:  # a test that failed while a worker was stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._stopped.clear()
        engines = [e for e in self._engines if isinstance(e, RemoteEngine)]
        try:
            super().close()
        finally:
            for engine in engines:
                self.pool._forget(engine._eid)
            self.pool.reset()
