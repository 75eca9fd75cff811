"""KvCache faults across processes on fabric-efa: a decode process killed mid-request, a
request cancelled mid-transfer, and one past its deadline. One prefill process serves two
decode processes; decoder A suffers the fault, decoder B's request runs beside it. The
faulty request ends with its typed error on both sides, its pages come back, a sentinel
written into A's reused pages is never overwritten by a late write, and B's request lands
byte for byte."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch")

LAYERS, BLOCKS, PAGES = 6, 32, 12
T = 30.0  # every wait is bounded by this many seconds
SENTINEL = 0x5A5A


def _layout() -> Any:
    from fabric_apps.kvcache import KvLayout

    return KvLayout(LAYERS, BLOCKS, 16, 2, 64, "bfloat16", "stacked")


def _source() -> list[Any]:
    import torch

    shape = _layout().accepted_shapes()[0]
    g = torch.Generator().manual_seed(7)
    return [
        torch.empty(shape, dtype=torch.int16).random_(generator=g).view(torch.bfloat16) for _ in range(LAYERS)
    ]


TABLES = {"a": list(range(PAGES)), "b": list(range(PAGES, 2 * PAGES))}


def _engine(provider: str) -> Any:
    from fabric_core import open_engine

    return open_engine("efa", efa_provider=provider, liveness_interval_s=0.1, liveness_timeout_s=1.0)


def _prefill(port: int, provider: str, scenario: str, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from fabric_apps.kvcache import KvPrefiller

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=T))  # type: ignore[attr-defined]
    engine = _engine(provider)
    out: dict[str, Any] = {}
    try:
        pf = KvPrefiller(engine, _layout(), _source(), timeout=T)
        store.set("prefill", pf.address.raw)
        jobs = {}
        for _ in range(2):
            req = pf.next_request(T)
            jobs[req.request_id] = pf.begin(req, TABLES[req.request_id], timeout=T)
        for job in jobs.values():
            job.write_layer(0)
            job.write_layer(1)
        store.set("layers-started", b"1")
        store.wait(["fault-done"], timedelta(seconds=T))  # A died, cancelled or timed out
        start = time.monotonic()
        if scenario != "decode_killed":  # the CANCEL is on its way: the job learns of it
            while not jobs["a"].cancelled and time.monotonic() - start < T:
                time.sleep(0.005)
            out["saw_cancel"] = jobs["a"].cancelled
        for layer in range(2, LAYERS):
            for job in jobs.values():
                job.write_layer(layer)
        for rid, job in jobs.items():
            exc = job.exception(T)
            out[rid] = None if exc is None else type(exc).__name__
        out["after_s"] = time.monotonic() - start
        store.wait(["checked"], timedelta(seconds=T))
        pf.close(timeout=5)
        conn.send(("ok", out))
    except BaseException as exc:
        conn.send(("error", f"prefill: {type(exc).__name__}: {exc}"))
    finally:
        engine.close()


def _decoder(name: str, port: int, provider: str, scenario: str, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from fabric_apps.kvcache import KvDecoder
    from fabric_core.errors import FabricError
    from fabric_core.models import DomainAddress

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=T))  # type: ignore[attr-defined]
    engine = _engine(provider)
    out: dict[str, Any] = {}
    try:
        layout = _layout()
        caches = [torch.zeros(layout.accepted_shapes()[0], dtype=torch.bfloat16) for _ in range(LAYERS)]
        dec = KvDecoder(engine, layout, caches, timeout=T, settle_timeout_s=10.0, lost_peer_grace_s=0.3)
        prefill = DomainAddress(raw=bytes(store.get("prefill")))
        dec.connect(prefill, timeout=T)
        faulty = name == "a"
        limit = 1.0 if faulty and scenario == "timeout" else T
        h = dec.receive(prefill, name, PAGES, timeout=limit)
        store.wait(["layers-started"], timedelta(seconds=T))
        if faulty:
            if scenario == "decode_killed":
                os._exit(3)  # no close, no goodbye, writes of four layers still to come
            start = time.monotonic()
            if scenario == "cancel":
                assert h.cancel()
            try:
                h.wait(T)
                out["error"] = None
            except Exception as exc:
                out["error"] = type(exc).__name__
            out["after_s"] = time.monotonic() - start
            store.set("fault-done", b"1")
            # once reclaimed, the pages go to the next request: fill them with a sentinel
            # that no late write of the failed request may overwrite
            out["idle"] = dec.wait_idle(T)
            pages = torch.as_tensor(list(h.pages), dtype=torch.int64)
            dec.allocator.check_no_leaks()
            again = dec.allocator.alloc(PAGES)
            out["same_pages"] = sorted(again.tolist()) == sorted(pages.tolist())
            for c in caches:
                c.view(torch.int16)[:, pages] = SENTINEL
            time.sleep(1.5)  # the prefill writes its last layers meanwhile
            out["sentinel_intact"] = all(
                bool((c.view(torch.int16)[:, pages] == SENTINEL).all()) for c in caches
            )
            dec.allocator.free(again)
        else:
            try:
                h.wait(T)
            except FabricError as exc:  # collateral of a wedged provider (shm, see the test)
                out["error"] = type(exc).__name__
        if not faulty and "error" not in out:
            src = _source()
            pages = torch.as_tensor(list(h.pages), dtype=torch.int64)
            table = torch.as_tensor(TABLES["b"])
            out["exact"] = all(
                torch.equal(caches[i][:, pages].view(torch.int16), src[i][:, table].view(torch.int16))
                for i in range(LAYERS)
            )
            h.release()
            out["idle"] = dec.wait_idle(T)
            dec.allocator.check_no_leaks()
        if not faulty:
            store.wait(["fault-done"], timedelta(seconds=T))
        store.add("decoders-checked", 1)
        if int(store.add("decoders-checked", 0)) >= (1 if scenario == "decode_killed" else 2):
            store.set("checked", b"1")
        store.wait(["checked"], timedelta(seconds=T))
        dec.close(timeout=5)
        conn.send(("ok", out))
    except BaseException as exc:
        conn.send(("error", f"decoder {name}: {type(exc).__name__}: {exc}"))
    finally:
        engine.close()


def _run(provider: str, scenario: str) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    roles: list[tuple[str, Any, tuple[Any, ...]]] = [
        ("prefill", _prefill, (store.port, provider, scenario)),
        ("a", _decoder, ("a", store.port, provider, scenario)),
        ("b", _decoder, ("b", store.port, provider, scenario)),
    ]
    pipes = [ctx.Pipe(duplex=False) for _ in roles]
    procs = [
        ctx.Process(target=fn, args=(*args, pipes[i][1]), daemon=True)
        for i, (_, fn, args) in enumerate(roles)
    ]
    for p in procs:
        p.start()
    for _, there in pipes:
        there.close()
    out: dict[str, Any] = {}
    try:
        if scenario == "decode_killed":
            # The prefill writes layers 2.. only once A is dead, so those writes meet a dead
            # peer. Letting it go on while A was still dying raced A's exit: on a loaded
            # machine the whole request could land before A died, and the job ended well.
            procs[1].join(T)
            store.set("fault-done", b"1")
        for (name, _, _), (here, _) in zip(roles, pipes, strict=True):
            assert here.poll(3 * T), f"{name} hung"
            try:
                status, body = here.recv()
            except EOFError:
                out[name] = "exited"
                continue
            assert status == "ok", body
            out[name] = body
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


PROVIDERS = ["shm", "tcp;ofi_rxm"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_request_cancelled_mid_transfer_ends_on_both_sides_and_no_late_write_lands(provider: str) -> None:
    out = _run(provider, "cancel")
    assert out["a"]["error"] == "RequestCancelled" and out["a"]["after_s"] < 1.0
    assert out["a"]["idle"] and out["a"]["same_pages"] and out["a"]["sentinel_intact"]
    assert out["prefill"]["saw_cancel"] and out["prefill"]["a"] == "RequestCancelled"
    assert out["prefill"]["b"] is None
    assert out["b"] == {"exact": True, "idle": True}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_request_past_its_deadline_times_out_and_no_late_write_lands(provider: str) -> None:
    out = _run(provider, "timeout")
    assert out["a"]["error"] == "TransferTimeout" and out["a"]["after_s"] < 5.0
    assert out["a"]["idle"] and out["a"]["same_pages"] and out["a"]["sentinel_intact"]
    assert out["prefill"]["saw_cancel"] and out["prefill"]["a"] == "RequestCancelled"
    assert out["prefill"]["b"] is None
    assert out["b"] == {"exact": True, "idle": True}


def test_a_decode_process_killed_mid_request_fails_its_job_alone_on_tcp() -> None:
    """On tcp;ofi_rxm the dead decoder's connection fails its writes: the prefill's job for
    it ends with ``PeerUnreachable`` and decoder B's request lands exactly."""
    out = _run("tcp;ofi_rxm", "decode_killed")
    assert out["a"] == "exited"
    assert out["prefill"]["a"] == "PeerUnreachable" and out["prefill"]["after_s"] < 10.0
    assert out["prefill"]["b"] is None
    assert out["b"] == {"exact": True, "idle": True}


