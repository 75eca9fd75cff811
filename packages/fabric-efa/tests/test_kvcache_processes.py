"""KvCache across processes on fabric-efa (shm): one decode process, two prefill processes,
each with its own engine, requests in flight together. Every page lands byte for byte, no
byte outside the allocated pages changes, each request completes exactly once, and every
page goes back to the allocator; a prefill process killed mid-request fails its request
alone, with a typed error."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import time
import zlib
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch")

PREFILLS, REQUESTS, LAYERS, BLOCKS = 2, 3, 3, 48
T = 30.0  # every wait in this test is bounded by this many seconds


def _layout() -> Any:
    from fabric_apps.kvcache import KvLayout

    return KvLayout(LAYERS, BLOCKS, 16, 2, 64, "bfloat16", "stacked")


def _prefill_caches(prefill: int) -> list[Any]:
    """Prefill ``prefill``'s cache, the same bits in every process that builds it."""
    import torch

    shape = _layout().accepted_shapes()[0]
    g = torch.Generator().manual_seed(100 + prefill)
    return [
        torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int32, generator=g)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def _request(prefill: int, i: int) -> tuple[str, list[int]]:
    """Request ``i`` of ``prefill``: its id and the prefill's block table for it."""
    import torch

    rid = f"p{prefill}-r{i}"
    n = 4 + 3 * i + prefill
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))
    return rid, torch.randperm(BLOCKS, generator=g)[:n].tolist()


def _rank(rank: int, port: int, conn: Any, dying: str | None) -> None:
    """Rank 0 decodes, the others prefill. ``dying``: prefill 0 gets one request, writes its
    first layer and exits; the decoder then expects that request to fail. It exits once that
    layer's writes completed (``"after_its_writes"``) or as soon as they are submitted, its
    engine's thread perhaps inside the provider's post (``"inside_a_post"``)."""
    import torch
    import torch.distributed as dist

    from fabric_apps.kvcache import KvDecoder, KvPrefiller
    from fabric_core import open_engine
    from fabric_core.models import DomainAddress
    from fabric_core.rendezvous import Rendezvous

    # Every wait below is bounded by T; a rank still here long after that is stuck somewhere
    # unbounded: print where each of its threads is (to the test's captured stderr) and exit,
    # so the test fails with the stacks instead of a bare "rank hung".
    faulthandler.dump_traceback_later(2.5 * T, exit=True)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=T))  # type: ignore[attr-defined]
    rdv = Rendezvous(store, rank=rank, world_size=1 + PREFILLS, prefix="kv", timeout=T)
    engine = open_engine("efa", efa_provider="shm", liveness_interval_s=0.1, liveness_timeout_s=1.0)
    doomed: dict[str, Any] = {}  # the decoder's view of the dead prefill's request
    try:
        layout = _layout()
        if rank == 0:
            caches = [torch.zeros(layout.accepted_shapes()[0], dtype=torch.bfloat16) for _ in range(LAYERS)]
            dec = KvDecoder(engine, layout, caches, timeout=T)
            addrs = [DomainAddress(raw=a) for a in rdv.all_gather("address", dec.address.raw)]
            for a in addrs[1:]:
                dec.connect(a, timeout=T)
            fired: dict[str, int] = {}
            handles = {}
            for p in range(PREFILLS):
                for i in range(1 if dying and p == 0 else REQUESTS):
                    rid, table = _request(p, i)
                    h = dec.receive(addrs[1 + p], rid, len(table))
                    h.on_done(lambda r, rid=rid: fired.__setitem__(rid, fired.get(rid, 0) + 1))
                    handles[rid] = (p, table, h)
            if dying:
                rid = _request(0, 0)[0]
                _p0, _t0, h0 = handles.pop(rid)
                start = time.monotonic()
                try:
                    h0.wait(T)
                except Exception as exc:  # the typed error, checked by the test
                    doomed.update(error=type(exc).__name__, after_s=time.monotonic() - start)
            for _p, _t, h in handles.values():
                h.wait(T)
            # completion callbacks run just after the waits wake: give them a bounded moment,
            # and a little more, so a second firing would be seen too
            deadline = time.monotonic() + T
            while len(fired) < len(handles) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            problems = []
            used = torch.zeros(BLOCKS, dtype=torch.bool)
            if dying:  # its first layer may have landed: inside its own pages, which is fine
                used[torch.as_tensor(list(h0.pages), dtype=torch.int64)] = True
            for rid, (p, table, h) in handles.items():
                src = _prefill_caches(p)
                pages = torch.as_tensor(list(h.pages), dtype=torch.int64)
                if bool(used[pages].any()):
                    problems.append(f"{rid}: pages given twice")
                used[pages] = True
                for layer in range(LAYERS):
                    got = caches[layer][:, pages].view(torch.int16)
                    want = src[layer][:, torch.as_tensor(table)].view(torch.int16)
                    if not torch.equal(got, want):
                        problems.append(f"{rid} layer {layer}: page bytes differ")
            for layer in range(LAYERS):
                outside = caches[layer][:, ~used].view(torch.int16)
                if int(outside.count_nonzero()):
                    problems.append(f"layer {layer}: bytes outside the allocated pages changed")
            for _p, _t, h in handles.values():
                h.release()
            if not dec.wait_idle(T):  # a failed request's pages come back once it is reclaimed
                problems.append("the decoder did not get idle")
            dec.allocator.check_no_leaks()
            stats = dec.stats()
            rdv.publish("checked", b"1")
            conn.send((problems, fired, stats.completed, stats.failed, stats.pages_used, doomed, False))
            dec.close(timeout=5)
        else:
            pf = KvPrefiller(engine, layout, _prefill_caches(rank - 1), timeout=T)
            rdv.all_gather("address", pf.address.raw)
            jobs = []
            for _ in range(REQUESTS):
                req = pf.next_request(T)
                tables = dict(_request(rank - 1, i) for i in range(REQUESTS))
                job = pf.begin(req, tables[req.request_id], timeout=T)
                if dying and rank == 1:
                    job.write_layer(0)
                    per_layer = job.expected_imms // LAYERS
                    if dying == "after_its_writes":  # layer 0 landed; layers 1 and 2 never come
                        deadline = time.monotonic() + T
                        while job.imms_sent < per_layer and time.monotonic() < deadline:
                            time.sleep(0.001)
                    # dead mid-request: no close, no goodbye. Status 4: it was to die after its
                    # writes but they never completed (the test expects 3)
                    os._exit(4 if dying == "after_its_writes" and job.imms_sent < per_layer else 3)
                for layer in range(LAYERS):
                    job.write_layer(layer)
                jobs.append(job)
            for job in jobs:
                job.wait(T)
            rdv.get("checked", 0)  # stay up until the decoder has read every page
            conn.send(([], {}, 0, 0, 0, {}, False))
            pf.close(timeout=5)
    except BaseException as exc:
        from fabric_core.errors import EngineWedged, TransportError

        # the last field: the rank ended in a typed transport error, or its engine closed
        # itself stuck in the provider (not a wrong byte, a leak or a bug), which is what a
        # wedged shm queue may leave (see the killed-prefill test)
        typed = isinstance(exc, (TransportError, EngineWedged))
        conn.send(([f"rank {rank}: {type(exc).__name__}: {exc}"], {}, -1, -1, -1, doomed, typed))
    finally:
        engine.close()


