"""ImmCounter: counting immediates at the target.

Every imm value has a count from engine start: an imm that arrives before anyone waits is
counted, never lost. Waits consume counts in the order they were made (FIFO), so several
waiters on one imm each get their share and a re-arm never discards counts.

``CounterTable`` is the reference implementation in Python (the simulator's). Compiled
backends keep the table in C++ (``fabric/counters.hpp``), where their worker counts imms as it
polls them, and use ``NativeCounterTable``: the same semantics, with ``wait`` woken by the
worker itself rather than through a Python thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConfigError, EngineClosed, PeerUnreachable, TransferTimeout
from .models import DomainAddress
from .stats import WAIT_BUCKETS_S, WaitLatency
from .transfer import CallbackDispatcher

if TYPE_CHECKING:
    from ._native_api import NativeTableApi as NativeTable

__all__ = [
    "CounterTable",
    "Expectation",
    "ImmCounter",
    "NativeCounterTable",
    "CountWait",
    "check_count_waits",
    "check_imm",
    "check_wait_timeout",
]

IMM_LIMIT = 1 << 32


def check_imm(imm: object, what: str = "imm") -> int:
    if isinstance(imm, bool) or not isinstance(imm, (int, np.integer)):
        raise ConfigError(f"{what} must be an int in [0, 2**32), got {type(imm).__name__}")
    value = int(imm)
    if not 0 <= value < IMM_LIMIT:
        raise ConfigError(f"{what} {value} is out of range: imms are 32-bit, [0, 2**32)")
    return value


CountWant = tuple[int, int, bytes | None]
"""One entry of ``CounterTable.wait_all``: (imm, counts, the raw address of the peer it
depends on or None)."""


def _short(wants: Sequence[CountWant], seen: Sequence[int | None], limit: float) -> TransferTimeout:
    """The timeout of a ``wait_all``: the entries still waiting, with the count each saw."""
    expected: dict[int, int] = {}
    received: dict[int, int] = {}
    peer: bytes | None = None
    for (imm, n, p), s in zip(wants, seen, strict=True):
        if s is None:
            continue
        expected[imm] = expected.get(imm, 0) + n
        received[imm] = s
        peer = peer or p
    return TransferTimeout(
        f"counter waits timed out after {limit:g} s",
        expected=expected,
        received=received,
        peer=peer.hex() if peer else None,
    )


@dataclass(eq=False)
class _Waiter:
    n: int
    fire: Callable[[BaseException | None], None]
    peer: bytes | None = None
    settled: bool = False
    error: BaseException | None = None
    token: int = 0  # NativeCounterTable: the C++ table's handle of this waiter
    abandoned: bool = False  # NativeCounterTable: cancelled while its firing was under way


_WORD = 0xFFFFFFFF


@dataclass(eq=False)
class _Mirror:
    """A GPU-side wait's view of one imm: a 32-bit word of mapped host memory holding
    ``base`` + arrivals (see ``CounterTable.attach_mirror``)."""

    word: ctypes.c_uint32
    base: int
    peer: bytes | None
    reserved: int = 0
    error: BaseException | None = None

    def publish(self, arrived: int) -> None:
        # a failed mirror's word was set past every target: it never moves back from there
        top = arrived if self.error is None else max(arrived, self.reserved)
        self.word.value = (self.base + top) & _WORD

    def release(self, arrived: int, exc: BaseException) -> bool:
        if self.error is not None:
            return False
        self.error = exc
        self.word.value = (self.base + max(arrived, self.reserved)) & _WORD
        return True


@dataclass
class _Slot:
    count: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)
    arrived: int = 0  # arrivals since engine start (refunds excluded)
    mirror: _Mirror | None = None


class Expectation:
    """Handle of ``ImmCounter.expect``: ``cancel()`` withdraws it if it has not fired."""

    def __init__(self, table: CounterTable, imm: int, waiter: _Waiter) -> None:
        self._table, self._imm, self._waiter = table, imm, waiter
        self._cancelled = False

    @property
    def fired(self) -> bool:
        """The counts were reached (or the wait failed) and the callback was scheduled."""
        return self._waiter.settled and not self._cancelled

    def cancel(self) -> bool:
        """True if withdrawn before firing (no count was consumed)."""
        self._cancelled = self._table._remove(self._imm, self._waiter)
        return self._cancelled


class CounterTable:
    """The per-engine table of imm counts (a reference implementation in Python)."""

    def __init__(self, dispatcher: CallbackDispatcher | None = None) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._dispatch = dispatcher
        self._lost: dict[bytes, BaseException] = {}
        self._received = 0
        self.waits = WaitLatency()
        """How long counter waits on this table took (``EngineStats.counter_waits``)."""

    @property
    def imms_received(self) -> int:
        """Imms counted since engine start (consumed or not)."""
        return self._received

    def add(self, imm: int, n: int = 1, *, received: bool = True) -> None:
        """Count ``n`` arrivals of ``imm`` and settle the waiters they satisfy
        (``received=False``: counts a withdrawn waiter gives back, not arrivals)."""
        fired: list[_Waiter] = []
        with self._lock:
            slot = self._slots.get(imm)
            if slot is None:
                slot = self._slots[imm] = _Slot()
            if received:
                self._received += n
                slot.arrived += n
                if slot.mirror is not None:
                    slot.mirror.publish(slot.arrived)
            slot.count += n
            while slot.waiters and slot.count >= slot.waiters[0].n:
                w = slot.waiters.popleft()
                slot.count -= w.n
                w.settled = True
                fired.append(w)
        for w in fired:
            w.fire(None)

    def value(self, imm: int) -> int:
        with self._lock:
            slot = self._slots.get(imm)
            return slot.count if slot else 0

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return {imm: s.count for imm, s in self._slots.items() if s.count}

    def _arm(self, imm: int, waiter: _Waiter) -> bool:
        """Queue a waiter; returns True if it was satisfied at once (counts consumed).

        Raises the peer's error at once if the waiter names a peer already known lost.
        """
        with self._lock:
            if waiter.peer is not None and waiter.peer in self._lost:
                raise self._lost[waiter.peer]
            slot = self._slots.get(imm)
            if slot is None:
                slot = self._slots[imm] = _Slot()
            if not slot.waiters and slot.count >= waiter.n:
                slot.count -= waiter.n
                waiter.settled = True
                return True
            slot.waiters.append(waiter)
            return False

    def _remove(self, imm: int, waiter: _Waiter) -> bool:
        return self._withdraw(imm, waiter) is not None

    def _withdraw(self, imm: int, waiter: _Waiter) -> int | None:
        """Take an unsettled waiter out of the queue; returns the count it saw (None if it
        had already fired or failed)."""
        fired: list[_Waiter] = []
        with self._lock:
            if waiter.settled:
                return None
            slot = self._slots[imm]
            seen = slot.count
            slot.waiters.remove(waiter)
            waiter.settled = True
            # A large waiter that left the head may unblock smaller ones behind it.
            while slot.waiters and slot.count >= slot.waiters[0].n:
                w = slot.waiters.popleft()
                slot.count -= w.n
                w.settled = True
                fired.append(w)
        for w in fired:
            w.fire(None)
        return seen

    def _cancel(self, imm: int, waiter: _Waiter) -> None:
        """Withdraw a waiter whose caller gave up (asyncio cancellation): if it fired as it
        was cancelled, its counts go back to the table."""
        if not self._remove(imm, waiter) and waiter.error is None:
            self._refund(imm, waiter.n)

    def _refund(self, imm: int, n: int) -> None:
        """Return consumed counts (a waiter was cancelled just as it fired)."""
        self.add(imm, n, received=False)

    # --- several counters at once ------------------------------------------------------
    def wait_all(self, wants: Sequence[CountWant], limit: float) -> None:
        """Block until every ``(imm, n, peer)`` of ``wants`` has its counts, then consume
        them all together (``TransferEngine.wait_counts``). On any error nothing is consumed:
        the counts of entries that were satisfied are given back. ``PeerUnreachable`` at once
        when a named peer is (or becomes) lost; ``TransferTimeout`` at ``limit`` seconds,
        naming the entries still short."""
        lock, done = threading.Lock(), threading.Event()
        left = [len(wants)]
        failure: list[BaseException] = []

        def fire(exc: BaseException | None) -> None:
            with lock:
                if exc is not None:
                    failure.append(exc)
                else:
                    left[0] -= 1
                if exc is not None or left[0] == 0:
                    done.set()

        armed: list[tuple[int, _Waiter]] = []
        try:
            for imm, n, peer in wants:
                waiter = _Waiter(n, fire, peer)
                if self._arm(imm, waiter):
                    fire(None)
                armed.append((imm, waiter))
        except BaseException:
            self._give_back(armed, self._withdraw_all(armed))
            raise
        if done.wait(None if math.isinf(limit) else limit) and not failure:
            return
        seen = self._withdraw_all(armed)
        if not failure and all(s is None for s in seen):
            return  # every one fired as the deadline passed: taken after all
        self._give_back(armed, seen)
        if failure:
            raise failure[0]
        raise _short(wants, seen, limit)

    def _withdraw_all(self, armed: Sequence[tuple[int, _Waiter]]) -> list[int | None]:
        """Withdraw the armed waiters still queued: the count each saw (None: it had settled)."""
        return [self._withdraw(imm, w) for imm, w in armed]

    def _give_back(self, armed: Sequence[tuple[int, _Waiter]], seen: Sequence[int | None]) -> None:
        """Return the counts of the armed waiters that fired."""
        for (imm, w), s in zip(armed, seen, strict=True):
            if s is None and w.settled and w.error is None:
                self._refund(imm, w.n)

    # --- GPU-side waits ----------------------------------------------------------------
    # A mirror publishes one imm's arrivals to a 32-bit word of host memory mapped into the
    # GPUs (``fabric_core.device_counter``): base + arrivals since engine start, mod 2**32,
    # written by whoever counts them. ``reserve`` hands out the targets of GPU waits (base +
    # arrivals asked for so far): the device ledger is its own, host waiters' consumption
    # does not touch it. A failed mirror stores the highest target handed out, so every GPU
    # wait queued on it passes, and refuses further reserves with its error. The word only
    # ever grows (``base`` starts from its value), so one word can serve mirror after mirror.
    # fabric/counters.hpp keeps the same semantics in C++.
    def attach_mirror(self, imm: int, word: int, peer: bytes | None) -> None:
        """Publish ``imm``'s arrivals to the 32-bit word at address ``word``."""
        with self._lock:
            if peer is not None and peer in self._lost:
                raise self._lost[peer]
            slot = self._slots.get(imm)
            if slot is None:
                slot = self._slots[imm] = _Slot()
            if slot.mirror is not None:
                raise ConfigError(f"imm {imm} already has a device counter")
            w = ctypes.c_uint32.from_address(word)
            slot.mirror = _Mirror(w, (w.value - slot.arrived) & _WORD, peer)

    def reserve(self, imm: int, n: int) -> int:
        """The word's value once ``n`` more arrivals (beyond those reserved) are in."""
        with self._lock:
            slot = self._slots.get(imm)
            m = slot.mirror if slot is not None else None
            if m is None:
                raise ConfigError(f"imm {imm} has no device counter")
            if m.error is not None:
                raise m.error
            m.reserved += n
            return (m.base + m.reserved) & _WORD

    def fail_mirror(self, imm: int, exc: BaseException, *, detach: bool = False) -> bool:
        """Fail ``imm``'s mirror with ``exc``, letting its GPU waits pass; False if it had
        none or had failed already. ``detach``: the mirror goes, its word is free."""
        with self._lock:
            slot = self._slots.get(imm)
            m = slot.mirror if slot is not None else None
            if m is None or slot is None:
                return False
            fresh = m.release(slot.arrived, exc)
            if detach:
                slot.mirror = None
            return fresh

    def mirror_state(self, imm: int) -> tuple[int, int]:
        """(arrivals of ``imm`` since engine start, arrivals reserved by GPU waits)."""
        with self._lock:
            slot = self._slots.get(imm)
            if slot is None:
                return 0, 0
            return slot.arrived, slot.mirror.reserved if slot.mirror is not None else 0

    def fail_peer(self, peer: bytes, exc: BaseException) -> None:
        """Fail every waiter that named ``peer`` as the one it depends on, and every later
        one that names it (until ``revive_peer``)."""
        failed: list[_Waiter] = []
        with self._lock:
            self._lost[peer] = exc
            for slot in self._slots.values():
                if slot.mirror is not None and slot.mirror.peer == peer:
                    slot.mirror.release(slot.arrived, exc)
                keep: deque[_Waiter] = deque()
                for w in slot.waiters:
                    if w.peer == peer:
                        w.settled = True
                        w.error = exc
                        failed.append(w)
                    else:
                        keep.append(w)
                slot.waiters = keep
        for w in failed:
            w.fire(exc)

    def revive_peer(self, peer: bytes) -> None:
        """``peer`` is reachable again (a restarted process at the same address)."""
        with self._lock:
            self._lost.pop(peer, None)

    def fail_all(self, exc: BaseException) -> None:
        failed: list[_Waiter] = []
        with self._lock:
            for slot in self._slots.values():
                for w in slot.waiters:
                    w.settled = True
                    w.error = exc
                    failed.append(w)
                slot.waiters.clear()
                if slot.mirror is not None:
                    slot.mirror.release(slot.arrived, exc)
        for w in failed:
            w.fire(exc)

    def names_peer(self, peer: bytes) -> bool:
        """Whether a queued waiter names ``peer`` (it depends on that peer's liveness)."""
        with self._lock:
            return any(w.peer == peer for s in self._slots.values() for w in s.waiters) or any(
                s.mirror is not None and s.mirror.error is None and s.mirror.peer == peer
                for s in self._slots.values()
            )

    def pending(self) -> list[dict[str, Any]]:
        """Every queued waiter, FIFO per imm: imm, counts received (unconsumed), counts
        expected, the peer it names (hex) — for hang diagnostics."""
        with self._lock:
            return [
                {"imm": imm, "received": s.count, "expected": w.n, "peer": w.peer.hex() if w.peer else None}
                for imm, s in sorted(self._slots.items())
                for w in s.waiters
            ]

    def counter(self, imm: int, default_timeout: float) -> ImmCounter:
        return TableCounter(self, check_imm(imm), default_timeout)


