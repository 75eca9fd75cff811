"""The simulated fabric: one progress thread moving chunks and completions in seeded order.

Every work request (WR) is cut into chunks; chunks and completions are events with a
delivery time drawn from the seeded RNG (or from the link model plus jitter). The progress
thread always delivers the earliest event, so events posted close together land in shuffled
order: chunks of one WR, WRs of one transfer, and transfers. A WR's imm is counted at the
target only after all its chunks landed; the sender's completion is a separate event, so the
two ends see completions in independent orders.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
import logging
import math
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from fabric_core import cuda
from fabric_core.errors import (
    CapabilityError,
    ConfigError,
    EngineClosed,
    PeerUnreachable,
    RemoteAccessError,
    TransferTimeout,
    TransportError,
)
from fabric_core.models import DomainAddress, MemoryRegionDescriptor
from fabric_core.ops import Plan
from fabric_core.reconcile import PowerSums, landed_per_imm
from fabric_core.transfer import Transfer

from .link import LinkModel

if TYPE_CHECKING:
    from .engine import SimEngine, _SimKeys

__all__ = ["PostedWr", "SimFabric"]

logger = logging.getLogger(__name__)

_ADDR = struct.Struct("<3sIIB")
_MAGIC = b"SIM"
_fabric_ids = itertools.count(1)

# event kinds
_CHUNK, _WR_DONE, _IMM, _LOCAL, _MSG, _ACK = range(6)
_SPREAD = 3.0
_PHANTOM_BASE = 1 << 60  # phantom regions live above every real address (x86-64, aarch64)
_TICK = 0.01  # how often (wall clock) deadlines and liveness are checked


class PostedWr(NamedTuple):
    """A work request as posted (``SimFabric(record=True)``): engine ids, the NIC index (the
    same at both ends), bytes, the source address and the fabric's ``record_tag`` then."""

    src: int
    dst: int
    nic: int
    nbytes: int
    src_ptr: int
    tag: str


class _Xfer:
    """Sender-side state of one transfer."""

    __slots__ = (
        "cuda_src",
        "deadline",
        "early",
        "engine",
        "error",
        "imm",
        "left",
        "peers",
        "started",
        "total",
        "transfer",
    )

    def __init__(
        self,
        engine: SimEngine,
        transfer: Transfer,
        left: int,
        timeout: float,
        peers: frozenset[int],
        imm: int | None = None,
        cuda_src: bool = False,
    ) -> None:
        self.engine, self.transfer, self.left, self.total = engine, transfer, left, left
        self.cuda_src = cuda_src  # the source is CUDA memory: its bytes move by device copies
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.deadline = self.started + timeout if math.isfinite(timeout) else math.inf
        self.peers = peers  # engine ids it depends on
        self.imm = imm
        self.early = False  # failed before its WRs were done (deadline, lost peer): they still run


class _WR:
    __slots__ = (
        "ack_lost",
        "batch",
        "carrier",
        "cuda",
        "desc",
        "dst",
        "dst_addr",
        "error",
        "fate",
        "imm",
        "left",
        "length",
        "nic",
        "rkey",
        "src",
        "src_ptr",
        "xfer",
    )

    def __init__(
        self,
        xfer: _Xfer,
        dst: int,
        nic: int,
        src_ptr: int,
        dst_addr: int,
        length: int,
        rkey: int,
        imm: int | None,
        chunks: int,
        desc: MemoryRegionDescriptor,
    ) -> None:
        self.xfer, self.dst, self.nic = xfer, dst, nic
        self.src = xfer.engine.engine_id
        self.src_ptr, self.dst_addr, self.length, self.rkey, self.imm = src_ptr, dst_addr, length, rkey, imm
        self.left = chunks
        self.desc = desc  # the target's descriptor: its keys on the other NICs, for a retry
        self.cuda = xfer.cuda_src or desc.device.kind == "cuda"  # bytes move by CUDA copies
        self.error: BaseException | None = None
        self.fate: bool | None = None  # caught on a dying NIC: lands with its ack lost (True) or not
        self.ack_lost: BaseException | None = None  # landed, but the sender is told it failed
        self.batch: _Recovery | None = None  # a retry of a WR lost with a NIC (see _reconcile)
        self.carrier: int | None = None  # a data retry whose slot waits for a make-up imm


class _Recovery:
    """The retries of one path's failed WRs: data first (no imm), then the make-up imms."""

    __slots__ = ("data_left", "makeups")

    def __init__(self) -> None:
        self.data_left = 0
        self.makeups: list[_WR] = []  # data retries that carry a make-up imm once all landed


