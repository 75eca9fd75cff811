"""NIC loss on efa, in cases the conformance suite cannot stage: they need a target process
stopped (SIGSTOP, tcp only: see test_conformance.py) and a NIC fault injected into the
writer's endpoint, so the writer lives in this process and the target in a worker.

A WriteImm whose transfer ended (cancelled, past its deadline) while it was in flight can
still land and be counted; when its acknowledgement is then lost with the NIC, the sender
must still account for it, or the count query that reconciles the path's other lost
WriteImms finds a count none of them explains and fails them all (found by the soak: about
one run in four on CI).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from fabric_core.errors import PeerUnreachable, TransferCancelled, TransportError
from fabric_core.ops import Pinned
from fabric_core.settings import load_settings
from fabric_core.testing.remote import RemoteEngine, WorkerPool, stop_process
from fabric_efa import EfaBackend
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")  # never the first interface: loopback only

PROVIDER = "tcp;ofi_rxm"
T = 20.0
PIECE = 40_000


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(workers=2, arena_bytes=1 << 23) as p:
        yield p


def _wait_for(pred: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_cancelled_writeimm_lost_with_its_nic_is_accounted_for(pool: WorkerPool, seed: int) -> None:
    settings = load_settings(backend="efa", efa_provider=PROVIDER, nics=2, timeout_s=T)
    probe = EfaBackend.probe(settings)
    if not probe.available:
        pytest.skip(probe.reason)
    writer = EfaEngine(settings)
    worker = pool.workers[seed % len(pool.workers)]
    config = {"backend": "efa", "efa_provider": PROVIDER, "nics": 2, "timeout_s": T}
    target = RemoteEngine(pool, worker, config)
    src, dst = pool.alloc(8 * PIECE), pool.alloc(8 * PIECE)
    src[:] = np.random.default_rng(seed).integers(0, 256, src.size, dtype=np.uint8)
    dst[:] = 0
    src_mr, dst_mr = writer.register(src), target.register(dst)
    desc = dst_mr.descriptor
    stopped = False
    try:
        # a first WriteImm and a fence: the session's hello is answered, so WriteImms use NIC 1
        writer.submit_imm(desc, 99).wait(T)
        target.counter(99).wait(1, timeout=T)
        writer.fence([desc], timeout=T)
        # and NIC 1's connection is up (a first write on it connects; not to a stopped target)
        t = writer.submit_write(src_mr, 0, PIECE, desc, 0, imm=98, routing=Pinned(1))
        t.wait(T)
        target.counter(98).wait(t.imms_at_target, timeout=T)
        dst[:] = 0

        stopped = True
        stop_process(worker.pid)
        doomed = writer.submit_write(src_mr, 0, PIECE, desc, 0, imm=40, routing=Pinned(1))
        assert _wait_for(lambda: writer.stats().nics[1].inflight >= 1, T), "the write was never posted"
        with contextlib.suppress(PeerUnreachable):  # the stopped target cannot confirm it
            doomed.cancel(timeout=0.3)
        assert doomed.done() and isinstance(doomed.exception(0), TransferCancelled)
        # NIC 1 goes down: the cancelled write's acknowledgement is lost with it (it lands all
        # the same once the target runs again), and so are the next writes on it
        writer._core.inject_nic_failure(1, True, seed)
        live = [
            writer.submit_write(src_mr, i * PIECE, PIECE, desc, i * PIECE, imm=41, routing=Pinned(1))
            for i in range(1, 5)
        ]
        time.sleep(0.1)
        os.kill(worker.pid, signal.SIGCONT)
        stopped = False

        for t in live:
            assert t.exception(T) is None  # retried on NIC 0, its path reconciled first
        target.counter(41).wait(sum(t.imms_at_target for t in live), timeout=T)
        assert np.array_equal(dst[PIECE : 5 * PIECE], src[PIECE : 5 * PIECE])
        time.sleep(0.2)
        assert target.counter(41).value == 0, "counted more imms than imms_at_target"
        # it was in the target's socket when cancelled: it landed (what this test stages), and
        # once only (its failure was not retried)
        assert target.counter(40).value == doomed.imms_at_target == 1
        assert writer.stats().retries >= 1
    finally:
        if stopped:
            os.kill(worker.pid, signal.SIGCONT)
        writer._core.inject_nic_failure(1, False, seed)
        writer.deregister(src_mr)
        target.deregister(dst_mr)
        writer.close()
        target.close()


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_nic_loss_beside_a_second_sender_never_miscounts(
    pool: WorkerPool, seed: int, provider: str
) -> None:
    """Two engines write WriteImms to one target on its NIC 1; one of them loses that NIC.

    Where the target's domain reports each imm's source (shm, FI_SOURCE) its counts are kept
    per sender, and the lost WriteImms are reconciled and retried as with one sender. Where
    it reports none (tcp;ofi_rxm: fabric does not ask rxm for sources, which libfabric 1.17's
    gives wrong for a second sender and 2.x's leaves out of every remote write), the target
    cannot tell the two senders' imms apart on that NIC:
    the lost WriteImms that need the counts fail with TransportError saying so, and no imm
    is counted more often than submitted. The other sender's transfers complete either way,
    each counted exactly.
    """
    settings = load_settings(backend="efa", efa_provider=provider, nics=2, timeout_s=T)
    probe = EfaBackend.probe(settings)
    if not probe.available:
        pytest.skip(probe.reason)
    config = {"backend": "efa", "efa_provider": provider, "nics": 2, "timeout_s": T}
    writer = EfaEngine(settings)
    target = RemoteEngine(pool, pool.workers[0], config)
    other = RemoteEngine(pool, pool.workers[1], config)
    src, other_src, dst = pool.alloc(4 * PIECE), pool.alloc(4 * PIECE), pool.alloc(8 * PIECE)
    rng = np.random.default_rng(seed)
    src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
    other_src[:] = rng.integers(0, 256, other_src.size, dtype=np.uint8)
    dst[:] = 0
    src_mr, other_mr, dst_mr = writer.register(src), other.register(other_src), target.register(dst)
    desc = dst_mr.descriptor
    try:
        # each sender's hello is answered, and each has carried a WriteImm on NIC 1
        for w, mr, imm in ((writer, src_mr, 90), (other, other_mr, 92)):
            w.submit_imm(desc, imm).wait(T)
            target.counter(imm).wait(1, timeout=T)
            w.fence([desc], timeout=T)
            t = w.submit_write(mr, 0, PIECE, desc, 0, imm=imm + 1, routing=Pinned(1))
            t.wait(T)
            target.counter(imm + 1).wait(t.imms_at_target, timeout=T)
        sourced = target.dump_state()["imms_without_source"][1] == 0

        writer._core.inject_nic_failure(1, True, seed)
        lost = [
            writer.submit_write(src_mr, i * PIECE, PIECE, desc, i * PIECE, imm=41, routing=Pinned(1))
            for i in range(4)
        ]
        beside = [
            other.submit_write(other_mr, i * PIECE, PIECE, desc, (4 + i) * PIECE, imm=51, routing=Pinned(1))
            for i in range(4)
        ]
        for t in beside:
            assert t.exception(T) is None
        target.counter(51).wait(sum(t.imms_at_target for t in beside), timeout=T)
        assert np.array_equal(dst[4 * PIECE :], other_src)
        errors = [t.exception(T) for t in lost]
        if sourced:
            assert errors == [None] * len(lost)  # reconciled on NIC 1's counts of this sender
            target.counter(41).wait(sum(t.imms_at_target for t in lost), timeout=T)
            assert np.array_equal(dst[: 4 * PIECE], src)
        else:
            # the second sender's imms on NIC 1 went to neither sender's counts
            assert target.dump_state()["imms_unattributed"][1] >= sum(t.imms_at_target for t in beside)
            for exc in errors:
                told = isinstance(exc, TransportError) and "could not tell" in str(exc)
                assert exc is None or told, repr(exc)
        time.sleep(0.3)
        counted = target.counter(41).value
        done = sum(t.imms_at_target for t, e in zip(lost, errors, strict=True) if e is None)
        if sourced:
            assert counted == 0, "counted more imms than imms_at_target"
        else:
            assert done <= counted <= sum(t.imms_at_target for t in lost), (done, counted)
        assert target.counter(51).value == 0, "the other sender's imms counted more than once"
    finally:
        writer._core.inject_nic_failure(1, False, seed)
        writer.deregister(src_mr)
        other.deregister(other_mr)
        target.deregister(dst_mr)
        writer.close()
        other.close()
        target.close()