class ImmCounter(ABC):
    """Counts arrivals of one imm value at this engine."""

    imm: int

    @property
    @abstractmethod
    def value(self) -> int:
        """Counts arrived and not yet consumed by a wait."""

    @abstractmethod
    def wait(self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None) -> None:
        """Block until ``n`` counts are available, then consume them.

        ``timeout=None`` uses the engine default, ``math.inf`` waits forever. At the deadline
        nothing is consumed and ``TransferTimeout`` reports expected vs received. If ``peer``
        is given, the wait fails with ``PeerUnreachable`` as soon as that peer is found dead
        (at once if it already is).
        """

    @abstractmethod
    async def wait_async(
        self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None
    ) -> None:
        """Awaitable ``wait``."""

    @abstractmethod
    def expect(
        self,
        n: int,
        callback: Callable[[], None],
        *,
        on_error: Callable[[BaseException], None] | None = None,
        peer: DomainAddress | None = None,
    ) -> Expectation:
        """Call ``callback()`` (on the engine's callback thread) once ``n`` counts are
        available, consuming them. One-shot; call again to re-arm. With ``peer``, ``on_error``
        gets ``PeerUnreachable`` when that peer dies; a peer already dead raises it here."""


def check_wait_timeout(timeout: object, what: str = "timeout") -> float | None:
    """A blocking wait's ``timeout``: None (the engine default), 0 (poll), a positive number of
    seconds or ``math.inf``. Anything else (NaN, negative, not a number) is a ``ConfigError``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ConfigError(
            f"{what} must be None, 0, a positive number of seconds or math.inf, got {timeout!r}"
        )
    return float(timeout)


CountWait = tuple[int, int] | tuple[int, int, DomainAddress | None]
"""An entry of ``TransferEngine.wait_counts``: ``(imm, n)`` or ``(imm, n, peer)``."""


def check_count_waits(waits: object) -> list[CountWant]:
    """``wait_counts``' entries, checked: ``ConfigError`` naming the first bad one."""
    if isinstance(waits, (str, bytes, bytearray)) or not isinstance(waits, (list, tuple)):
        raise ConfigError(
            f"waits must be a list of (imm, n) or (imm, n, peer) tuples, got {type(waits).__name__}"
        )
    out: list[CountWant] = []
    for i, entry in enumerate(waits):
        if not isinstance(entry, tuple) or len(entry) not in (2, 3):
            raise ConfigError(f"waits[{i}] must be a tuple (imm, n) or (imm, n, peer), got {entry!r}")
        imm = check_imm(entry[0], f"waits[{i}] imm")
        n = entry[1]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"waits[{i}]: the count to wait for must be a positive int, got {n!r}")
        peer = entry[2] if len(entry) == 3 else None
        if peer is not None and not isinstance(peer, DomainAddress):
            raise ConfigError(f"waits[{i}]: peer must be a DomainAddress or None, got {type(peer).__name__}")
        out.append((imm, n, peer.raw if peer is not None else None))
    return out