def _trace_key(kind: int, payload: Any) -> tuple[int, ...]:
    """A run-independent name for an event: (transfer id, offset) or (engine, imm)."""
    if kind == _CHUNK:
        wr, off, _n = payload
        return (wr.xfer.transfer.id, wr.nic, wr.length, off)
    if kind in (_WR_DONE, _ACK):
        wr = payload if kind == _WR_DONE else payload[0]
        return (wr.xfer.transfer.id, wr.nic, wr.length)
    if kind == _IMM:
        return (payload[0], payload[1])
    if kind in (_LOCAL, _MSG):
        return (payload[0].transfer.id,)
    return ()


class SimFabric:
    """A simulated network shared by the engines opened on it (all in this process).

    ``seed`` fixes every reordering decision; ``chunk_bytes`` bounds the chunks writes are cut
    into; ``link`` adds a virtual clock (``now`` in seconds); ``trace=True`` records every
    delivered event in ``trace``. Faults: ``fail_peer``,
    ``fail_nic``, and ``after(n, fn)`` to act after exactly ``n`` more events.

    ``phantom=True`` lets engines register meta tensors (``torch.empty(n, device="meta")``):
    regions with a size and no bytes, so a process holds hundreds of ranks' worth of them;
    writes from or to them move no bytes (counts, completions and errors are as usual).
    ``record=True`` appends every work request posted to ``recorded`` as a ``PostedWr``
    (``fabric_sim.predict`` times them on a cluster model); ``record_tag`` labels them.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        chunk_bytes: int = 65536,
        link: LinkModel | None = None,
        trace: bool = False,
        phantom: bool = False,
        record: bool = False,
    ) -> None:
        if chunk_bytes < 1:
            raise ConfigError("chunk_bytes must be positive")
        self.fabric_id = next(_fabric_ids)
        self.seed = seed
        self.chunk_bytes = chunk_bytes
        self.link = link
        self._rng = random.Random(seed)
        self._cv = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._engines: dict[int, SimEngine] = {}
        self._engine_ids = itertools.count(1)
        self._dead_nics: set[tuple[int, int]] = set()
        self._nic_free: dict[tuple[int, int, int], float] = {}
        self._paused = 0
        self._busy = False
        self._thread: threading.Thread | None = None
        self._stop = False
        self._triggers: list[tuple[int, int, Callable[[], None]]] = []
        # silent peers (alive, no progress: a stopped process): engine id -> since when
        self._stalled: dict[int, float] = {}
        self._held: list[tuple[int, object]] = []  # events that touch a stalled engine
        self._lost: set[tuple[int, int]] = set()  # (engine, peer) pairs declared lost
        self._last_watch = 0.0
        self._calls: list[Callable[[], None]] = []  # to run without the lock (progress thread)
        self.now = 0.0
        self.trace: list[tuple[int, tuple[int, ...]]] | None = [] if trace else None
        self.events = 0
        self.wrs_delivered = 0
        self.phantom = phantom
        self._phantom_next = _PHANTOM_BASE
        self.recorded: list[PostedWr] | None = [] if record else None
        self.record_tag = ""

    def phantom_range(self, nbytes: int) -> int:
        """A fresh address range of ``nbytes`` for a phantom region (never dereferenced)."""
        with self._cv:
            ptr = self._phantom_next
            self._phantom_next += -(-nbytes // 4096) * 4096 + 4096
            return ptr

    # --- addressing ------------------------------------------------------------------
    def address(self, engine_id: int, nic: int) -> DomainAddress:
        return DomainAddress(raw=_ADDR.pack(_MAGIC, self.fabric_id, engine_id, nic))

    def resolve(self, address: DomainAddress) -> int:
        """Engine id behind ``address``; PeerUnreachable if it is not a live engine here."""
        raw = address.raw
        if len(raw) != _ADDR.size or raw[:3] != _MAGIC:
            raise PeerUnreachable(f"{address} is not a simulator address", peer=str(address))
        _, fid, eid, _nic = _ADDR.unpack(raw)
        if fid != self.fabric_id or eid not in self._engines:
            raise PeerUnreachable(f"no live engine at {address} on this simulated fabric", peer=str(address))
        return int(eid)

    # --- engines ---------------------------------------------------------------------
    def attach(self, engine: SimEngine) -> int:
        with self._cv:
            eid = next(self._engine_ids)
            self._engines[eid] = engine
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(
                    target=self._run, name=f"fabric-sim-{self.fabric_id}", daemon=True
                )
                self._thread.start()
            return eid

    def detach(self, engine: SimEngine, exc: BaseException) -> None:
        """Remove ``engine``: writes to it fail from now on; waits that named it fail."""
        with self._cv:
            self._engines.pop(engine.engine_id, None)
            others = list(self._engines.values())
            thread = None
            if not self._engines and self._thread is not None:
                self._stop = True
                self._cv.notify_all()
                thread, self._thread = self._thread, None
        for other in others:
            other._peer_lost(engine.address.raw, exc)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def engines(self) -> tuple[SimEngine, ...]:
        with self._cv:
            return tuple(self._engines.values())

    def open_engine(self, nics: int = 2, **config: object) -> SimEngine:
        """An engine with ``nics`` NICs on this fabric; ``config`` as ``FabricSettings``."""
        from fabric_core.settings import load_settings

        from .engine import SimEngine

        if config.pop("backend", "sim") != "sim":
            raise ConfigError("a SimFabric opens simulator engines only")
        return SimEngine(self, load_settings(backend="sim", **config), nics)

    # --- faults ----------------------------------------------------------------------
    def fail_peer(self, engine: SimEngine) -> None:
        """Crash ``engine`` as if its process died: nothing more is sent or received by it;
        writes to it fail with PeerUnreachable; its own pending work is abandoned."""
        engine._crash()

    def fail_nic(self, engine: SimEngine, nic: int) -> None:
        """NIC ``nic`` of ``engine`` goes down: WRs through it fail with TransportError; new
        traffic of that engine (and traffic to it) moves to its other NICs."""
        if not 0 <= nic < engine.num_nics:
            raise ConfigError(f"engine has NICs 0..{engine.num_nics - 1}, not {nic}")
        with self._cv:
            self._dead_nics.add((engine.engine_id, nic))

    def stall_peer(self, engine: SimEngine) -> None:
        """``engine`` stops making progress as a stopped process would (SIGSTOP): nothing moves
        to or from it and it answers no probe, but it is not gone. Others find out through
        their liveness settings (``liveness_interval_s`` + ``liveness_timeout_s``), or their
        deadlines, as on a real transport; ``resume_peer`` lets everything held move on, late
        writes included."""
        with self._cv:
            self._stalled.setdefault(engine.engine_id, time.monotonic())
            self._cv.notify_all()

    def resume_peer(self, engine: SimEngine) -> None:
        with self._cv:
            if self._stalled.pop(engine.engine_id, None) is None:
                return
            held, self._held = self._held, []
            for kind, payload in held:
                self._push(self.now, kind, payload)
            revived = [(e, p) for e, p in self._lost if p == engine.engine_id]
            for key in revived:
                self._lost.discard(key)
            for waiting in list(self._engines.values()):  # reconciliations it held up
                for dst, nic in {*waiting._path_failed, *waiting._path_ghosts}:
                    if dst == engine.engine_id and (dst, nic) not in waiting._path_busy:
                        self._reconcile(waiting, dst, nic)
            self._cv.notify_all()
        for e, _p in revived:
            other = self._engines.get(e)
            if other is not None:
                other._counters.revive_peer(engine.address.raw)

    def restore_nic(self, engine: SimEngine, nic: int) -> None:
        with self._cv:
            self._dead_nics.discard((engine.engine_id, nic))

    def after(self, events: int, action: Callable[[], None]) -> None:
        """Run ``action`` on the progress thread after exactly ``events`` more events."""
        with self._cv:
            heapq.heappush(self._triggers, (self.events + events, next(self._seq), action))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold delivery while inside: everything posted meanwhile is then reordered together."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()

    def quiesce(self, timeout: float = 10.0) -> bool:
        """Wait until no event is pending (True) or the timeout passes (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._heap and not self._busy, timeout)

    # --- posting (called by engines) -------------------------------------------------
    def _live_nic(self, engine_id: int, peer: int, nic: int, count: int) -> int | None:
        for step in range(count):
            n = (nic + step) % count
            if (engine_id, n) not in self._dead_nics and (peer, n) not in self._dead_nics:
                return n
        return None

    def _chunks(self, length: int) -> int:
        c = -(-length // self.chunk_bytes)
        return max(c, 2 if length >= 16 else 1)

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _jitter(self) -> float:
        return self._rng.random() if self.link is None else self._rng.random() * max(self.link.per_op_s, 1e-9)

    def post(
        self,
        engine: SimEngine,
        plan: Plan,
        transfer: Transfer,
        src_ptr: int,
        timeout: float,
        cuda_src: bool = False,
    ) -> None:
        """Queue every WR of ``plan`` (caller holds no fabric lock). ``cuda_src``: the source
        is CUDA memory."""
        with self._cv:
            targets: list[int | BaseException] = []
            for desc in plan.targets:
                try:
                    targets.append(self.resolve(desc.peer))
                except PeerUnreachable as exc:
                    targets.append(exc)
            peers = frozenset(t for t in targets if isinstance(t, int))
            xfer = _Xfer(engine, transfer, plan.num_wrs, timeout, peers, plan.imm, cuda_src)
            engine._inflight.add(xfer)
            nics, tgts = plan.nic.tolist(), plan.target.tolist()
            src_offs, dst_offs, lengths = plan.src_off.tolist(), plan.dst_off.tolist(), plan.length.tolist()
            count = engine.num_nics
            for i in range(len(nics)):
                desc = plan.targets[tgts[i]]
                dst = targets[tgts[i]]
                if isinstance(dst, BaseException):
                    self._push(self.now + self._jitter(), _LOCAL, (xfer, dst, 0))
                    continue
                nic = self._live_nic(engine.engine_id, dst, nics[i], count)
                if nic is None:
                    err = TransportError("every NIC on the route is down", peer=str(desc.peer), nic=nics[i])
                    self._push(self.now + self._jitter(), _LOCAL, (xfer, err, 0))
                    continue
                length = lengths[i]
                if self.recorded is not None:
                    self.recorded.append(
                        PostedWr(engine.engine_id, dst, nic, length, src_ptr + src_offs[i], self.record_tag)
                    )
                wr = _WR(
                    xfer,
                    dst,
                    nic,
                    src_ptr + src_offs[i],
                    desc.ptr + dst_offs[i],
                    length,
                    desc.nics[nic].rkey,
                    plan.imm,
                    self._chunks(length),
                    desc,
                )
                self._post_wr(wr)
            self._cv.notify_all()

    def _post_wr(self, wr: _WR) -> None:
        wr.xfer.engine._traffic.posted(wr.nic, wr.dst)
        busy = wr.xfer.engine._path_busy
        busy[(wr.dst, wr.nic)] = busy.get((wr.dst, wr.nic), 0) + 1
        length, parts = wr.length, wr.left
        size = -(-length // parts) if length else 0
        if self.link is None:
            # Without a timing model: each WR starts after a random queueing delay of up to
            # _SPREAD units and its chunks land within one unit of that, in shuffled order, so
            # one WR's imm can beat another WR's (or transfer's) bytes.
            start = self.now + self._rng.random() * _SPREAD
            for c in range(parts):
                off = c * size
                self._push(start + self._rng.random(), _CHUNK, (wr, off, max(0, min(size, length - off))))
            return
        link = self.link
        tx = (wr.src, wr.nic, 0)
        rx = (wr.dst, wr.nic, 1)
        start = max(self.now, self._nic_free.get(tx, 0.0)) + link.per_op_s
        dur = length / link.bytes_per_s
        self._nic_free[tx] = start + dur
        rx_start = max(start + link.latency_s, self._nic_free.get(rx, 0.0))
        self._nic_free[rx] = rx_start + dur
        for c in range(parts):
            off = c * size
            t = rx_start + dur * self._rng.random() if parts > 1 else rx_start + dur
            self._push(t + self._jitter(), _CHUNK, (wr, off, max(0, min(size, length - off))))

    def post_message(
        self, engine: SimEngine, peer: DomainAddress, data: bytes, transfer: Transfer, timeout: float
    ) -> None:
        with self._cv:
            try:
                peers = frozenset((self.resolve(peer),))
            except PeerUnreachable:
                peers = frozenset()
            xfer = _Xfer(engine, transfer, 1, timeout, peers)
            engine._inflight.add(xfer)
            delay = self._jitter() if self.link is None else self.link.latency_s + self._jitter()
            self._push(self.now + delay, _MSG, (xfer, peer, data))
            self._cv.notify_all()

    def forget(self, xfers: list[_Xfer]) -> None:
        """Make pending events of these transfers no-ops (their engine is gone)."""
        with self._cv:
            for x in xfers:
                x.left = -1

    # --- progress --------------------------------------------------------------------
    def _run(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while not self._stop and (not self._heap or self._paused) and not self._calls:
                    self._busy = False
                    cv.notify_all()
                    cv.wait(_TICK if self._watching() else None)
                    self._watch()
                if self._stop:
                    self._heap.clear()
                    self._busy = False
                    cv.notify_all()
                    return
                self._busy = True
                # Handle a bounded batch under the lock, then let submitters in; stop early
                # when a scheduled action is due, to run it before the next event.
                for _ in range(256):
                    if not self._heap or self._paused or self._process_one():
                        break
                if time.monotonic() - self._last_watch >= _TICK:
                    self._watch()
            self._run_due()

    def _touches_stalled(self, kind: int, payload: Any) -> bool:
        stalled = self._stalled
        if kind == _CHUNK:
            return payload[0].dst in stalled or payload[0].src in stalled
        if kind == _WR_DONE:
            return bool(payload.src in stalled or payload.dst in stalled)
        if kind == _ACK:
            return bool(payload[0].src in stalled)
        if kind == _IMM:
            return bool(payload[0] in stalled)
        if kind == _LOCAL:
            return payload[0].engine.engine_id in stalled
        if kind == _MSG:
            xfer, peer, _data = payload
            if xfer.engine.engine_id in stalled:
                return True
            try:
                return self.resolve(peer) in stalled
            except PeerUnreachable:
                return False
        return False

    def _process_one(self) -> bool:
        """Deliver the earliest event (lock held); True if a scheduled action is now due."""
        t, _, kind, payload = heapq.heappop(self._heap)
        if self._stalled and self._touches_stalled(kind, payload):
            self._held.append((kind, payload))
            return False
        if t > self.now:
            self.now = t
        self.events += 1
        if self.trace is not None:
            self.trace.append((kind, _trace_key(kind, payload)))
        try:
            self._handle(kind, payload)
        except Exception:  # a bug here must not kill the fabric
            logger.exception("fabric-sim: event handler failed")
        return bool(self._triggers) and self._triggers[0][0] <= self.events

    def _run_due(self) -> None:
        """Run due actions without the fabric lock (they may close engines, submit, ...)."""
        with self._cv:
            calls, self._calls = self._calls, []
        for call in calls:
            try:
                call()
            except Exception:
                logger.exception("fabric-sim: a failure notification failed")
        while True:
            with self._cv:
                if not self._triggers or self._triggers[0][0] > self.events:
                    return
                action = heapq.heappop(self._triggers)[2]
            try:
                action()
            except Exception:
                logger.exception("fabric-sim: scheduled action failed")

    # --- deadlines and liveness (wall clock, as a real engine's) --------------------------
    def _watching(self) -> bool:
        return any(e._inflight for e in self._engines.values()) or bool(self._stalled)

    def _watch(self) -> None:
        """Fail transfers past their deadline; declare stalled peers lost to the engines that
        depend on them once their liveness settings say a probe would have gone unanswered
        (lock held)."""
        now = time.monotonic()
        self._last_watch = now
        early: list[tuple[_Xfer, BaseException]] = []
        lost: dict[tuple[int, int], float] = {}  # (engine, peer) -> how long it was silent
        for engine in self._engines.values():
            settings = engine._settings
            probing = settings.liveness_interval_s > 0
            detect = settings.liveness_interval_s + settings.liveness_timeout_s
            for x in engine._inflight:
                if x.early or x.left < 0:
                    continue
                if now >= x.deadline:
                    early.append((x, self._deadline_error(x, now)))
                    continue
                if not probing:
                    continue
                for p in x.peers:
                    since = self._stalled.get(p)
                    if since is not None and now - max(since, x.started) >= detect:
                        lost[(engine.engine_id, p)] = now - max(since, x.started)
            if probing and self._stalled:  # waits that name a silent peer probe it too
                for p, since in self._stalled.items():
                    peer = self._engines.get(p)
                    if peer is None or p == engine.engine_id or (engine.engine_id, p) in self._lost:
                        continue
                    if now - since >= detect and engine._counters.names_peer(peer.address.raw):
                        lost[(engine.engine_id, p)] = now - since
        for x, exc in early:
            self._fail_early(x, exc)
        for (eid, p), silent in lost.items():
            engine, peer = self._engines[eid], self._engines[p]
            why = f"no answer to a liveness probe in {silent:.3f} s"
            for x in list(engine._inflight):
                if not x.early and x.left >= 0 and p in x.peers:
                    self._fail_early(
                        x,
                        PeerUnreachable(
                            f"transfer {x.transfer.id}: peer lost: {why}",
                            peer=peer.address.raw.hex(),
                            transfer_id=x.transfer.id,
                        ),
                    )
            if (eid, p) not in self._lost:  # its waits fail once, until it is heard from again
                self._lost.add((eid, p))
                self._calls.append(functools.partial(engine._peer_lost, peer.address.raw, why))

    def _deadline_error(self, x: _Xfer, now: float) -> TransferTimeout:
        peer = next(iter(x.peers), None)
        addr = self.address(peer, 0).raw.hex() if peer is not None else None
        return TransferTimeout(
            f"transfer {x.transfer.id}: deadline of {x.deadline - x.started:.3f} s passed with {x.left} of "
            f"{x.total} work requests outstanding" + (f" (peer {addr})" if addr else ""),
            peer=addr,
            transfer_id=x.transfer.id,
        )

    def _fail_early(self, x: _Xfer, exc: BaseException) -> None:
        """Complete ``x`` now with ``exc``; its WRs still run (their bytes may land late,
        as on a real NIC: only the target revoking its keys stops them)."""
        x.early = True
        x.engine._stat_failed += 1
        x.transfer._resolve(exc)  # callbacks run on the engine's dispatcher, not here

    def step(self, events: int = 1) -> int:
        """Deliver up to ``events`` pending events in the calling thread; returns how many.

        Use inside ``paused()`` to walk a run one event at a time (deterministic per seed).
        """
        done = 0
        while done < events:
            with self._cv:
                due = False
                while done < events and self._heap and not due:
                    due = self._process_one()
                    done += 1
                self._cv.notify_all()
                idle = not self._heap
            self._run_due()
            if idle:
                break
        return done

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == _CHUNK:
            wr, off, n = payload
            self._land(wr, off, n)
        elif kind == _WR_DONE:
            self._wr_done(payload)
        elif kind == _IMM:
            self._count_imm(payload)
        elif kind == _ACK:
            wr, err = payload
            self._ack(wr, err)
        elif kind == _LOCAL:
            xfer, err, nbytes = payload
            self._local_done(xfer, err, nbytes)
        elif kind == _MSG:
            xfer, peer, data = payload
            self._deliver_message(xfer, peer, data)

    def _count_imm(self, payload: tuple[int, int, int, int, _Xfer]) -> None:
        dst, imm, _src, nic, _xfer = payload
        engine = self._engines.get(dst)
        if engine is not None:
            engine._traffic.imm(nic)
            engine._counters.add(imm)

    def _count_landed_imms(self, xfer: _Xfer) -> None:
        """``xfer`` is being cancelled: the imms of its work requests that already landed, and
        whose count is still on its way (polled a little later, as on a real target), are
        counted now, so that nothing of it is counted after ``cancel`` returns. Under the lock."""

        def of_xfer(kind: int, payload: object) -> bool:
            return kind == _IMM and cast(tuple[Any, ...], payload)[4] is xfer

        mine = [e for e in self._heap if of_xfer(e[2], e[3])]
        if mine:
            self._heap = [e for e in self._heap if not of_xfer(e[2], e[3])]
            heapq.heapify(self._heap)
        held = [(k, p) for k, p in self._held if of_xfer(k, p)]
        if held:
            self._held = [(k, p) for k, p in self._held if not of_xfer(k, p)]
        for payload in [e[3] for e in mine] + [p for _k, p in held]:
            self._count_imm(cast(tuple[int, int, int, int, _Xfer], payload))

    def _land(self, wr: _WR, off: int, n: int) -> None:
        wr.left -= 1
        xfer = wr.xfer
        if wr.error is None and xfer.left >= 0:
            err = self._check_access(wr)
            if err is not None and self._nic_down(wr):
                # Caught by a NIC going down: as on a real NIC the sender cannot tell whether
                # the WR got through before its acknowledgement was lost. Seeded either way.
                if wr.fate is None:
                    wr.fate = self._rng.random() < 0.5
                if wr.fate:
                    wr.ack_lost = err
                    err = self._check_access(wr, nics=False)
            if err is not None:
                wr.error = err
            elif n and wr.dst_addr < _PHANTOM_BASE and wr.src_ptr < _PHANTOM_BASE:
                if wr.cuda:  # a device (or peer) copy, finished before the imm can count
                    try:
                        cuda.copy(wr.dst_addr + off, wr.src_ptr + off, n)
                    except (RuntimeError, CapabilityError) as exc:
                        wr.error = TransportError(
                            f"the CUDA copy failed: {exc}", peer=str(self.address(wr.dst, 0))
                        )
                else:
                    ctypes.memmove(wr.dst_addr + off, wr.src_ptr + off, n)
        if wr.left == 0:
            self._push(self.now + (self._jitter() * 0.25 if self.link is None else 0.0), _WR_DONE, wr)

    def _nic_down(self, wr: _WR) -> bool:
        return (wr.src, wr.nic) in self._dead_nics or (wr.dst, wr.nic) in self._dead_nics

    def _check_access(self, wr: _WR, *, nics: bool = True) -> BaseException | None:
        src = self._engines.get(wr.src)
        if src is None:
            return EngineClosed("sending engine is gone")
        peer = str(self.address(wr.dst, 0))
        if nics and (wr.src, wr.nic) in self._dead_nics:
            return TransportError(f"local NIC {wr.nic} went down", peer=peer, nic=wr.nic)
        dst = self._engines.get(wr.dst)
        if dst is None:
            return PeerUnreachable(f"peer {peer} is gone", peer=peer, nic=wr.nic)
        if nics and (wr.dst, wr.nic) in self._dead_nics:
            return TransportError(f"NIC {wr.nic} of peer {peer} went down", peer=peer, nic=wr.nic)
        reg: _SimKeys | None = dst._rkeys.get((wr.nic, wr.rkey))
        if reg is None:
            return RemoteAccessError(
                f"peer {peer} has no live registration for this key (deregistered or forged)",
                peer=peer,
                nic=wr.nic,
            )
        if not reg.remote_write:
            return RemoteAccessError(
                f"peer {peer} registered this memory without remote write access", peer=peer, nic=wr.nic
            )
        # The whole WR's range, whichever chunk this is: a NIC checks the range a write names
        # against the region before it places any byte, so a WR reaching outside lands nothing.
        lo, hi = wr.dst_addr, wr.dst_addr + wr.length
        if lo < reg.ptr or hi > reg.ptr + reg.length:
            return RemoteAccessError(
                f"write [{lo:#x}, {hi:#x}) is outside the peer's registration", peer=peer, nic=wr.nic
            )
        return None

    def _wr_done(self, wr: _WR) -> None:
        xfer = wr.xfer
        if xfer.left < 0:
            xfer.engine._traffic.reported(wr.nic, wr.dst, wr.length, wr.error is None)
            self._path_done(wr)
            return
        if wr.error is None:
            self.wrs_delivered += 1
            if wr.imm is not None:
                # The target's completion entry exists from now on; it is counted a little
                # later (polled). A count query is answered only after polling everything
                # (as the compiled engine does), so the path's sums include it from now on.
                target = self._engines.get(wr.dst)
                if target is not None:
                    sums = target._rx_sums.get((wr.src, wr.nic))
                    if sums is None:
                        sums = target._rx_sums[(wr.src, wr.nic)] = PowerSums()
                    sums.add(wr.imm)
                self._push(self.now + self._jitter() * 0.25, _IMM, (wr.dst, wr.imm, wr.src, wr.nic, xfer))
        ack = self._jitter() if self.link is None else self.link.latency_s + self._jitter()
        self._push(self.now + ack, _ACK, (wr, wr.error if wr.error is not None else wr.ack_lost))

    def _path_done(self, wr: _WR) -> None:
        busy = wr.xfer.engine._path_busy
        key = (wr.dst, wr.nic)
        left = busy.get(key, 1) - 1
        if left > 0:
            busy[key] = left
        else:
            busy.pop(key, None)
            engine = wr.xfer.engine
            if key in engine._path_failed or key in engine._path_ghosts:
                self._reconcile(engine, *key)

    def _ack(self, wr: _WR, err: BaseException | None) -> None:
        """The sender's completion of one WR."""
        xfer, engine = wr.xfer, wr.xfer.engine
        engine._traffic.reported(wr.nic, wr.dst, wr.length, err is None)
        if err is not None and self._retriable(wr, err):
            if xfer.left >= 0 and not xfer.early:
                engine._traffic.retried(wr.nic)
                # Lost with a NIC while another NIC reaches the peer: retried there, with the
                # target's counts reconciled first if it carried an imm (see _reconcile).
                engine._stat_retries += 1
                engine._path_failed.setdefault((wr.dst, wr.nic), []).append(wr)
                self._path_done(wr)
                return
            if wr.imm is not None:  # its transfer ended: not retried, but it may have counted
                ghosts = engine._path_ghosts.setdefault((wr.dst, wr.nic), {})
                ghosts[wr.imm] = ghosts.get(wr.imm, 0) + 1
        if err is None and wr.imm is not None:  # (an ended transfer's too: it was counted)
            sums = engine._tx_sums.get((wr.dst, wr.nic))
            if sums is None:
                sums = engine._tx_sums[(wr.dst, wr.nic)] = PowerSums()
            sums.add(wr.imm)
        self._path_done(wr)
        self._settle(wr, err)

    def _settle(self, wr: _WR, err: BaseException | None) -> None:
        """``wr`` is final (its path accounted for): settle its slot of the transfer."""
        xfer = wr.xfer
        batch = wr.batch
        if batch is not None and wr.imm is None:  # a data retry, final now
            batch.data_left -= 1
            carries = err is None and wr.carrier is not None
            if carries:
                batch.makeups.append(wr)
            if batch.data_left == 0:  # every retried byte is in place: the make-up imms
                makeups, batch.makeups = batch.makeups, []
                for d in makeups:
                    if d.xfer.left >= 0 and not d.xfer.early:
                        self._post_retry(d, d.carrier, 0, None)
                    else:
                        self._local_done(d.xfer, None, 0)
            if carries:
                return  # its slot settles with the make-up imm
        self._local_done(xfer, err, wr.length if err is None else 0)

    def _retriable(self, wr: _WR, err: BaseException) -> bool:
        if not isinstance(err, TransportError) or isinstance(
            err, (RemoteAccessError, PeerUnreachable, EngineClosed)
        ):
            return False
        if wr.dst not in self._engines:
            return False
        return self._live_nic(wr.src, wr.dst, wr.nic, wr.xfer.engine.num_nics) is not None

    def _post_retry(self, wr: _WR, imm: int | None, length: int, batch: _Recovery | None) -> _WR | None:
        """Post ``wr`` again on a live NIC (``imm``, ``length``: what the retry carries)."""
        engine = wr.xfer.engine
        nic = self._live_nic(wr.src, wr.dst, wr.nic, engine.num_nics)
        if nic is None:
            err = TransportError(
                "every NIC on the route is down", peer=str(self.address(wr.dst, 0)), nic=wr.nic
            )
            self._settle(wr, err)
            return None
        again = _WR(
            wr.xfer,
            wr.dst,
            nic,
            wr.src_ptr,
            wr.dst_addr,
            length,
            wr.desc.nics[nic].rkey,
            imm,
            self._chunks(length),
            wr.desc,
        )
        again.batch = batch
        self._post_wr(again)
        return again

    def _reconcile(self, engine: SimEngine, dst: int, nic: int) -> None:
        """Settle the WRs that failed on path (engine -> dst, NIC ``nic``) once nothing of it
        is in flight: ask the target for its power sums of the path (a control message on a
        real engine), work out how many of the failed WriteImms it counted per imm value, and
        retry: every failed WR's bytes again without imm on a live NIC, then, once those are
        in place, as many imm-only writes per value as the target is short. All counted: the
        target may already be done with the memory, so nothing is rewritten."""
        if dst in self._stalled:
            return  # (its resumption reconciles; a lost peer fails the transfers meanwhile)
        failed = engine._path_failed.pop((dst, nic), [])
        ghosts = engine._path_ghosts.pop((dst, nic), {})
        live: list[_WR] = []
        for w in failed:
            if w.xfer.left >= 0 and not w.xfer.early:
                live.append(w)
            else:
                if w.imm is not None:  # its transfer ended: reaped, but it may have counted
                    ghosts[w.imm] = ghosts.get(w.imm, 0) + 1
                self._settle(w, None)
        target = self._engines.get(dst)
        if target is None:
            gone = PeerUnreachable(f"peer {self.address(dst, 0)} is gone")
            for w in live:
                self._settle(w, gone)
            return
        with_imm = [(w, w.imm) for w in live if w.imm is not None]
        batch = _Recovery()
        for w in live:
            if w.imm is None:  # bytes only: idempotent, retried as they are
                again = self._post_retry(w, None, w.length, w.batch)
                if again is not None:
                    again.carrier = w.carrier
        if not with_imm and not ghosts:
            return
        live_counts: dict[int, int] = {}
        for _w, imm in with_imm:
            live_counts[imm] = live_counts.get(imm, 0) + 1
        counts = dict(ghosts)
        for imm, n in live_counts.items():
            counts[imm] = counts.get(imm, 0) + n
        rx = target._rx_sums.get((engine.engine_id, nic), PowerSums())
        tx = engine._tx_sums.setdefault((dst, nic), PowerSums())
        landed = landed_per_imm(rx.minus(tx), counts)
        if landed is None:
            err = TransportError(
                f"NIC {nic} was lost with {len(with_imm)} WriteImms to {self.address(dst, 0)} on it, and "
                "the target's counts do not tell how many landed",
                peer=str(self.address(dst, 0)),
                nic=nic,
            )
            for w, _imm in with_imm:
                self._settle(w, err)
            return
        for imm, n in landed.items():
            tx.add(imm, n)  # counted at the target: the path's sums agree again
        # Of each value's landed ones, the ended transfers' are taken to be first: a live
        # WriteImm is made up unless it surely landed (as the compiled engine does).
        short = {imm: n - min(n, max(0, landed[imm] - ghosts.get(imm, 0))) for imm, n in live_counts.items()}
        every = {imm for imm, n in short.items() if n == 0}
        for w, imm in with_imm:
            if imm in every:
                self._settle(w, None)  # all of this value landed
                continue
            again = self._post_retry(w, None, w.length, batch)
            if again is None:
                continue
            batch.data_left += 1
            if short[imm] > 0:
                short[imm] -= 1
                again.carrier = imm

    def _local_done(self, xfer: _Xfer, err: BaseException | None, nbytes: int) -> None:
        if xfer.left < 0:
            return
        engine = xfer.engine
        if xfer.early:  # already completed (deadline, lost peer): reap it
            xfer.left -= 1
            if xfer.left == 0:
                engine._inflight.discard(xfer)
            return
        if err is not None:
            if xfer.error is None:
                xfer.error = err
            if (
                isinstance(err, TransportError)
                and err.nic is not None
                and not isinstance(err, RemoteAccessError)
            ):
                logger.debug("fabric-sim: WR failed on NIC %s: %s", err.nic, err)
        else:
            engine._stat_wrs += 1
            engine._stat_bytes += nbytes
        xfer.left -= 1
        if xfer.left == 0:
            engine._inflight.discard(xfer)
            if xfer.error is not None:
                exc = xfer.error
                if isinstance(exc, TransportError) and exc.transfer_id is None:
                    exc.transfer_id = xfer.transfer.id
                engine._stat_failed += 1
            else:
                engine._stat_completed += 1
            xfer.transfer._resolve(xfer.error)

    def _deliver_message(self, xfer: _Xfer, peer: DomainAddress, data: bytes) -> None:
        err: BaseException | None = None
        try:
            target = self._engines[self.resolve(peer)]
        except PeerUnreachable as exc:
            err = exc
        else:
            if not target._deliver(xfer.engine.address, data, xfer):
                return  # no posted receive: parked until the target consumes one (RNR)
        self._push(self.now + self._jitter(), _LOCAL, (xfer, err, 0))

    def message_taken(self, xfer: _Xfer, err: BaseException | None = None) -> None:
        """A parked message got a receive buffer (or its target died): its sender completes."""
        with self._cv:
            self._push(self.now + self._jitter(), _LOCAL, (xfer, err, 0))
            self._cv.notify_all()