def _run(dying: str | None) -> list[Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1 + PREFILLS)]
    procs = [
        ctx.Process(target=_rank, args=(r, store.port, pipes[r][1], dying), daemon=True)
        for r in range(1 + PREFILLS)
    ]
    for p in procs:
        p.start()
    for _, there in pipes:
        there.close()
    try:
        results = []
        for r, (here, _) in enumerate(pipes):
            assert here.poll(3 * T), f"rank {r} hung"
            try:
                results.append(here.recv())
            except EOFError:  # a rank that died on purpose sends nothing
                procs[r].join(10)
                results.append((None, procs[r].exitcode))
        return results
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_six_requests_from_two_prefill_processes_land_exactly_in_one_decode_process() -> None:
    results = _run(dying=None)
    for problems, *_ in results:
        assert problems == []
    _problems, fired, completed, failed, pages_used, _doomed, _typed = results[0]
    ids = {_request(p, i)[0] for p in range(PREFILLS) for i in range(REQUESTS)}
    assert fired == dict.fromkeys(ids, 1)  # each request completed once, none twice
    assert (completed, failed, pages_used) == (PREFILLS * REQUESTS, 0, 0)


def _libfabric_major() -> int:
    import fabric_efa._efa as efa

    return int(efa.libfabric_version()[0])