def test_a_decode_process_killed_mid_request_on_shm_ends_in_typed_errors_not_a_hang() -> None:
    """On shm (libfabric 1.17) a write whose target process died never completes, and the
    provider completes its endpoint's operations in order: every later write and message of
    the prefill's endpoint is held behind it, to every peer. Liveness turns that into typed
    errors within its timeout (1 s here) on both sides instead of a hang: the prefill fails
    the dead decoder's job with ``PeerUnreachable``, and decoder B, whose writes stopped
    completing, fails its request with ``PeerUnreachable`` too or has it land exactly (when
    its writes were through before A died). docs/concepts/failures.md, "A dead peer on shm".

    The prefill's job for B then ends ``PeerUnreachable``, or ``RemoteAccessError`` where B,
    its request failed, closed its decoder (deregistering the cache) while the prefill still
    had writes for it to post: those are refused at the prefill by B's region table
    (security.md) and never posted (before the table they waited behind A's write in the
    wedged endpoint)."""
    out = _run("shm", "decode_killed")
    assert out["a"] == "exited"
    assert out["prefill"]["a"] == "PeerUnreachable" and out["prefill"]["after_s"] < 10.0
    assert out["prefill"]["b"] in (None, "PeerUnreachable", "RemoteAccessError")
    assert out["b"] in ({"exact": True, "idle": True}, {"error": "PeerUnreachable"})
