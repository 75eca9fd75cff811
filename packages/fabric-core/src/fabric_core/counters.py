"""ImmCounter: counting immediates at the target.

Every imm value has a count from engine start: an imm that arrives before anyone waits is
counted, never lost. Waits consume counts in the order they were made (FIFO), so several
waiters on one imm each get their share and a re-arm never discards counts.
"""

from __future__ import annotations

import asyncio
import math
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError, TransferTimeout
from .models import DomainAddress
from .transfer import CallbackDispatcher

__all__ = ["CounterTable", "Expectation", "ImmCounter", "check_imm"]

IMM_LIMIT = 1 << 32


def check_imm(imm: object, what: str = "imm") -> int:
    if isinstance(imm, bool) or not isinstance(imm, (int, np.integer)):
        raise ConfigError(f"{what} must be an int in [0, 2**32), got {type(imm).__name__}")
    value = int(imm)
    if not 0 <= value < IMM_LIMIT:
        raise ConfigError(f"{what} {value} is out of range: imms are 32-bit, [0, 2**32)")
    return value


@dataclass(eq=False)
class _Waiter:
    n: int
    fire: Callable[[BaseException | None], None]
    peer: bytes | None = None
    settled: bool = False
    error: BaseException | None = None


@dataclass
class _Slot:
    count: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)


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
        self.imms_received = 0

    def add(self, imm: int, n: int = 1) -> None:
        """Count ``n`` arrivals of ``imm`` and settle the waiters they satisfy."""
        fired: list[_Waiter] = []
        with self._lock:
            self.imms_received += n
            slot = self._slots.get(imm)
            if slot is None:
                slot = self._slots[imm] = _Slot()
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

    def _refund(self, imm: int, n: int) -> None:
        """Return consumed counts (a waiter was cancelled just as it fired)."""
        self.add(imm, n)
        with self._lock:
            self.imms_received -= n

    def fail_peer(self, peer: bytes, exc: BaseException) -> None:
        """Fail every waiter that named ``peer`` as the one it depends on, and every later
        one that names it (until ``revive_peer``)."""
        failed: list[_Waiter] = []
        with self._lock:
            self._lost[peer] = exc
            for slot in self._slots.values():
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
        for w in failed:
            w.fire(exc)

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
            if not self._table._remove(self.imm, waiter) and waiter.error is None:
                self._table._refund(self.imm, n)  # fired as we were cancelled: give counts back
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

        def fire(exc: BaseException | None) -> None:
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