def _check_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"count to wait for must be a positive int, got {n!r}")
    return n


class TableCounter(ImmCounter):
    def __init__(self, table: CounterTable, imm: int, default_timeout: float) -> None:
        self._table = table
        self.imm = imm
        self._default_timeout = default_timeout

    @property
    def value(self) -> int:
        return self._table.value(self.imm)

    def _timeout(self, n: int, limit: float, seen: int) -> TransferTimeout:
        return TransferTimeout(
            f"counter wait timed out after {limit:g} s", expected={self.imm: n}, received={self.imm: seen}
        )

    def wait(self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None) -> None:
        n = _check_n(n)
        timeout = check_wait_timeout(timeout)
        start = time.monotonic()
        try:
            self._wait(n, timeout, peer)
        except BaseException:
            self._table.waits.record(time.monotonic() - start, False)
            raise
        self._table.waits.record(time.monotonic() - start, True)

    def _wait(self, n: int, timeout: float | None, peer: DomainAddress | None) -> None:
        limit = self._default_timeout if timeout is None else timeout
        done = threading.Event()
        box: list[BaseException | None] = [None]

        def fire(exc: BaseException | None) -> None:
            box[0] = exc
            done.set()

        waiter = _Waiter(n, fire, peer.raw if peer is not None else None)
        if self._table._arm(self.imm, waiter):
            return
        if not done.wait(None if math.isinf(limit) else limit):
            seen = self._table._withdraw(self.imm, waiter)
            if seen is not None:
                raise self._timeout(n, limit, seen)
        done.wait()
        if box[0] is not None:
            raise box[0]

    async def wait_async(
        self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None
    ) -> None:
        n = _check_n(n)
        timeout = check_wait_timeout(timeout)
        start = time.monotonic()
        try:
            await self._wait_async(n, timeout, peer)
        except BaseException:
            self._table.waits.record(time.monotonic() - start, False)
            raise
        self._table.waits.record(time.monotonic() - start, True)

    async def _wait_async(self, n: int, timeout: float | None, peer: DomainAddress | None) -> None:
        limit = self._default_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def fire(exc: BaseException | None) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

            if not loop.is_closed():
                loop.call_soon_threadsafe(settle)

        waiter = _Waiter(n, fire, peer.raw if peer is not None else None)
        if self._table._arm(self.imm, waiter):
            return
        try:
            await asyncio.wait_for(asyncio.shield(fut), None if math.isinf(limit) else limit)
        except asyncio.TimeoutError:
            seen = self._table._withdraw(self.imm, waiter)
            if seen is not None:
                raise self._timeout(n, limit, seen) from None
            await fut  # it fired meanwhile: the counts are ours
        except asyncio.CancelledError:
            self._table._cancel(self.imm, waiter)  # fired as we were cancelled: counts go back
            raise

    def expect(
        self,
        n: int,
        callback: Callable[[], None],
        *,
        on_error: Callable[[BaseException], None] | None = None,
        peer: DomainAddress | None = None,
    ) -> Expectation:
        n = _check_n(n)
        dispatch = self._table._dispatch
        waits, start = self._table.waits, time.monotonic()

        def fire(exc: BaseException | None) -> None:
            waits.record(time.monotonic() - start, exc is None)

            def run() -> None:
                if exc is None:
                    callback()
                elif on_error is not None:
                    on_error(exc)

            if dispatch is not None:
                dispatch.submit(run)
            else:
                run()

        waiter = _Waiter(n, fire, peer.raw if peer is not None else None)
        if self._table._arm(self.imm, waiter):
            fire(None)
        return Expectation(self._table, self.imm, waiter)

    def __repr__(self) -> str:
        return f"<ImmCounter imm={self.imm:#x} value={self.value}>"


