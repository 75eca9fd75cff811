"""Eager writes on tcp;ofi_rxm: a lone small write goes as a control frame to the target's
engine, which checks the key, copies the bytes into the region, counts the imm and
acknowledges it; the write completes on that acknowledgement (fabric/engine.hpp,
Engine::post_eager; docs/backends/efa.md, "Eager writes on tcp").

These tests check that the path is taken exactly where it should be (counted by the engines'
own stats), that every byte and imm lands and is in place when the writer sees the transfer
complete, that a refusal comes back as the same RemoteAccessError an access check gives and
changes nothing, and that a write whose acknowledgement never comes fails within a bound.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from fabric_core.errors import PeerUnreachable, RemoteAccessError
from fabric_core.testing.conformance import _forged
from fabric_core.testing.remote import RemoteEngine, WorkerPool, stop_process
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")

EngineFactory = Callable[..., EfaEngine]
T = 20.0
TCP = "tcp;ofi_rxm"
EAGER_MAX = 4096  # the default of efa_eager_max


def _eager(e: EfaEngine) -> tuple[int, int]:
    """(writes this engine sent as eager frames, eager writes it applied as a target)"""
    s = e._core.stats()
    return int(s["eager_writes"]), int(s["eager_landed"])


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(workers=2, arena_bytes=1 << 22) as p:
        yield p


def test_eager_writes_are_on_for_tcp_alone_and_turn_off(efa_engine: EngineFactory) -> None:
    with efa_engine() as on, efa_engine(efa_eager_max=0) as off, efa_engine(efa_eager_max=100) as small:
        assert on.provider_info["eager_max"] == EAGER_MAX
        assert on.domains[0].details["eager_max"] == EAGER_MAX  # (fabric info shows it)
        assert off.provider_info["eager_max"] == 0
        assert small.provider_info["eager_max"] == 100
    with efa_engine("shm") as shm:  # shm's writes need no acknowledgement of the provider's
        assert shm.provider_info["eager_max"] == 0


@pytest.mark.parametrize("chaos", [None, 5])
def test_lone_small_writes_go_eager_and_land_exactly_in_place_when_they_complete(
    chaos: int | None, efa_engine: EngineFactory
) -> None:
    with efa_engine(chaos_seed=chaos) as writer, efa_engine(chaos_seed=chaos) as target:
        src = np.random.default_rng(1).integers(1, 256, 3 * EAGER_MAX, dtype=np.uint8)
        dst = np.zeros(4 * EAGER_MAX, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        counter = target.counter(77)
        sent = landed = 0
        at = 0
        for size in (1, 8, 1000, EAGER_MAX - 1, EAGER_MAX):
            writer.submit_write(src_mr, 3, size, dst_mr.descriptor, at, imm=77).wait(T)
            # in place when the writer saw it complete, and nothing around it touched
            assert np.array_equal(dst[at : at + size], src[3 : 3 + size]), size
            sent, landed = sent + 1, landed + 1
            assert (_eager(writer)[0], _eager(target)[1]) == (sent, landed), size
            counter.wait(1, timeout=T)  # (consumes it)
            at += size
        assert not dst[at:].any()
        assert counter.value == 0
        # through the provider, not as frames: larger, paged (several writes), imm alone
        dst[:] = 0
        writer.submit_write(src_mr, 0, EAGER_MAX + 1, dst_mr.descriptor, 0, imm=77).wait(T)
        pages = np.arange(4, dtype=np.int64)
        writer.submit_paged_write(src_mr, pages, 64, dst_mr.descriptor, pages, 64, 64, imm=77).wait(T)
        writer.submit_imm(dst_mr.descriptor, 77).wait(T)
        counter.wait(3, timeout=T)
        assert np.array_equal(dst[: EAGER_MAX + 1], src[: EAGER_MAX + 1])
        assert (_eager(writer)[0], _eager(target)[1]) == (sent, landed)
        writer.deregister(src_mr)
        target.deregister(dst_mr)


def test_with_eager_writes_off_a_lone_small_write_goes_through_the_provider(
    efa_engine: EngineFactory,
) -> None:
    with efa_engine(efa_eager_max=0) as writer, efa_engine() as target:
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        writer.submit_write(src_mr, 0, 64, dst_mr.descriptor, 0, imm=1).wait(T)
        target.counter(1).wait(1, timeout=T)
        assert np.array_equal(dst, src)
        assert (_eager(writer)[0], _eager(target)[1]) == (0, 0)


def test_a_refused_eager_write_is_a_remote_access_error_that_changes_nothing(
    efa_engine: EngineFactory,
) -> None:
    """The target refuses in its acknowledgement, worded as an access check words it (the key
    it never had or no longer has, a range past the region, a region without remote write);
    nothing lands, no imm is counted, and the next write goes on as before."""
    with efa_engine() as writer, efa_engine() as target:
        src = np.full(256, 7, dtype=np.uint8)
        dst = np.zeros(256, dtype=np.uint8)
        ro = np.zeros(256, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        ro_mr = target.register(ro, writable=False)
        gone = target.register(np.zeros(256, dtype=np.uint8))
        gone_desc = gone.descriptor
        target.deregister(gone)
        counter = target.counter(9)
        cases = [
            (gone_desc, 0, 16, "no region under that key"),
            # (a descriptor that claims more: the writer's own range check passes)
            (_forged(dst_mr.descriptor, length=512), 250, 16, "outside its region"),
            (_forged(ro_mr.descriptor, writable=True), 0, 16, "without remote write"),
        ]
        for i, (desc, off, size, words) in enumerate(cases, 1):
            t = writer.submit_write(src_mr, 0, size, desc, off, imm=9)
            with pytest.raises(RemoteAccessError, match=words):
                t.wait(T)
            assert _eager(writer)[0] == i  # it went as a frame, and the target answered
        assert not dst.any() and not ro.any()
        assert _eager(target)[1] == 0
        writer.submit_write(src_mr, 0, 16, dst_mr.descriptor, 0, imm=9).wait(T)
        counter.wait(1, timeout=T)
        assert (writer.dump_state()["eager_waiting"], target.dump_state()["acks_due"]) == (0, 0)
        time.sleep(0.05)
        assert counter.value == 0  # the refused ones' imms never counted
        assert (dst[:16] == 7).all() and not dst[16:].any()


def test_an_eager_write_to_a_stopped_target_fails_within_its_wait_and_lands_once_it_resumes(
    pool: WorkerPool, efa_engine: EngineFactory
) -> None:
    """With liveness probes off, nothing but the eager write's own wait (the liveness
    timeout, at least 1 s) ends it: it fails as a write whose connection went, the target is
    asked whether it would have taken it, and, silent, it is unreachable. Once the target
    resumes it applies the frame all the same (a failed write's bytes may land) and the
    writer ignores the late acknowledgement."""
    config = {"backend": "efa", "efa_provider": TCP, "nics": 1, "timeout_s": T}
    target = RemoteEngine(pool, pool.workers[0], config)
    writer = efa_engine(liveness_interval_s=0, liveness_timeout_s=1.0)
    src, dst = pool.alloc(64), pool.alloc(64)
    try:
        src[:] = 5
        dst[:] = 0
        src_mr, dst_mr = writer.register(src), target.register(dst)
        writer.submit_write(src_mr, 0, 8, dst_mr.descriptor, 0).wait(T)  # connected, and eager
        assert _eager(writer)[0] == 1
        stop_process(target.pid)
        try:
            started = time.monotonic()
            t = writer.submit_write(src_mr, 0, 16, dst_mr.descriptor, 16, imm=3)
            time.sleep(0.2)
            assert writer.dump_state()["eager_waiting"] == 1  # (a hang's dump says what waits)
            with pytest.raises(PeerUnreachable):
                t.wait(10.0)
            took = time.monotonic() - started
            assert 0.9 < took < 8.0, took
            assert writer.dump_state()["eager_waiting"] == 0
            assert not dst[16:32].any()
        finally:
            os.kill(target.pid, signal.SIGCONT)
        deadline = time.monotonic() + T
        while not (dst[16:32] == 5).all():  # the frame was in its socket: it lands now
            assert time.monotonic() < deadline, "the stopped target never applied the frame"
            time.sleep(0.01)
        writer.submit_write(src_mr, 0, 8, dst_mr.descriptor, 40).wait(T)
        assert (dst[40:48] == 5).all()
        writer.deregister(src_mr)
        target.deregister(dst_mr)
    finally:
        target.close()
        writer.close()


def test_a_target_with_a_smaller_max_send_size_still_takes_the_largest_eager_writes(
    efa_engine: EngineFactory,
) -> None:
    """Every engine's receive buffers hold the largest eager frame (kFrameFloor), whatever its
    max_send_size: before, a target set below its writer truncated each such frame, nothing
    answered it, and the write waited out its acknowledgement."""
    with efa_engine(efa_eager_max=16384) as writer, efa_engine(max_send_size=64) as target:
        assert writer.provider_info["eager_max"] == 16384
        src = np.random.default_rng(3).integers(1, 256, 16384, dtype=np.uint8)
        dst = np.zeros(16384 + 64, dtype=np.uint8)
        src_mr, dst_mr = writer.register(src), target.register(dst)
        # (a frame nobody answers fails once its wait runs out: done means acknowledged)
        writer.submit_write(src_mr, 0, 16384, dst_mr.descriptor, 32, imm=9).wait(T)
        assert np.array_equal(dst[32 : 32 + 16384], src)
        assert not dst[:32].any() and not dst[32 + 16384 :].any()
        assert target.counter(9).value == 1
        assert (_eager(writer)[0], _eager(target)[1]) == (1, 1)
        assert target._core.stats()["frames_truncated"] == 0
        writer.deregister(src_mr)
        target.deregister(dst_mr)
