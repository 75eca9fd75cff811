"""KV-cache transfer end to end on the simulator: chunks land shuffled, completions reorder.

Every test checks exact bytes (inside the request's pages, and everywhere else against a
sentinel), exact imm counts at the decoder, typed errors and that every page comes back.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from kvworld import (
    SENTINEL,
    T,
    World,
    byte_view,
    check_pages,
    eventually,
    expected_image,
    make_caches,
    serve,
    snapshot,
)

from fabric_apps.kvcache import (
    ImmsExhausted,
    KvDecoder,
    KvLayout,
    KvPrefiller,
    KvReceive,
    RequestAborted,
    RequestCancelled,
)
from fabric_core import ConfigError, EngineClosed, PeerUnreachable, TransferTimeout

GEOMETRY = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)

# (decoder layout, prefill layout): both vLLM-style, SGLang feeding vLLM, vLLM-FlashInfer
# feeding SGLang, an MLA latent cache in bf16 torch tensors on both sides, and FlashInfer-style
# on both sides (K and V of a page in one write)
PAIRS: list[tuple[KvLayout, KvLayout]] = [
    (KvLayout(**GEOMETRY, num_blocks=24, dtype="float16", kv_split="stacked"),
     KvLayout(**GEOMETRY, num_blocks=32, dtype="float16", kv_split="stacked")),
    (KvLayout(**GEOMETRY, num_blocks=24, dtype="float16", kv_split="stacked"),
     KvLayout(**GEOMETRY, num_blocks=32, dtype="float16", kv_split="separate")),
    (KvLayout(**GEOMETRY, num_blocks=24, dtype="float16", kv_split="separate"),
     KvLayout(**GEOMETRY, num_blocks=32, dtype="float16", kv_split="interleaved")),
    (KvLayout.mla(num_layers=3, num_blocks=24, block_size=4, latent_dim=72, dtype="bfloat16"),
     KvLayout.mla(num_layers=3, num_blocks=32, block_size=4, latent_dim=72, dtype="bfloat16")),
    (KvLayout(**GEOMETRY, num_blocks=24, dtype="float16", kv_split="interleaved"),
     KvLayout(**GEOMETRY, num_blocks=32, dtype="float16", kv_split="interleaved")),
]  # fmt: skip
SMALL = KvLayout(**GEOMETRY, num_blocks=8, dtype="float16", kv_split="stacked")


def _src_pages(rng: np.random.Generator, layout: KvLayout, n: int) -> np.ndarray[Any, Any]:
    return rng.choice(layout.num_blocks, size=n, replace=False)


def _connected(
    world: World, dlayout: KvLayout, playout: KvLayout, nics: int = 2, **kw: Any
) -> tuple[KvDecoder, list[Any], KvPrefiller, list[Any]]:
    dec, dcaches = world.decoder(dlayout, nics=nics, **kw)
    pf, pcaches = world.prefiller(playout, nics=nics)
    dec.connect(pf.address, timeout=T)
    return dec, dcaches, pf, pcaches


# --- (a) end to end, over seeds and NIC counts --------------------------------------------------
@pytest.mark.parametrize("nics", [1, 2])
def test_every_page_lands_exactly_and_nothing_else_changes(world: World, fabric_seed: int, nics: int) -> None:
    dlayout, playout = PAIRS[fabric_seed % len(PAIRS)]
    dec, dcaches, pf, pcaches = _connected(world, dlayout, playout, nics)
    before = snapshot(dcaches)
    rng = np.random.default_rng(fabric_seed)
    sizes = [1, 3, 5, 7]
    fired: list[str] = []
    handles = [
        dec.receive(pf.address, f"seq{i}", n).on_done(lambda h: fired.append(h.request_id))
        for i, n in enumerate(sizes)
    ]
    assert len({h.imm for h in handles}) == len(handles)  # one imm per request, none shared
    src = {f"seq{i}": _src_pages(rng, playout, n) for i, n in enumerate(sizes)}
    jobs = serve(pf, src, len(sizes))
    for h in handles:
        h.wait(T)
    for job in jobs:
        job.wait(T)
    world.fabric.quiesce(T)
    # exact bytes in every page of every request, and nothing outside them touched
    image = expected_image(dlayout, before, [(h.pages, src[h.request_id]) for h in handles], playout, pcaches)
    now = snapshot(dcaches)
    for i, (got, want) in enumerate(zip(now, image, strict=True)):
        assert np.array_equal(got, want), f"decoder tensor {i} differs from the expected image"
    # the counter of each request fired once, for exactly what the prefill sent
    assert eventually(lambda: len(fired) >= len(handles))
    assert sorted(fired) == sorted(h.request_id for h in handles)
    by_id = {j.request.request_id: j for j in jobs}
    for h in handles:
        writes = 1 if dlayout.kv_split == playout.kv_split == "interleaved" else len(dlayout.segments)
        assert h.expected_imms == by_id[h.request_id].imms_sent == h.pages.size * writes * 3
        assert dec.engine.counter(h.imm).value == 0
    assert dec.engine.stats().imms_received == sum(h.expected_imms for h in handles)
    for h in handles:
        h.release()
    dec.allocator.check_no_leaks()
    assert dec.stats().completed == 4 and pf.stats().completed == 4 and pf.stats().inflight == 0


# --- (b) prefix pages ------------------------------------------------------------------------
def test_prefix_pages_are_skipped_and_untouched(world: World) -> None:
    dlayout, playout = PAIRS[1]
    dec, dcaches, pf, pcaches = _connected(world, dlayout, playout)
    rng = np.random.default_rng(5)
    first = dec.receive(pf.address, "prompt", 4)
    src1 = _src_pages(rng, playout, 4)
    serve(pf, {"prompt": src1}, 1)[0].wait(T)
    first.wait(T)
    received_before = dec.engine.stats().imms_received
    # a second sequence shares the first 3 pages (prefix-cache hit) and needs 2 more
    second = dec.receive(pf.address, "prompt+more", 5, prefix_pages=first.block_table[:3])
    assert second.pages.size == 2 and second.block_table[:3].tolist() == first.block_table[:3].tolist()
    assert second.expected_imms == 2 * 2 * 3  # only the new pages, K and V, 3 layers
    # the prefill's block table for the whole sequence: its prefix pages hold other bytes than
    # the decoder's, so a write of them would show
    src2 = np.concatenate((np.setdiff1d(np.arange(playout.num_blocks), src1)[:3], src1[3:], [src1[0]]))
    before = snapshot(dcaches)
    serve(pf, {"prompt+more": src2}, 1)[0].wait(T)
    second.wait(T)
    world.fabric.quiesce(T)
    image = expected_image(dlayout, before, [(second.pages, src2[3:])], playout, pcaches)
    for got, want in zip(snapshot(dcaches), image, strict=True):
        assert np.array_equal(got, want)
    check_pages(dlayout, dcaches, first.block_table, playout, pcaches, src1)  # prefix intact
    assert dec.engine.stats().imms_received - received_before == second.expected_imms
    second.release()
    first.release()
    dec.allocator.check_no_leaks()
    with pytest.raises(ConfigError, match="allocated"):  # prefix pages must be held
        dec.receive(pf.address, "x", 4, prefix_pages=first.block_table[:2])
    with pytest.raises(ConfigError, match="nothing to transfer"):
        dec.receive(pf.address, "x", 2, prefix_pages=[0, 1])
    assert dec.allocator.stats().used == 0


def k_of(h: KvReceive) -> int:
    """Which of the two prefills request ``r<i>`` went to."""
    return int(h.request_id[1:]) % 2


# --- (c) many prefills, one decoder ------------------------------------------------------------
def test_two_prefills_write_concurrently_into_one_decoder(world: World) -> None:
    dlayout, playout = PAIRS[0]
    # six imm values for 24 requests: every value is reused several times
    dec, dcaches = world.decoder(dlayout, imm_slots=6)
    prefills = [world.prefiller(playout, seed=s, max_inflight=3) for s in (11, 12)]
    for pf, _ in prefills:
        dec.connect(pf.address, timeout=T)
    rng = np.random.default_rng(3)
    n_req = 24
    src: list[dict[str, Any]] = [{}, {}]
    errors: list[BaseException] = []

    def run_prefill(k: int) -> None:
        pf = prefills[k][0]
        try:
            for _ in range(n_req // 2):
                req = pf.next_request(T)
                job = pf.begin(req, src[k][req.request_id], timeout=T)
                job.write_all()
        except BaseException as exc:
            errors.append(exc)

    # the decoder side: at most 6 requests at once (the imm pool), alternating prefills
    live: dict[int, KvReceive] = {}
    specs = [(i % 2, f"r{i}", 1 + i % 5) for i in range(n_req)]
    for k, rid, n in specs:
        src[k][rid] = _src_pages(rng, playout, n)
    threads = [threading.Thread(target=run_prefill, args=(k,)) for k in (0, 1)]
    for th in threads:
        th.start()
    for k, rid, n in specs:
        if len(live) == 6:
            oldest = min(live)
            h = live.pop(oldest)
            h.wait(T)
            check_pages(dlayout, dcaches, h.pages, playout, prefills[k_of(h)][1], src[k_of(h)][h.request_id])
            h.release()
        busy = {x.imm for x in live.values() if not x.done()}  # a completed request frees its imm
        h = dec.receive(prefills[k][0].address, rid, n)
        assert h.imm not in busy  # never shared by requests in flight
        live[h.seq] = h
    for h in live.values():
        h.wait(T)
        check_pages(dlayout, dcaches, h.pages, playout, prefills[k_of(h)][1], src[k_of(h)][h.request_id])
        h.release()
    for th in threads:
        th.join(T)
    assert not errors and not any(th.is_alive() for th in threads)
    world.fabric.quiesce(T)
    total = sum(n for _, _, n in specs) * 2 * 3
    assert dec.engine.stats().imms_received == total
    assert all(dec.engine.counter(dec.imms.base + i).value == 0 for i in range(6))
    dec.allocator.check_no_leaks()
    assert dec.stats().completed == n_req and dec.stats().imms_free == 6


# --- (d) cancel and timeout ----------------------------------------------------------------------
def test_cancel_mid_transfer_quarantines_pages_and_imm_until_late_writes_are_counted(world: World) -> None:
    dec, dcaches, pf, pcaches = _connected(world, SMALL, SMALL, imm_slots=2)
    rng = np.random.default_rng(9)
    h1 = dec.receive(pf.address, "a", 4)
    job1 = pf.begin(pf.next_request(T), _src_pages(rng, SMALL, 4), timeout=T)
    with world.fabric.paused():  # layers 0 and 1 are on the wire: they land after the cancel
        assert job1.write_layer(0) and job1.write_layer(1)
        assert h1.cancel()
        assert isinstance(h1.exception(0), RequestCancelled)
        assert not h1.cancel()
        s = dec.stats()
        assert (s.pending, s.reclaiming, s.pages_quarantined, s.pages_used) == (0, 1, 4, 4)
        # a new request gets the other imm and other pages: nothing it owns can be hit
        h2 = dec.receive(pf.address, "b", 4)
        assert h2.imm != h1.imm and not set(h2.pages.tolist()) & set(h1.pages.tolist())
        with pytest.raises(ImmsExhausted):
            dec.receive(pf.address, "c", 1)  # h1's imm is still quarantined
        assert dec.stats().pages_used == 8  # the refused request took no page
    assert isinstance(job1.exception(T), RequestCancelled)
    assert not job1.write_layer(2)  # the prefill stopped writing
    sent1 = job1.imms_sent
    assert sent1 == 2 * 4 * 2  # two layers of four K and four V pages
    # h1 is reclaimed while h2 is still in flight: its late imms counted down, its pages free
    assert eventually(lambda: dec.stats().reclaiming == 0)
    world.fabric.quiesce(T)
    assert dec.engine.counter(h1.imm).value == 0 and dec.engine.stats().imms_received == sent1
    assert dec.allocator.stats().used == 4 and dec.imms.stats().free == 1 and not h2.done()
    # h1's imm and pages go to a new request, which completes on its own counts only
    h3 = dec.receive(pf.address, "d", 4)
    assert h3.imm == h1.imm and sorted(h3.pages.tolist()) == sorted(h1.pages.tolist())
    src2, src3 = _src_pages(rng, SMALL, 4), _src_pages(rng, SMALL, 4)
    job2 = pf.begin("b", src2, timeout=T)
    job3 = pf.begin("d", src3, timeout=T)
    with world.fabric.paused():
        job3.write_layer(0)
        assert dec.engine.counter(h3.imm).value == 0 and not h3.done()  # nothing of h1 left to credit it
    job2.write_all()
    job3.write_all()
    h2.wait(T)
    h3.wait(T)
    check_pages(SMALL, dcaches, h2.pages, SMALL, pcaches, src2)
    check_pages(SMALL, dcaches, h3.pages, SMALL, pcaches, src3)
    world.fabric.quiesce(T)
    assert dec.engine.stats().imms_received == sent1 + h2.expected_imms + h3.expected_imms
    assert dec.engine.counter(h2.imm).value == 0 and dec.engine.counter(h3.imm).value == 0
    h2.release()
    h3.release()
    dec.allocator.check_no_leaks()
    assert dec.stats().imms_retired == 0


def test_timeout_fails_with_counts_stops_the_prefill_and_returns_everything(world: World) -> None:
    dec, _dcaches, pf, _pcaches = _connected(world, SMALL, SMALL)
    h = dec.receive(pf.address, "slow", 3, timeout=1.5)
    job = pf.begin(pf.next_request(T), [0, 1, 2], timeout=T)
    job.write_layer(0)  # the other layers never come
    exc = h.exception(T)
    assert isinstance(exc, TransferTimeout)
    assert exc.expected == {h.imm: 3 * 3 * 2} and 0 <= exc.received[h.imm] <= 3 * 2
    assert isinstance(job.exception(T), RequestCancelled) and job.cancelled
    assert not job.write_layer(1)
    assert dec.wait_idle(T)
    world.fabric.quiesce(T)
    assert dec.engine.counter(h.imm).value == 0
    assert dec.engine.stats().imms_received == job.imms_sent == 3 * 2
    dec.allocator.check_no_leaks()
    s = dec.stats()
    assert (s.failed, s.pages_used, s.imms_free, s.imms_retired) == (1, 0, dec.imms.slots, 0)
    with pytest.raises(ConfigError, match="only a completed request's pages"):
        h.release()
    assert pf.stats().inflight == 0 and pf.stats().cancelled == 1


def test_prefill_slots_bound_jobs_in_flight(world: World) -> None:
    dec, dcaches = world.decoder(SMALL)
    pf, pcaches = world.prefiller(SMALL, max_inflight=1)
    dec.connect(pf.address, timeout=T)
    h1, h2 = dec.receive(pf.address, "one", 2), dec.receive(pf.address, "two", 2)
    job1 = pf.begin("one", [0, 1], timeout=T)
    with pytest.raises(TransferTimeout, match="job slots"):
        pf.begin("two", [2, 3], timeout=0.05)
    job1.write_all()
    job1.wait(T)
    job2 = pf.begin("two", [2, 3], timeout=T)  # the slot is free again
    assert job2.write_layer(0)
    with pytest.raises(ConfigError, match="written already"):
        job2.write_layer(0)
    with pytest.raises(ConfigError, match="outside"):
        job2.write_layer(3)
    job2.write_all()
    for h, src in ((h1, [0, 1]), (h2, [2, 3])):
        h.wait(T)
        check_pages(SMALL, dcaches, h.pages, SMALL, pcaches, src)
        h.release()


def test_prefill_abort_fails_the_request_and_reclaims_at_once(world: World) -> None:
    dec, _dcaches, pf, _pcaches = _connected(world, SMALL, SMALL)
    h = dec.receive(pf.address, "doomed", 2)
    job = pf.begin(pf.next_request(T), [4, 5], timeout=T)
    job.write_layer(1)
    job.abort("out of memory")
    exc = h.exception(T)
    assert isinstance(exc, RequestAborted) and "out of memory" in str(exc)
    assert isinstance(job.exception(T), RequestAborted)
    assert dec.wait_idle(T)
    world.fabric.quiesce(T)
    assert dec.engine.counter(h.imm).value == 0 and dec.engine.stats().imms_received == 2 * 2
    dec.allocator.check_no_leaks()


def test_bad_block_table_rejects_the_request_at_both_ends(world: World) -> None:
    dec, _dcaches, pf, _pcaches = _connected(world, SMALL, SMALL)
    h = dec.receive(pf.address, "r", 2)
    with pytest.raises(ConfigError, match="src_pages has 3 entries"):
        pf.begin(pf.next_request(T), [0, 1, 2], timeout=T)
    assert isinstance(h.exception(T), ConfigError)
    assert dec.wait_idle(T)
    dec.allocator.check_no_leaks()
    assert pf.stats().inflight == 0


# --- (e) peers lost ------------------------------------------------------------------------------
def test_lost_prefill_fails_only_its_requests(world: World) -> None:
    dlayout, playout = PAIRS[1]
    dec, dcaches = world.decoder(dlayout, lost_peer_grace_s=0.05)
    (victim, _), (survivor, scaches) = world.prefiller(playout, seed=21), world.prefiller(playout, seed=22)
    for pf in (victim, survivor):
        dec.connect(pf.address, timeout=T)
    doomed = [dec.receive(victim.address, f"v{i}", 3) for i in range(3)]
    kept = [dec.receive(survivor.address, f"s{i}", 2 + i) for i in range(3)]
    rng = np.random.default_rng(4)
    vjobs = [victim.begin(f"v{i}", _src_pages(rng, playout, 3), timeout=T) for i in range(3)]
    ssrc = {f"s{i}": _src_pages(rng, playout, 2 + i) for i in range(3)}
    sjobs = [survivor.begin(f"s{i}", ssrc[f"s{i}"], timeout=T) for i in range(3)]
    for job in vjobs:
        job.write_layer(0)
    # layer 0 of the victim's requests is counted (and not consumed: their counters want 18)
    assert eventually(lambda: all(dec.engine.counter(h.imm).value == 3 * 2 for h in doomed))
    with world.fabric.paused():  # the victim dies with layer 1 on the wire
        for job in vjobs:
            job.write_layer(1)
        for job in sjobs:
            job.write_layer(0)
        world.fabric.fail_peer(victim.engine)  # type: ignore[arg-type]
    for h in doomed:
        assert isinstance(h.exception(T), PeerUnreachable)
    for job in sjobs:
        job.write_all()
    for h in kept:
        h.wait(T)
        check_pages(dlayout, dcaches, h.pages, playout, scaches, ssrc[h.request_id])
    assert dec.wait_idle(T)  # the dead prefill's pages and imms are back
    world.fabric.quiesce(T)
    assert dec.allocator.stats().used == sum(h.pages.size for h in kept)
    assert all(dec.engine.counter(h.imm).value == 0 for h in doomed + kept)
    with pytest.raises(PeerUnreachable):
        dec.receive(victim.address, "late", 2)
    assert dec.allocator.stats().used == sum(h.pages.size for h in kept)
    assert dec.imms.stats().in_use == 0 and dec.imms.stats().retired == 0
    for h in kept:
        h.release()
    dec.allocator.check_no_leaks()


def test_lost_decoder_fails_its_jobs_and_frees_their_slots(world: World) -> None:
    dec, _ = world.decoder(SMALL)
    other, ocaches = world.decoder(SMALL)
    pf, pcaches = world.prefiller(SMALL, max_inflight=1)
    dec.connect(pf.address, timeout=T)
    other.connect(pf.address, timeout=T)
    h = dec.receive(pf.address, "gone", 3)
    job = pf.begin(pf.next_request(T), [0, 1, 2], timeout=T)
    job.write_layer(0)
    world.fabric.fail_peer(dec.engine)  # type: ignore[arg-type]
    assert isinstance(h.exception(T), EngineClosed)  # the dead side's own view
    job.write_layer(1)
    job.write_layer(2)
    assert isinstance(job.exception(T), PeerUnreachable)
    h2 = other.receive(pf.address, "alive", 2)
    job2 = pf.begin(pf.next_request(T), [5, 6], timeout=T)  # the only slot is free again
    job2.write_all()
    h2.wait(T)
    check_pages(SMALL, ocaches, h2.pages, SMALL, pcaches, [5, 6])
    h2.release()
    other.allocator.check_no_leaks()


# --- connecting, async -------------------------------------------------------------------------
def test_connect_refuses_other_page_formats_and_nic_counts(world: World) -> None:
    dec, _ = world.decoder(SMALL)
    pf, _ = world.prefiller(
        KvLayout(**{**GEOMETRY, "head_dim": 16}, num_blocks=8, dtype="float16", kv_split="stacked")
    )
    with pytest.raises(ConfigError, match="head_dim: 16 here, 8 there"):
        dec.connect(pf.address, timeout=T)
    one_nic, _ = world.prefiller(SMALL, nics=1)
    with pytest.raises(ConfigError, match="NIC"):
        dec.connect(one_nic.address, timeout=T)
    with pytest.raises(ConfigError, match="connect"):
        dec.receive(pf.address, "r", 1)
    assert dec.allocator.stats().used == 0


def test_requests_are_awaitable() -> None:
    w = World(2)
    try:
        dec, dcaches = w.decoder(SMALL)
        pf, pcaches = w.prefiller(SMALL)
        dec.connect(pf.address, timeout=T)

        async def main() -> KvReceive:
            h = dec.receive(pf.address, "async", 3)
            job = await asyncio.to_thread(pf.begin, "async", [7, 3, 5], timeout=T)
            job.write_all()
            await asyncio.wait_for(job, T)
            return await asyncio.wait_for(h, T)

        h = asyncio.run(main())
        check_pages(SMALL, dcaches, h.pages, SMALL, pcaches, [7, 3, 5])
        untouched = np.setdiff1d(np.arange(8), h.pages)
        for layer in range(3):
            view = byte_view(dcaches[layer]).reshape(2, 8, -1)
            assert (view[:, untouched] == SENTINEL).all()
        h.release()
    finally:
        w.close()


def test_decoder_close_fails_pending_requests_and_frees_pages() -> None:
    w = World(4)
    try:
        eng = w.engine()
        caches = make_caches(SMALL, fill=SENTINEL)
        dec = KvDecoder(eng, SMALL, caches, timeout=T)
        pf, _ = w.prefiller(SMALL)
        dec.connect(pf.address, timeout=T)
        h = dec.receive(pf.address, "r", 2)
        dec.close()
        assert isinstance(h.exception(0), EngineClosed)
        dec.allocator.check_no_leaks()
        with pytest.raises(EngineClosed):
            dec.receive(pf.address, "r2", 1)
        assert eventually(lambda: pf.stats().cancelled == 1)  # the prefill was told
        assert pf.stats().waiting == 0
    finally:
        w.close()
