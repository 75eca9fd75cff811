"""The multi-process harness (``fabric_core.testing.remote``).

The whole conformance suite runs through ``RemoteEngine`` proxies on the simulator (all
engines in one worker process, since simulated engines reach each other only within a
process), which proves the proxy layer keeps every statement of the contract: exact bytes
through the shared arena, exact counts, typed errors, callbacks, ``expect``, async waits.
The efa backend runs the same suite with every engine in its own process.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from fabric_core.errors import (
    BackendUnavailable,
    ConfigError,
    EngineClosed,
    PeerUnreachable,
    TransferTimeout,
)
from fabric_core.testing import TransferEngineConformance
from fabric_core.testing.remote import RemoteEngine, RemoteHarness, WorkerDied, WorkerPool

T = 10.0


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(workers=2, arena_bytes=1 << 26) as p:
        yield p


def _harness(pool: WorkerPool, seed: int = 0) -> RemoteHarness:
    return RemoteHarness(
        pool, {"backend": "sim", "sim_seed": seed, "timeout_s": 20}, max_nics=4, spread=False
    )


@pytest.fixture
def fabric_harness(pool: WorkerPool, fabric_seed: int) -> Iterator[RemoteHarness]:
    harness = _harness(pool, fabric_seed)
    yield harness
    harness.close()


@pytest.mark.fabric_seeds(1)
class TestRemoteSimConformance(TransferEngineConformance):
    pass


def test_errors_cross_processes_with_their_fields() -> None:
    for exc in (
        BackendUnavailable("efa", "no libfabric"),
        TransferTimeout("late", expected={3: 2}, received={3: 1}, peer="ab", nic=1, transfer_id=9),
        PeerUnreachable("gone", peer="cd", nic=0, transfer_id=4),
        ConfigError("bad"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.__dict__ == exc.__dict__


def test_arena_allocations_are_zeroed_aligned_and_bounded(pool: WorkerPool) -> None:
    a = pool.alloc(10)
    a[:] = 7
    b = pool.alloc(5000)
    assert b.ctypes.data % 4096 == 0 and (b == 0).all()
    assert b.ctypes.data - a.ctypes.data == 4096
    assert pool.offset_of(int(b.ctypes.data), 5000) == b.ctypes.data - pool.base
    assert pool.offset_of(int(b.ctypes.data), pool.size) is None
    assert pool.offset_of(pool.base - 1, 1) is None
    with pytest.raises(ConfigError, match="full"):
        pool.alloc(pool.size)
    with pytest.raises(ConfigError):
        pool.alloc(-1)
    pool.reset()
    again = pool.alloc(10)
    assert again.ctypes.data == a.ctypes.data and (again == 0).all()
    pool.reset()


def test_pool_needs_two_workers() -> None:
    with pytest.raises(ConfigError, match="two"):
        WorkerPool(workers=1)


def test_spread_puts_engines_in_different_processes(pool: WorkerPool) -> None:
    h = RemoteHarness(pool, {"backend": "sim"})
    try:
        a, b, c = h.open_engine(1), h.open_engine(1), h.open_engine(1)
        assert isinstance(a, RemoteEngine) and isinstance(b, RemoteEngine) and isinstance(c, RemoteEngine)
        assert a.pid != b.pid and a.pid == c.pid != os.getpid()
        assert "RemoteEngine" in repr(a)
    finally:
        h.close()


def test_memory_outside_the_arena_is_refused_and_bytes_are_copied(pool: WorkerPool) -> None:
    h = _harness(pool)
    try:
        e = h.open_engine(1)
        with pytest.raises(ConfigError, match="arena"):
            e.register(np.zeros(64, np.uint8))
        mr = e.register(b"immutable")
        assert mr.length == 9 and not mr.writable
        assert e.stats().registrations == 1
    finally:
        h.close()


def test_open_failure_is_raised_here(pool: WorkerPool) -> None:
    h = RemoteHarness(pool, {"backend": "no-such-backend"})
    with pytest.raises(ConfigError):
        h.open_engine(1)
    h.close()


def test_killed_worker_fails_calls_and_transfers_without_hanging() -> None:
    with WorkerPool(workers=2, arena_bytes=1 << 24) as pool:
        h = _harness(pool)
        a, b = h.open_engine(1), h.open_engine(1)
        assert isinstance(a, RemoteEngine)
        src, dst = h.alloc(4096), h.alloc(4096)
        smr, dmr = a.register(src), b.register(dst)
        t = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=1)
        t.wait(T)
        started = time.monotonic()
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied):
            b.counter(2).wait(1, timeout=T)  # a pending call fails when the worker dies
        assert time.monotonic() - started < T
        with pytest.raises(WorkerDied):
            a.submit_write(smr, 0, 8, dmr.descriptor, 0, imm=1)
        a.close()  # closing an engine whose process died does not raise
        assert a.closed
        with pytest.raises(EngineClosed):
            a.register(src)
        h.close()