@pytest.mark.parametrize("dying", ["after_its_writes", "inside_a_post"])
def test_a_prefill_process_killed_mid_request_fails_only_its_request_and_returns_its_pages(
    dying: str,
) -> None:
    """Prefill 0 writes one of three layers and exits: that request fails with
    ``PeerUnreachable`` (the liveness probe, 1 s), its pages come back, and prefill 1's three
    requests land exactly as if nothing had happened.

    ``inside_a_post`` exits while its engine may be posting the layer's writes. libfabric 2.x's
    shm cannot survive a writer killed between claiming a slot of the target's command queue
    and committing it: the target's queue stalls behind that slot for good, for every writer
    (docs/concepts/failures.md, "shm 2.x and a process killed mid-post"). There, prefill 1's
    requests may instead end in typed transport errors at both ends, within the test's
    bounded waits, or in ``EngineWedged`` where an engine's progress stays stuck in the
    provider for its liveness timeout; the dead prefill's request must still fail typed. On
    1.17 a writer killed holding the decoder's queue lock leaves whoever next takes that lock
    spinning on it, inside the provider: the decoder's progress (the dead prefill's request
    then ends in ``EngineWedged``, met in CI runs) or the surviving prefill's post (its engine
    closes itself with ``EngineWedged`` while the dead prefill's request fails with
    ``PeerUnreachable``, met in a full local run on 2026-12-05). There a stall is accepted only
    where some engine reports ``EngineWedged``, every failure typed."""
    results = _run(dying=dying)
    assert results[1] == (None, 3)  # prefill 0 died as planned
    problems, fired, completed, failed, pages_used, doomed, decoder_typed = results[0]
    survivor_problems, *_rest, survivor_typed = results[2]
    stalled = problems or survivor_problems or doomed.get("error") != "PeerUnreachable"
    v2 = _libfabric_major() >= 2
    wedged = doomed.get("error") == "EngineWedged" or any(
        ": EngineWedged: " in p for p in problems + survivor_problems
    )
    if dying == "inside_a_post" and stalled and (v2 or wedged):
        # The stalled queue (or the target's lock, held by the dead writer: then the decoder's
        # engine makes no progress, and closes itself after its liveness timeout:
        # EngineWedged): every failure typed within the bounded waits, none a wrong byte or leak.
        assert doomed.get("error") in {"PeerUnreachable", "TransferTimeout", "EngineWedged"}, doomed
        assert (problems == [] or decoder_typed) and (survivor_problems == [] or survivor_typed), (
            problems,
            survivor_problems,
        )
        # reported as such (the checks above held): the known limit, not a pass
        pytest.xfail(
            f"libfabric {'2.x' if v2 else '1.17'} shm stalled by the killed writer: {doomed}, "
            f"{problems + survivor_problems}"
        )
    assert doomed["error"] == "PeerUnreachable" and doomed["after_s"] < 10.0, doomed
    assert survivor_problems == []
    assert problems == []
    assert fired == {_request(1, i)[0]: 1 for i in range(REQUESTS)}  # no completion for the dead one
    assert (completed, failed, pages_used) == (REQUESTS, 1, 0)


def test_the_kv_benchmark_across_processes_survives_a_killed_prefill_and_a_joining_decoder() -> None:
    """``fabric bench kv``'s run on efa/shm at a small shape: two prefill processes, one
    decode process and a second that joins a third into the serve phase; prefill 0 is
    SIGKILLed at two thirds. Only requests that went to it fail (typed), the survivor serves
    every later request, each completed request's pages carry the right stamps (every second
    one byte for byte) and no decoder ends with a page allocated.

    Before control messages completed on transmit, a REQUEST sent to the dead prefill held up
    the completion of every later send of that decoder on shm (one in-order response queue per
    endpoint), so requests to the survivor failed too once liveness gave up on it."""
    from fabric_apps.kvcache import bench as kvb

    spec = kvb.KvBenchSpec(
        backend="efa",
        layers=4,
        decode_blocks=64,
        prefill_blocks=32,
        throughput_s=1.0,
        warmup_s=0.2,
        throughput_tokens=256,
        serve_s=4.5,
        rate=12.0,
        min_tokens=64,
        max_tokens=512,
        verify_every=2,
        timeout=T,
        engine_options={"efa_provider": "shm", "liveness_interval_s": 0.2, "liveness_timeout_s": 1.0},
    )
    result = kvb.run_kv_bench(spec)  # raises KvBenchError on a wrong page, a leak, a stray failure
    s = result.serve
    assert s["unexpected_failures"] == [] and s["failed"] == s["failed_touching_killed"]
    assert set(s["failed_errors"]) <= {"PeerUnreachable"}, s["failed_errors"]
    assert s["completed_after_kill"] > 0 and s["per_decoder"]["decode-1"]["completed"] > 0
    assert s["leaked_pages"] == 0 and result.throughput["requests"] > 0