# --- the C++ table ---------------------------------------------------------------------------
_OK, _QUEUED, _TIMEOUT, _PEER_LOST, _FAILED = range(5)  # fabric/counters.hpp CounterCode


class NativeCounterTable(CounterTable):
    """``CounterTable`` over a C++ table that the engine's worker fills as it polls.

    Counts, FIFO queues and peer state live in C++. Blocking waits run there with the GIL
    released; asyncio waits and ``expect`` callbacks queue a token, and the tokens the worker
    fires come back through the backend's completion thread (``fire_tokens``).
    """

    def __init__(self, native: NativeTable, dispatcher: CallbackDispatcher | None = None) -> None:
        super().__init__(dispatcher)
        self._native = native
        # blocking waits satisfied in C++ are tallied there, in WAIT_BUCKETS_S (NativeCounter.wait)
        native.configure_wait_buckets(list(WAIT_BUCKETS_S))
        self.waits.add_source(native.wait_stats)
        self._tokens = itertools.count(1)
        # queued token waiters and their imms (single dict operations are atomic)
        self._waiters: dict[int, tuple[_Waiter, int]] = {}
        self._failure: BaseException | None = None
        # device counters' mirrors: the peer each names, and errors given them from Python
        self._mirror_peers: dict[int, bytes | None] = {}
        self._mirror_errors: dict[int, BaseException] = {}
        # the engine's: a wait named a lost peer, so probe it (an answer revives it)
        self.on_lost_wait: Callable[[bytes], None] | None = None

    @property
    def imms_received(self) -> int:
        return self._native.received()

    def fire_tokens(self, tokens: Iterable[int], exc: BaseException | None = None) -> None:
        """Run the waiters behind ``tokens`` (fired, or failed with ``exc``)."""
        for token in tokens:
            entry = self._waiters.pop(token, None)
            if entry is None:
                continue
            w, imm = entry
            with self._lock:
                w.settled = True
                w.error = exc
                give_back = w.abandoned and exc is None
            if give_back:
                self._refund(imm, w.n)
            else:
                w.fire(exc)

    def add(self, imm: int, n: int = 1, *, received: bool = True) -> None:
        self.fire_tokens(self._native.add(imm, n, received))

    def value(self, imm: int) -> int:
        return self._native.value(imm)

    def snapshot(self) -> dict[int, int]:
        return dict(self._native.snapshot())

    def _arm(self, imm: int, waiter: _Waiter) -> bool:
        waiter.token = token = next(self._tokens)
        self._waiters[token] = (waiter, imm)  # before arming: the worker may fire it at once
        code = self._native.arm(imm, waiter.n, waiter.peer or b"", token)
        if code == _QUEUED:
            return False
        self._waiters.pop(token, None)
        if code == _PEER_LOST:
            raise self.lost_wait(waiter.peer or b"")
        waiter.settled = True
        return True

    def _withdraw(self, imm: int, waiter: _Waiter) -> int | None:
        seen, fired = self._native.withdraw(imm, waiter.token)
        self.fire_tokens(fired)
        if seen < 0:
            return None  # fired or failed: its token is (or is about to be) fired
        self._waiters.pop(waiter.token, None)
        waiter.settled = True
        return seen

    def _cancel(self, imm: int, waiter: _Waiter) -> None:
        if self._remove(imm, waiter):
            return
        # It fired or failed in C++; its token may not have reached fire_tokens yet. Whichever
        # of the two sees both flags gives the counts back (failed waiters consumed none).
        with self._lock:
            waiter.abandoned = True
            give_back = waiter.settled and waiter.error is None
        if give_back:
            self._refund(imm, waiter.n)

    def _refund(self, imm: int, n: int) -> None:
        self.fire_tokens(self._native.add(imm, n, False))

    def wait_all(self, wants: Sequence[CountWant], limit: float) -> None:
        # in C++ with the GIL released, woken by the worker (not through the callback thread)
        code, index, seen, fired, interrupted = self._native.wait_all(
            [(imm, n, peer or b"") for imm, n, peer in wants], limit
        )
        if fired:
            self.fire_tokens(fired)
        if interrupted is not None:
            raise interrupted
        if code == _OK:
            return
        if code == _TIMEOUT:
            raise _short(wants, [None if v < 0 else v for v in seen], limit)
        if code == _PEER_LOST:
            raise self.lost_wait(wants[index][2] or b"")
        raise self._failure or EngineClosed("engine closed while waiting on counters")

    def attach_mirror(self, imm: int, word: int, peer: bytes | None) -> None:
        code = self._native.attach_mirror(imm, word, peer or b"")
        if code == _PEER_LOST:
            raise self.lost_error(peer or b"")
        if code != _OK:
            raise ConfigError(f"imm {imm} already has a device counter")
        self._mirror_peers[imm] = peer
        self._mirror_errors.pop(imm, None)

    def reserve(self, imm: int, n: int) -> int:
        code, target = self._native.reserve(imm, n)
        if code == _OK:
            return target
        if imm not in self._mirror_peers:
            raise ConfigError(f"imm {imm} has no device counter")
        raise self._mirror_error(imm, code)

    def _mirror_error(self, imm: int, code: int) -> BaseException:
        exc = self._mirror_errors.get(imm)
        if exc is not None:
            return exc
        if code == _PEER_LOST:
            return self.lost_error(self._mirror_peers.get(imm) or b"")
        return self._failure or EngineClosed("the engine closed under a device counter")

    def fail_mirror(self, imm: int, exc: BaseException, *, detach: bool = False) -> bool:
        self._mirror_errors.setdefault(imm, exc)
        fresh = self._native.fail_mirror(imm, _TIMEOUT, detach)
        if detach:
            self._mirror_peers.pop(imm, None)
        return fresh

    def mirror_state(self, imm: int) -> tuple[int, int]:
        arrived, reserved, _state = self._native.mirror_state(imm)
        return arrived, reserved

    def lost_wait(self, peer: bytes) -> BaseException:
        """The error of a wait that names ``peer``, a peer known lost; asks the engine to
        probe it, so that a later wait goes through if it is back."""
        if self.on_lost_wait is not None:
            self.on_lost_wait(peer)
        return self.lost_error(peer)

    def lost_error(self, peer: bytes) -> BaseException:
        exc = self._lost.get(peer)
        return exc if exc is not None else PeerUnreachable(f"peer {peer.hex()} is gone", peer=peer.hex())

    def fail_peer(self, peer: bytes, exc: BaseException) -> None:
        self._lost[peer] = exc
        self.fire_tokens(self._native.fail_peer(peer), exc)

    def revive_peer(self, peer: bytes) -> None:
        self._native.revive_peer(peer)
        self._lost.pop(peer, None)

    def fail_all(self, exc: BaseException) -> None:
        self._failure = exc
        self.fire_tokens(self._native.fail_all(), exc)

    def pending(self) -> list[dict[str, Any]]:
        return [
            {"imm": imm, "received": count, "expected": n, "peer": peer.hex() if peer else None}
            for imm, count, n, peer in self._native.pending()
        ]

    def counter(self, imm: int, default_timeout: float) -> ImmCounter:
        return NativeCounter(self, check_imm(imm), default_timeout)


