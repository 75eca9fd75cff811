"""Small writes on shm: many in flight to one peer, each in place at the target when its
transfer completes.

shm sends a delivery-complete write of at most its inject size (4 KiB) through its bounce
buffers, one at a time per peer, so fabric-efa sends such writes, where their request has
several, as injects and holds each one's completion back until a delivery marker posted after
it has completed
(LibfabricDomain::post_markers; docs/backends/efa.md, "One small delivery-complete write in
flight per peer on shm"). These tests check both halves: that the writes do not go one at a
time, and that a completed write's bytes are already at the target, read from the target's
own memory the moment the writer sees each transfer complete (a request of one write goes
delivery complete, under no marker; a paged request's under markers).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from fabric_core.settings import load_settings
from fabric_core.testing.remote import RemoteEngine, WorkerPool
from fabric_efa import EfaBackend
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")

T = 20.0
PROVIDER = "shm"
PAGES, PAGE = 65536, 8  # the paged request: many tiny pages


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(workers=2, arena_bytes=1 << 25) as p:
        yield p


def _writer(chaos: int | None, provider: str = PROVIDER, **extra: object) -> EfaEngine:
    settings = load_settings(
        backend="efa", efa_provider=provider, nics=1, timeout_s=T, chaos_seed=chaos, **extra
    )
    probe = EfaBackend.probe(settings)
    if not probe.available:
        pytest.skip(probe.reason)
    return EfaEngine(settings)


def test_markers_run_on_shm_alone_and_turn_off() -> None:
    """``provider_info`` says whether NIC 0 confirms small writes by markers: on shm by
    default, never on tcp (rxm's eager sends drop ``FI_DELIVERY_COMPLETE``, and a marker
    write may meet a key its target has since retired), and not once
    ``efa_delivery_markers`` is off."""
    with _writer(None) as on, _writer(None, efa_delivery_markers=False) as off:
        assert on.provider_info["delivery_markers"] is True
        assert off.provider_info["delivery_markers"] is False
    with _writer(None, "tcp;ofi_rxm") as tcp:
        assert tcp.provider_info["delivery_markers"] is False


def test_with_markers_off_each_write_is_still_in_place_when_it_completes(pool: WorkerPool) -> None:
    writer = _writer(None, efa_delivery_markers=False)
    target = RemoteEngine(pool, pool.workers[0], {"backend": "efa", "efa_provider": PROVIDER, "nics": 1})
    pages, page = 4096, 256
    src, dst = pool.alloc(pages * page), pool.alloc(pages * page)
    try:
        src[:] = np.random.default_rng(11).integers(1, 256, src.size, dtype=np.uint8)
        dst[:] = 0
        src_mr, dst_mr = writer.register(src), target.register(dst)
        order = np.random.default_rng(12).permutation(pages).astype(np.int64)
        t = writer.submit_paged_write(
            src_mr, np.arange(pages, dtype=np.int64), page, dst_mr.descriptor, order, page, page
        )
        t.wait(T)
        assert np.array_equal(dst.reshape(pages, page)[order], src.reshape(pages, page))
        writer.deregister(src_mr)
        target.deregister(dst_mr)
    finally:
        target.close()
        writer.close()


@pytest.mark.parametrize("size", [8, 256, 4096])
@pytest.mark.parametrize("chaos", [None, 7])
def test_each_small_write_is_in_place_when_it_completes(
    pool: WorkerPool, size: int, chaos: int | None
) -> None:
    n = 256
    writer = _writer(chaos)
    config = {"backend": "efa", "efa_provider": PROVIDER, "nics": 1, "timeout_s": T}
    target = RemoteEngine(pool, pool.workers[0], config)
    src, dst = pool.alloc(n * size), pool.alloc(n * size + 64)
    psrc, pdst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    try:
        for rnd in range(2):
            src[:] = np.random.default_rng(size * 10 + rnd).integers(1, 256, src.size, dtype=np.uint8)
            dst[:] = 0
            src_mr, dst_mr = writer.register(src), target.register(dst)
            desc = dst_mr.descriptor
            # every write to its own slot, no imm: the transfer's completion is the only signal
            transfers = [writer.submit_write(src_mr, i * size, size, desc, i * size) for i in range(n)]
            left = dict(enumerate(transfers))
            deadline = time.monotonic() + T
            while left:
                assert time.monotonic() < deadline, f"{len(left)} of {n} writes not complete after {T} s"
                for i, t in list(left.items()):
                    if not t.done():
                        continue
                    t.wait(0)  # (raises if it failed)
                    got, sent = dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size]
                    assert np.array_equal(got, sent), f"write {i} completed before landing"
                    del left[i]
            assert (dst[n * size :] == 0).all()  # nothing past the last slot
            # Many more as one paged request (the engine posts its writes back to back): they go
            # together, not one at a time (shm's bounce-buffer protocol, which delivery-complete
            # writes this small would take, never has two in flight to one peer).
            pages = np.random.default_rng(rnd).permutation(PAGES).astype(np.int64)
            psrc[:] = np.random.default_rng(rnd + 5).integers(1, 256, psrc.size, dtype=np.uint8)
            pdst[:] = 0
            psrc_mr, pdst_mr = writer.register(psrc), target.register(pdst)
            t = writer.submit_paged_write(
                psrc_mr, np.arange(PAGES, dtype=np.int64), PAGE, pdst_mr.descriptor, pages, PAGE, PAGE
            )
            peak = 0  # the most writes posted and not yet reported, seen at once
            while not t.done():
                assert time.monotonic() < deadline + T, "the paged write did not complete"
                peak = max(peak, writer.stats().nics[0].inflight)
            t.wait(0)
            landed = pdst.reshape(PAGES, PAGE)[pages]  # in place when it completed
            assert np.array_equal(landed, psrc.reshape(PAGES, PAGE))
            assert peak > 1, f"at most {peak} write in flight at once"
            writer.deregister(psrc_mr)
            target.deregister(pdst_mr)
            writer.deregister(src_mr)
            target.deregister(dst_mr)
    finally:
        target.close()
        writer.close()
