"""The C++ counter table (fabric/counters.hpp) behind fabric_core's NativeCounterTable.

The Python ``CounterTable`` is the reference: random sequences of operations run on both and
must fire the same waiters with the same outcomes and leave the same counts. Then what only
the native table does: blocking waits woken by another thread, timeouts that unblock waiters
behind them, Ctrl-C in a wait, and waits on a live engine's worker.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric_core import open_engine
from fabric_core.counters import CounterTable, Expectation, NativeCounterTable
from fabric_core.errors import ConfigError, EngineClosed, PeerUnreachable, TransferTimeout
from fabric_core.models import DomainAddress
from fabric_core.stats import WAIT_BUCKETS_S
from fabric_efa import _efa

PEERS = [DomainAddress(raw=b"peer-a"), DomainAddress(raw=b"peer-b")]
IMMS = [0, 7, 2**32 - 1]


def _native() -> NativeCounterTable:
    return NativeCounterTable(_efa.CounterTable())


_op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(IMMS), st.integers(1, 5)),
    st.tuples(st.just("expect"), st.sampled_from(IMMS), st.integers(1, 6), st.sampled_from([None, 0, 1])),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("fail_peer"), st.integers(0, 1)),
    st.tuples(st.just("revive_peer"), st.integers(0, 1)),
    # GPU-side waits' mirrors (fabric_core.device_counter): words of host memory here
    st.tuples(
        st.just("attach"),
        st.sampled_from(IMMS),
        st.sampled_from([None, 0, 1]),
        st.sampled_from([0, 2**32 - 3]),
    ),
    st.tuples(st.just("reserve"), st.sampled_from(IMMS), st.integers(0, 4)),
    st.tuples(st.just("detach"), st.sampled_from(IMMS)),
    st.tuples(st.just("refund"), st.sampled_from(IMMS), st.integers(1, 3)),
    # wait_counts with no time to wait: all taken, or nothing (a timeout or a lost peer)
    st.tuples(
        st.just("wait_all"),
        st.lists(
            st.tuples(st.sampled_from(IMMS), st.integers(1, 4), st.sampled_from([None, 0, 1])), max_size=3
        ),
    ),
)


def _run(table: CounterTable, ops: list[tuple[Any, ...]]) -> list[Any]:
    """Apply ``ops``; return what was observed after each (fired waiters, errors, counts)."""
    log: list[Any] = []
    handles: list[Expectation] = []
    fired: list[tuple[int, str]] = []
    words = np.zeros(len(IMMS), dtype=np.uint32)  # one mirror word per imm (reused after detach)
    for op in ops:
        kind = op[0]
        fired.clear()
        outcome: Any = None
        if kind == "add":
            table.add(op[1], op[2])
        elif kind == "expect":
            _, imm, n, peer = op
            k = len(handles)
            try:
                handles.append(
                    table.counter(imm, 5.0).expect(
                        n,
                        lambda k=k: fired.append((k, "ok")),
                        on_error=lambda e, k=k: fired.append((k, type(e).__name__)),
                        peer=None if peer is None else PEERS[peer],
                    )
                )
            except PeerUnreachable:
                outcome = "refused"
        elif kind == "cancel":
            if handles:
                outcome = handles[op[1] % len(handles)].cancel()
        elif kind == "attach":
            _, imm, peer, start = op
            w = IMMS.index(imm)
            if not table.mirror_state(imm)[1] and words[w] == 0:
                words[w] = start
            try:
                table.attach_mirror(
                    imm, int(words.ctypes.data) + 4 * w, None if peer is None else PEERS[peer].raw
                )
            except (ConfigError, PeerUnreachable) as exc:
                outcome = type(exc).__name__
        elif kind == "reserve":
            try:
                outcome = table.reserve(op[1], op[2])
            except (ConfigError, PeerUnreachable, EngineClosed) as exc:
                outcome = type(exc).__name__
        elif kind == "detach":
            outcome = table.fail_mirror(op[1], EngineClosed("detached"), detach=True)
        elif kind == "refund":
            table._refund(op[1], op[2])
        elif kind == "wait_all":
            wants = [(imm, n, None if peer is None else PEERS[peer].raw) for imm, n, peer in op[1]]
            try:
                table.wait_all(wants, 0.0)
                outcome = "ok"
            except TransferTimeout as exc:
                outcome = ("timeout", exc.expected, exc.received, exc.peer)
            except PeerUnreachable as exc:
                outcome = ("lost", exc.peer)
        elif kind == "fail_peer":
            peer = PEERS[op[1]].raw
            table.fail_peer(peer, PeerUnreachable("gone", peer=peer.hex()))
        else:
            table.revive_peer(PEERS[op[1]].raw)
        log.append(
            (
                kind,
                outcome,
                sorted(fired),
                table.snapshot(),
                [table.value(i) for i in IMMS],
                words.tolist(),
                [table.mirror_state(i) for i in IMMS],
            )
        )
    table.fail_all(EngineClosed("closing"))
    log.append(("received", table.imms_received, words.tolist()))
    return log


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_op, max_size=40))
def test_native_table_matches_the_reference_table(ops: list[tuple[Any, ...]]) -> None:
    assert _run(_native(), ops) == _run(CounterTable(), ops)


def _soon(fn: Any, delay: float = 0.05) -> threading.Timer:
    t = threading.Timer(delay, fn)
    t.start()
    return t


def test_a_blocking_wait_is_woken_by_another_thread_and_keeps_its_place_in_line() -> None:
    table = _native()
    seen: list[str] = []
    table.counter(7, 5.0).expect(3, lambda: seen.append("expect"))  # first in line
    _soon(lambda: table.add(7, 4))
    table.counter(7, 5.0).wait(1)  # second: gets the fourth count
    assert seen == ["expect"] and table.value(7) == 0 and table.imms_received == 4


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1", None])
def test_a_wait_for_a_bad_count_raises_and_takes_nothing(bad: Any) -> None:
    table = _native()
    table.add(7, 2)
    with pytest.raises(ConfigError, match="count to wait for"):
        table.counter(7, 5.0).wait(bad)
    assert table.value(7) == 2 and table.waits.snapshot().failed == 0


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), "1", True])
def test_a_wait_with_a_bad_timeout_raises_and_takes_nothing(bad: Any) -> None:
    table = _native()
    table.add(7, 2)
    with pytest.raises(ConfigError, match="timeout"):
        table.counter(7, 5.0).wait(1, timeout=bad)
    assert table.value(7) == 2 and table.waits.snapshot().failed == 0


@pytest.mark.parametrize("timeout", [None, 0, 0.0, 1, 2.5, math.inf])
def test_a_satisfied_wait_takes_its_count_whatever_the_timeout_form(timeout: Any) -> None:
    table = _native()
    table.add(7, 3)
    table.counter(7, 5.0).wait(2, timeout=timeout)
    assert table.value(7) == 1
    w = table.waits.snapshot()
    assert w.satisfied == 1 and w.failed == 0 and sum(w.buckets) == 1


def test_waits_satisfied_in_cpp_are_tallied_there_and_in_the_engine_stats() -> None:
    # A satisfied wait ends in C++ with no Python after it: the table tallies it (WaitTally),
    # and WaitLatency adds that tally to the waits that went through Python (a timeout here).
    table = _native()
    table.add(7, 5)
    counter = table.counter(7, 5.0)
    for _ in range(5):
        counter.wait(1)
    satisfied, total_s, buckets = table._native.wait_stats()
    assert satisfied == 5 and sum(buckets) == 5 and len(buckets) == len(WAIT_BUCKETS_S) + 1
    assert 0 < total_s < 5.0
    with pytest.raises(TransferTimeout):
        counter.wait(1, timeout=0.0)
    w = table.waits.snapshot()
    assert (w.satisfied, w.failed, sum(w.buckets)) == (5, 1, 5)
    assert w.total_s == pytest.approx(total_s)
    # a wait woken by another thread lands in a bucket by the time it blocked
    _soon(lambda: table.add(7, 1), 0.05)
    counter.wait(1)
    after = table.waits.snapshot()
    assert after.satisfied == 6 and sum(after.buckets[bisect.bisect_left(WAIT_BUCKETS_S, 0.04) :]) == 1


def test_the_native_wait_checks_its_arguments_and_takes_nothing_on_refusal() -> None:
    native = _efa.CounterTable()
    native.add(7, 2, True)
    for args, match in [
        ((7, 1, b""), "takes 4 positional arguments"),
        ((7, 1, "peer", 1.0), "peer must be bytes"),
        ((-7, 1, b"", 1.0), "Unable to cast"),
        ((7, 1, b"", "1.0"), "must be real number"),
    ]:
        with pytest.raises(TypeError, match=match):
            native.wait(*args)
    assert native.value(7) == 2
    assert native.wait(7, 1, b"", 0.0) is None and native.value(7) == 1
    code, seen, fired, exc, took = native.wait(7, 2, b"", 0.0)
    assert (code, seen, fired, exc) == (2, 1, [], None) and took >= 0 and native.value(7) == 1


def test_a_timeout_of_centuries_waits_like_no_timeout() -> None:
    # (a deadline that far out is no deadline: no steady-clock arithmetic overflows for it)
    table = _native()
    _soon(lambda: table.add(7, 1))
    table.counter(7, 5.0).wait(1, timeout=1e300)
    _soon(lambda: table.add(8, 2))
    table.wait_all([(8, 2, None)], 1e300)
    assert table.value(7) == 0 and table.value(8) == 0


def test_the_wait_buckets_are_set_once_and_bad_bounds_change_nothing() -> None:
    native = _efa.CounterTable()
    for bad in ([], [1e-3, 1e-4], [1e-6] * 33):
        with pytest.raises(ValueError, match="ascending"):
            native.configure_wait_buckets(bad)
    native.configure_wait_buckets([1e-5, 1e-3])
    native.configure_wait_buckets([1e-5, 1e-3])  # the same again: fine
    with pytest.raises(ValueError, match="already set"):
        native.configure_wait_buckets([1e-5, 1e-2])
    native.add(7, 1, True)
    assert native.wait(7, 1, b"", 1.0) is None
    assert native.wait_stats()[0] == 1 and len(native.wait_stats()[2]) == 3


def test_an_int_timeout_times_out_like_a_float_one() -> None:
    table = _native()
    with pytest.raises(TransferTimeout) as err:
        table.counter(7, 5.0).wait(3, timeout=0)
    assert err.value.expected == {7: 3} and err.value.received == {7: 0}
    assert table.waits.snapshot().failed == 1


def test_a_timed_out_head_unblocks_the_smaller_waiter_behind_it() -> None:
    table = _native()
    table.add(7, 2)
    seen: list[str] = []
    box: list[BaseException] = []

    def head() -> None:
        try:
            table.counter(7, 5.0).wait(5, timeout=0.3)
        except TransferTimeout as exc:
            box.append(exc)

    t = threading.Thread(target=head)
    t.start()
    time.sleep(0.1)  # the head is queued
    table.counter(7, 5.0).expect(1, lambda: seen.append("behind"))
    assert seen == []
    t.join(5)
    assert isinstance(box[0], TransferTimeout)
    assert box[0].expected == {7: 5} and box[0].received == {7: 2}
    assert seen == ["behind"] and table.value(7) == 1


def test_a_wait_naming_a_lost_peer_fails_then_and_later() -> None:
    table = _native()
    peer = PEERS[0]
    _soon(lambda: table.fail_peer(peer.raw, PeerUnreachable("it died", peer=peer.raw.hex())))
    with pytest.raises(PeerUnreachable, match="it died"):
        table.counter(1, 5.0).wait(1, peer=peer)
    with pytest.raises(PeerUnreachable, match="it died"):
        table.counter(1, 5.0).wait(1, timeout=math.inf, peer=peer)
    table.revive_peer(peer.raw)
    table.add(1)
    table.counter(1, 5.0).wait(1, peer=peer)


def test_fail_all_fails_blocking_and_token_waiters_with_the_engine_error() -> None:
    table = _native()
    errors: list[BaseException] = []
    table.counter(3, 5.0).expect(1, lambda: None, on_error=errors.append)
    _soon(lambda: table.fail_all(EngineClosed("closing")))
    with pytest.raises(EngineClosed, match="closing"):
        table.counter(3, 5.0).wait(1, timeout=math.inf)
    assert [type(e) for e in errors] == [EngineClosed]


def test_ctrl_c_in_a_wait_raises_consumes_nothing_and_lets_the_next_waiter_run() -> None:
    table = _native()
    table.add(9, 1)
    behind: list[str] = []

    def queue_behind_then_interrupt() -> None:
        # only once wait(2) is queued, so the interrupt lands in the wait itself
        deadline = time.monotonic() + 10.0
        while not table.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        table.counter(9, 5.0).expect(1, lambda: behind.append("ran"))  # queued behind wait(2)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's Ctrl-C handler, whatever the runner was started with: a background job
    # inherits SIGINT ignored, and the wait then never sees the interrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = _soon(queue_behind_then_interrupt, 0.05)
    # a lost interrupt must fail the test, not hang it: after 15 s, satisfy the wait
    watchdog = _soon(lambda: table.add(9, 5), 15.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            table.counter(9, 5.0).wait(2, timeout=math.inf)
    finally:
        watchdog.cancel()
        interrupter.join(10.0)
        signal.signal(signal.SIGINT, previous)
    assert behind == ["ran"] and table.value(9) == 0


def test_a_joint_wait_is_woken_by_other_threads_and_takes_its_counts_together() -> None:
    table = _native()
    table.add(7, 1)
    _soon(lambda: table.add(0, 2), 0.05)
    _soon(lambda: table.add(7, 1), 0.1)
    started = time.monotonic()
    table.wait_all([(7, 2, None), (0, 2, PEERS[0].raw)], 5.0)
    assert time.monotonic() - started < 4.0
    assert table.value(7) == 0 and table.value(0) == 0


def test_a_peer_lost_under_a_joint_wait_fails_it_and_gives_back_what_it_took() -> None:
    table = _native()
    table.add(7, 3)
    peer = PEERS[1]
    _soon(lambda: table.fail_peer(peer.raw, PeerUnreachable("it died", peer=peer.raw.hex())))
    started = time.monotonic()
    with pytest.raises(PeerUnreachable, match="it died"):
        table.wait_all([(7, 2, None), (0, 1, peer.raw)], math.inf)
    assert time.monotonic() - started < 4.0
    assert table.value(7) == 3  # the entry that was satisfied gave its counts back
    behind: list[str] = []
    table.counter(7, 5.0).expect(3, lambda: behind.append("ran"))
    assert behind == ["ran"] and table.value(7) == 0


def test_ctrl_c_in_a_joint_wait_raises_and_consumes_nothing() -> None:
    table = _native()
    table.add(9, 2)

    def interrupt_once_queued() -> None:
        deadline = time.monotonic() + 10.0
        while not table.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = _soon(interrupt_once_queued, 0.05)
    watchdog = _soon(lambda: table.add(3, 1), 15.0)  # a lost interrupt fails the test, no hang
    try:
        with pytest.raises(KeyboardInterrupt):
            table.wait_all([(9, 2, None), (3, 1, None)], math.inf)
    finally:
        watchdog.cancel()
        interrupter.join(10.0)
        signal.signal(signal.SIGINT, previous)
    assert table.value(9) == 2 and table.value(3) == 0 and not table.pending()


def test_a_cancelled_async_wait_consumes_nothing() -> None:
    table = _native()

    async def main() -> None:
        task = asyncio.ensure_future(table.counter(4, 5.0).wait_async(2))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        table.add(4, 2)
        await table.counter(4, 5.0).wait_async(2)

    asyncio.run(main())
    assert table.value(4) == 0


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_the_worker_counts_into_the_table_a_blocked_wait_sleeps_on(provider: str) -> None:
    """A wait that outlasts its spin sleeps on the table's condition variable; the worker's
    count must wake it (here the imms come 0.3 s after the wait started)."""
    a = open_engine(backend="efa", efa_provider=provider)
    b = open_engine(backend="efa", efa_provider=provider)
    try:
        import numpy as np

        dst = b.register(np.zeros(4096, np.uint8))
        timer = _soon(lambda: [a.submit_imm(dst.descriptor, 5) for _ in range(3)], 0.3)
        b.counter(5).wait(3, timeout=20)
        timer.join()
        assert b.counter(5).value == 0 and b.stats().imms_received == 3
    finally:
        a.close()
        b.close()