class NativeCounter(TableCounter):
    """A counter of a ``NativeCounterTable``: ``wait`` blocks in C++ (GIL released)."""

    _table: NativeCounterTable

    def wait(self, n: int = 1, timeout: float | None = None, *, peer: DomainAddress | None = None) -> None:
        # TableCounter.wait with its common case in C++: the native wait (a METH_FASTCALL
        # method) returns None once the counts are consumed, and tallies the wait's time
        # itself. It is on the path of every imm round trip, where each layer of Python costs
        # a fraction of a microsecond.
        if type(n) is not int or n < 1:
            n = _check_n(n)
        if timeout is None:
            limit = self._default_timeout
        elif type(timeout) is float and timeout >= 0.0:
            limit = timeout
        else:
            limit = check_wait_timeout(timeout) or 0.0
        table = self._table
        out = table._native.wait(self.imm, n, peer.raw if peer is not None else b"", limit)
        if out is None:
            return
        code, seen, fired, interrupted, took = out
        try:
            self._settle(n, limit, peer, code, seen, fired, interrupted)
        except BaseException:
            table.waits.record(took, False)
            raise
        table.waits.record(took, True)

    def _settle(
        self,
        n: int,
        limit: float,
        peer: DomainAddress | None,
        code: int,
        seen: int,
        fired: list[int],
        interrupted: BaseException | None,
    ) -> None:
        """What a native wait's outcome means: tokens it fired run, then it returns or raises."""
        table = self._table
        raw = peer.raw if peer is not None else b""
        if fired:
            table.fire_tokens(fired)
        if interrupted is not None:
            raise interrupted
        if code == _OK:
            return
        if code == _TIMEOUT:
            raise self._timeout(n, limit, seen)
        if code == _PEER_LOST:
            raise table.lost_wait(raw)
        raise table._failure or EngineClosed("engine closed while waiting on a counter")
