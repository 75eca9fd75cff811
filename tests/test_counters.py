"""Unit tests of fabric_core.counters: CounterTable and TableCounter, without an engine."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

import pytest

from fabric_core import ConfigError, DomainAddress, EngineClosed, PeerUnreachable, TransferTimeout
from fabric_core.counters import CounterTable, Expectation, ImmCounter, TableCounter, check_imm
from fabric_core.transfer import CallbackDispatcher

IMM = 0x2A
PEER_A = DomainAddress(raw=b"\xaa")
PEER_B = DomainAddress(raw=b"\xbb")
LONG = 10.0  # bound of waits that must succeed: nothing can hang


def make(imm: int = IMM, default_timeout: float = LONG) -> tuple[CounterTable, TableCounter]:
    table = CounterTable()
    counter = table.counter(imm, default_timeout)
    assert isinstance(counter, TableCounter) and isinstance(counter, ImmCounter)
    return table, counter


class Waiter:
    """Runs ``counter.wait`` on a thread and records how it ended."""

    def __init__(self, counter: ImmCounter, n: int = 1, timeout: float = LONG, **kw: object) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.finished_at = 0.0

        def run() -> None:
            try:
                counter.wait(n, timeout=timeout, **kw)  # type: ignore[arg-type]
            except BaseException as exc:
                self.error = exc
            self.finished_at = time.monotonic()
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        assert self.done.wait(LONG), "wait did not finish"
        self.thread.join(LONG)


def settle(cond: Callable[[], bool], timeout: float = LONG) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def queued(table: CounterTable, imm: int = IMM) -> int:
    """Number of waiters queued on ``imm`` (white box, to sequence threads without sleeps)."""
    with table._lock:
        slot = table._slots.get(imm)
        return len(slot.waiters) if slot else 0


# --------------------------------------------------------------------------- counting


def test_counts_before_any_wait_are_kept() -> None:
    table, c = make()
    assert c.value == 0
    table.add(IMM)
    table.add(IMM, 4)
    table.add(IMM + 1, 2)
    assert c.value == 5
    assert table.value(IMM + 1) == 2 and table.value(999) == 0
    assert table.snapshot() == {IMM: 5, IMM + 1: 2}
    assert table.imms_received == 7
    c.wait(5, timeout=0)  # satisfied at once, even with a zero timeout
    assert c.value == 0 and table.value(IMM + 1) == 2
    assert table.snapshot() == {IMM + 1: 2}
    assert table.imms_received == 7


def test_wait_consumes_exactly_n() -> None:
    table, c = make()
    table.add(IMM, 5)
    c.wait(2, timeout=LONG)
    assert c.value == 3
    c.wait(timeout=LONG)
    assert c.value == 2
    c.wait(2, timeout=LONG)
    assert c.value == 0
    with pytest.raises(TransferTimeout):
        c.wait(1, timeout=0.01)


def test_two_counters_of_one_imm_share_counts() -> None:
    table, c1 = make()
    c2 = table.counter(IMM, LONG)
    table.add(IMM, 3)
    assert c1.value == c2.value == 3
    c2.wait(3, timeout=LONG)
    assert c1.value == 0
    assert repr(c1) == "<ImmCounter imm=0x2a value=0>"


def test_blocked_wait_is_woken_by_arrivals() -> None:
    table, c = make()
    w = Waiter(c, 3)
    settle(lambda: queued(table) == 1)
    table.add(IMM, 2)
    assert not w.done.wait(0.05)
    table.add(IMM, 2)
    w.join()
    assert w.error is None
    assert c.value == 1


def test_fifo_among_waiters() -> None:
    table, c = make()
    order: list[str] = []
    first = Waiter(c, 3)
    settle(lambda: queued(table) == 1)
    second = Waiter(c, 1)
    settle(lambda: queued(table) == 2)
    # One count would satisfy the second waiter, but the first is ahead of it.
    table.add(IMM, 1)
    assert not first.done.wait(0.05) and not second.done.is_set()
    assert c.value == 1
    table.add(IMM, 2)
    first.join()
    order.append("first")
    assert not second.done.wait(0.05)  # the first took all three
    assert c.value == 0
    table.add(IMM, 1)
    second.join()
    order.append("second")
    assert first.error is None and second.error is None
    assert order == ["first", "second"] and c.value == 0


def test_one_add_settles_several_waiters_in_order() -> None:
    table, c = make()
    fired: list[int] = []
    for i in range(3):
        c.expect(2, lambda i=i: fired.append(i))  # type: ignore[misc]
    table.add(IMM, 5)
    assert fired == [0, 1]
    assert c.value == 1
    table.add(IMM, 1)
    assert fired == [0, 1, 2] and c.value == 0


def test_timed_out_head_waiter_unblocks_the_next() -> None:
    table, c = make()
    big = Waiter(c, 10, timeout=0.2)
    settle(lambda: queued(table) == 1)
    small = Waiter(c, 2)
    settle(lambda: queued(table) == 2)
    table.add(IMM, 3)
    big.join()
    small.join()
    assert isinstance(big.error, TransferTimeout)
    assert big.error.expected == {IMM: 10}
    # the report counts what had arrived before the queue moved on to the small waiter
    assert big.error.received == {IMM: 3}
    assert small.error is None
    assert c.value == 1


# --------------------------------------------------------------------------- timeouts


def test_wait_timeout_reports_and_consumes_nothing() -> None:
    table, c = make()
    table.add(IMM, 2)
    start = time.monotonic()
    with pytest.raises(TransferTimeout) as info:
        c.wait(5, timeout=0.1)
    elapsed = time.monotonic() - start
    assert 0.09 <= elapsed < 2.0
    exc = info.value
    assert isinstance(exc, TimeoutError)
    assert exc.expected == {IMM: 5}
    assert exc.received == {IMM: 2}
    assert str(exc) == "counter wait timed out after 0.1 s (imm 0x2a: expected 5, received 2)"
    assert c.value == 2
    assert queued(table) == 0
    table.add(IMM, 3)
    assert c.value == 5  # the timed-out waiter is gone: it takes nothing later
    c.wait(5, timeout=0)
    assert c.value == 0


def test_zero_timeout_with_nothing_there() -> None:
    _, c = make()
    with pytest.raises(TransferTimeout) as info:
        c.wait(timeout=0)
    assert info.value.expected == {IMM: 1} and info.value.received == {IMM: 0}


def test_default_timeout_is_used() -> None:
    _, c = make(default_timeout=0.05)
    with pytest.raises(TransferTimeout, match=r"after 0\.05 s"):
        c.wait()


def test_infinite_timeout_waits_for_arrival() -> None:
    table, c = make(default_timeout=0.01)
    w = Waiter(c, 1, timeout=math.inf)
    settle(lambda: queued(table) == 1)
    assert not w.done.wait(0.1)  # longer than the default timeout
    table.add(IMM)
    w.join()
    assert w.error is None and c.value == 0


# --------------------------------------------------------------------------- expect


def test_expect_fires_once() -> None:
    table, c = make()
    calls: list[int] = []
    e = c.expect(2, lambda: calls.append(c.value))
    assert isinstance(e, Expectation)
    assert not e.fired
    table.add(IMM)
    assert calls == [] and c.value == 1
    table.add(IMM)
    assert calls == [0] and e.fired
    table.add(IMM, 4)
    assert calls == [0]  # one-shot
    assert c.value == 4
    assert e.cancel() is False  # already fired
    assert c.value == 4


def test_expect_satisfied_at_once() -> None:
    table, c = make()
    table.add(IMM, 3)
    calls: list[str] = []
    e = c.expect(3, lambda: calls.append("x"))
    assert calls == ["x"] and e.fired and c.value == 0
    assert e.cancel() is False


def test_expect_cancel_before_firing() -> None:
    table, c = make()
    calls: list[str] = []
    e = c.expect(2, lambda: calls.append("x"))
    table.add(IMM)
    assert e.cancel() is True
    assert e.cancel() is False  # only once
    table.add(IMM, 5)
    assert calls == []
    assert c.value == 6  # nothing consumed
    assert queued(table) == 0


def test_cancelled_head_expectation_unblocks_the_next() -> None:
    table, c = make()
    calls: list[str] = []
    big = c.expect(10, lambda: calls.append("big"))
    c.expect(2, lambda: calls.append("small"))
    table.add(IMM, 3)
    assert calls == []
    assert big.cancel() is True
    assert calls == ["small"] and c.value == 1


def test_expect_on_dispatcher_thread() -> None:
    dispatcher = CallbackDispatcher("test-counters")
    try:
        table = CounterTable(dispatcher)
        c = table.counter(IMM, LONG)
        seen: list[str] = []
        done = threading.Event()

        def callback() -> None:
            seen.append(threading.current_thread().name)
            done.set()

        c.expect(1, callback)
        table.add(IMM)
        assert done.wait(LONG)
        assert seen == ["test-counters"]
    finally:
        dispatcher.close(LONG)


# --------------------------------------------------------------------------- failures


def test_fail_peer_fails_only_waiters_naming_it() -> None:
    table, c = make()
    on_a = Waiter(c, 1, peer=PEER_A)
    settle(lambda: queued(table) == 1)
    on_b = Waiter(c, 1, peer=PEER_B)
    anonymous = Waiter(c, 1)
    settle(lambda: queued(table) == 3)
    errors: list[BaseException] = []
    callbacks: list[str] = []
    c.expect(1, lambda: callbacks.append("a"), on_error=errors.append, peer=PEER_A)
    other = table.counter(IMM + 1, LONG)
    on_a_other_imm = Waiter(other, 1, peer=PEER_A)
    settle(lambda: queued(table, IMM + 1) == 1)

    exc = PeerUnreachable("peer aa is gone", peer="aa")
    table.fail_peer(PEER_A.raw, exc)
    on_a.join()
    on_a_other_imm.join()
    assert on_a.error is exc and on_a_other_imm.error is exc
    assert errors == [exc] and callbacks == []
    assert not on_b.done.wait(0.05) and not anonymous.done.is_set()
    assert queued(table) == 2

    table.add(IMM, 2)
    on_b.join()
    anonymous.join()
    assert on_b.error is None and anonymous.error is None
    assert c.value == 0


def test_fail_peer_without_on_error_is_silent() -> None:
    table, c = make()
    calls: list[str] = []
    e = c.expect(1, lambda: calls.append("x"), peer=PEER_A)
    table.fail_peer(PEER_A.raw, PeerUnreachable("gone"))
    assert e.fired and e.cancel() is False
    table.add(IMM)
    assert calls == [] and c.value == 1


def test_fail_all() -> None:
    table, c = make()
    waiters = [Waiter(c, 1, peer=PEER_A), Waiter(c, 2), Waiter(table.counter(7, LONG), 1)]
    settle(lambda: queued(table) == 2 and queued(table, 7) == 1)
    errors: list[BaseException] = []
    c.expect(1, lambda: None, on_error=errors.append)
    exc = EngineClosed("closed")
    table.fail_all(exc)
    for w in waiters:
        w.join()
        assert w.error is exc
    assert errors == [exc]
    table.add(IMM, 3)
    assert c.value == 3  # nobody consumed anything


# --------------------------------------------------------------------------- async


def test_wait_async_success() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(2, timeout=LONG))
        await asyncio.sleep(0.01)
        assert not task.done()
        threading.Thread(target=table.add, args=(IMM, 3)).start()
        await asyncio.wait_for(task, LONG)

    asyncio.run(main())
    assert c.value == 1


def test_wait_async_immediate() -> None:
    table, c = make()
    table.add(IMM, 2)
    asyncio.run(asyncio.wait_for(c.wait_async(2, timeout=0), LONG))
    assert c.value == 0


def test_wait_async_timeout_consumes_nothing() -> None:
    table, c = make()
    table.add(IMM)

    async def main() -> None:
        with pytest.raises(TransferTimeout) as info:
            await asyncio.wait_for(c.wait_async(3, timeout=0.05), LONG)
        assert info.value.expected == {IMM: 3} and info.value.received == {IMM: 1}

    asyncio.run(main())
    assert c.value == 1 and queued(table) == 0
    table.add(IMM, 2)
    assert c.value == 3


def test_wait_async_peer_failure() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(1, timeout=LONG, peer=PEER_A))
        await asyncio.sleep(0.01)
        table.fail_peer(PEER_A.raw, PeerUnreachable("gone"))
        with pytest.raises(PeerUnreachable, match="gone"):
            await asyncio.wait_for(task, LONG)

    asyncio.run(main())


def test_cancelled_wait_async_loses_no_counts() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(2, timeout=LONG))
        await asyncio.sleep(0.01)
        assert queued(table) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queued(table) == 0

    asyncio.run(main())
    table.add(IMM, 2)
    assert c.value == 2  # the cancelled waiter took nothing


def test_wait_async_cancelled_as_it_fires_gives_counts_back() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(2, timeout=LONG))
        await asyncio.sleep(0.01)
        table.add(IMM, 3)  # settles the waiter (consumes 2) ...
        task.cancel()  # ... but the task is cancelled before it sees the result
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert c.value == 3
    assert table.imms_received == 3


def test_wait_async_cancelled_after_fail_all_invents_no_counts() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(2, timeout=LONG))
        await asyncio.sleep(0.01)
        table.fail_all(EngineClosed("closed"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert c.value == 0 and table.imms_received == 0


def test_wait_async_cancelled_after_fail_peer_invents_no_counts() -> None:
    table, c = make()

    async def main() -> None:
        task = asyncio.ensure_future(c.wait_async(2, timeout=LONG, peer=PEER_A))
        await asyncio.sleep(0.01)
        table.fail_peer(PEER_A.raw, PeerUnreachable("gone"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert c.value == 0  # actual: 2 phantom counts


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("imm", [-1, 1 << 32, "7", 7.0, True, None])
def test_imm_range(imm: object) -> None:
    table = CounterTable()
    with pytest.raises(ConfigError, match="imm"):
        table.counter(imm, LONG)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="imm"):
        check_imm(imm)


def test_imm_bounds_accepted() -> None:
    table = CounterTable()
    assert table.counter(0, LONG).imm == 0
    assert table.counter((1 << 32) - 1, LONG).imm == 0xFFFFFFFF
    assert check_imm(5, "x") == 5
    with pytest.raises(ConfigError, match=r"^x 4294967296 is out of range: imms are 32-bit, \[0, 2\*\*32\)$"):
        check_imm(1 << 32, "x")
    with pytest.raises(ConfigError, match=r"^x must be an int in \[0, 2\*\*32\), got str$"):
        check_imm("1", "x")


@pytest.mark.parametrize("n", [0, -1, True, 1.0, "1", None])
def test_n_below_one_rejected(n: object) -> None:
    table, c = make()
    table.add(IMM, 5)
    with pytest.raises(ConfigError, match="count to wait for must be a positive int"):
        c.wait(n, timeout=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="count to wait for must be a positive int"):
        c.expect(n, lambda: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="count to wait for must be a positive int"):
        asyncio.run(c.wait_async(n, timeout=0))  # type: ignore[arg-type]
    assert c.value == 5 and queued(table) == 0


def test_waits_naming_a_lost_peer_fail_at_once_until_revived() -> None:
    table = CounterTable()
    peer = DomainAddress(raw=b"\x07" * 4)
    lost = PeerUnreachable("peer gone")
    table.fail_peer(peer.raw, lost)
    counter = table.counter(5, default_timeout=10.0)
    started = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        counter.wait(1, peer=peer)
    assert info.value is lost and time.monotonic() - started < 1.0
    with pytest.raises(PeerUnreachable):
        counter.expect(1, lambda: None, peer=peer)
    table.add(5)
    counter.wait(1, timeout=1.0)  # waits naming no peer are unaffected
    table.revive_peer(peer.raw)
    table.add(5)
    counter.wait(1, timeout=1.0, peer=peer)
    assert counter.value == 0


def test_wait_latency_folds_every_sample_exactly_once_from_many_threads() -> None:
    """``WaitLatency.record`` only appends (no lock); folding into the histogram happens every
    ``_FOLD_AT`` samples and on ``snapshot``: whatever the interleaving, every sample is
    counted once, in its bucket, and the pending samples stay bounded."""
    from fabric_core.stats import WAIT_BUCKETS_S, WaitLatency

    lat = WaitLatency()
    per_thread, threads = 3 * WaitLatency._FOLD_AT + 17, 4
    values = [WAIT_BUCKETS_S[i % len(WAIT_BUCKETS_S)] for i in range(per_thread)]

    def run() -> None:
        for i, v in enumerate(values):
            lat.record(v, i % 5 != 0)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert len(lat._samples) < WaitLatency._FOLD_AT + threads  # bounded while nobody reads
    w = lat.snapshot()
    ok = [v for i, v in enumerate(values) if i % 5 != 0]
    assert w.failed == threads * (per_thread - len(ok))
    assert w.satisfied == threads * len(ok) == sum(w.buckets)
    expected = [0] * (len(WAIT_BUCKETS_S) + 1)
    for v in ok:
        expected[WAIT_BUCKETS_S.index(v)] += threads  # a bound belongs to its own bucket
    assert list(w.buckets) == expected
    assert w.total_s == pytest.approx(threads * sum(ok))
    assert lat.snapshot() == w  # nothing left to fold


def test_wait_latency_adds_tallies_kept_elsewhere_and_refuses_other_buckets() -> None:
    # (a native table tallies the waits it settles in C++: fabric/counters.hpp WaitTally)
    from fabric_core.stats import WAIT_BUCKETS_S, WaitLatency

    waits = WaitLatency()
    waits.record(2e-5, True)
    waits.record(1.0, False)
    kept = [0] * (len(WAIT_BUCKETS_S) + 1)
    kept[0] = 3
    waits.add_source(lambda: (3, 1.5e-5, kept))
    with pytest.raises(ValueError, match="buckets"):
        waits.add_source(lambda: (0, 0.0, [0, 0]))
    w = waits.snapshot()
    assert (w.satisfied, w.failed) == (4, 1)
    assert w.total_s == pytest.approx(3.5e-5)
    assert w.buckets[0] == 3 and w.buckets[1] == 1 and sum(w.buckets) == 4
