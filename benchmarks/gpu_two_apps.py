"""KvCache and the weights update GPU to GPU, one process per GPU, against NCCL equivalents of
the same transfers in the same run.

    python benchmarks/gpu_two_apps.py --out two-apps.json [--reps 5] [--only kv|weights]

Rank 0 (GPU 0) is the prefill instance / the trainer, rank 1 (GPU 1) the decode instance /
the inference rank. Both hold a fabric-efa engine on shm (CUDA memory over CUDA IPC: NVLink
between the two GPUs) and an NCCL group. Per repetition fabric and NCCL alternate.

KvCache: a Llama-3.1-70B request of 4096 tokens (256 pages x 80 layers x K, V of 32 KiB:
1.34 GB) into the decoder's paged cache at pages its allocator chose, from source pages that
are scattered too. fabric: ``KvDecoder.receive`` (the request goes out through the engine) to
every page of every layer landed (paged WriteImm, one work request per page and layer).
NCCL equivalent: the decoder signals through the Store; the prefill gathers each layer's
pages into a contiguous buffer (``index_select``) and ``send``s it; the decoder ``recv``s it
and scatters it into its pages (``index_copy_``), layer by layer; timed from the signal to the
decoder's stream done. Both land the same bytes: the first repetition of each is checked
page for page.

Weights: a synthetic 2 GB bf16 model (``fabric bench rl``'s) from one trainer to one inference
rank, plain (``--cast`` none) and cast to fp8 on the way (``float8_e4m3fn``). fabric:
``WeightsSender.send_step`` to ``WeightsReceiver.wait_step`` at the inference rank (the plan's
writes, casts through the staging pool). NCCL equivalent: the same plan's writes as NCCL
``send``/``recv`` of each range (cast by ``torch`` first where the plan casts). Timed from the
trainer's start to the inference rank holding every byte (one monotonic clock: one host).
Both destination buffers are compared byte for byte.

The weights landed are also checked against the plan applied by ``torch`` at the inference
rank (the trainer's buffer made again from its seed), with or without NCCL.

``GPU_TWO_APPS_CPU=1`` runs the same on host memory with gloo (a check of the script on a
machine without GPUs; its figures mean nothing), ``GPU_TWO_APPS_LAYERS=n`` with n KV layers.
``GPU_TWO_APPS_SAME_GPU=1`` puts both ranks on GPU 0 and leaves the NCCL halves out (NCCL
refuses two ranks on one GPU): fabric's figures and checks only, on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("FI_TCP_IFACE", "lo")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_apps
from gpu_apps import KV_BLOCKS, KV_PAGES, _kv_src
from gpu_two import run_two_ranks

WEIGHT_BYTES = 2 << 30
DEV = "cpu" if os.environ.get("GPU_TWO_APPS_CPU") else "cuda"
KV_LAYERS = int(os.environ.get("GPU_TWO_APPS_LAYERS", "80"))  # fewer for the script's check on CPU
# "stacked" ([2, blocks, ...] per layer: vLLM's flash-attn layout; K and V of a page are two
# 32 KiB writes) or "interleaved" ([blocks, 2, ...]: FlashInfer's; one 64 KiB write per page)
KV_SPLIT = os.environ.get("GPU_TWO_APPS_KV_SPLIT", "stacked")
PAGE_DIM = 1 if KV_SPLIT == "stacked" else 0
SAME = bool(os.environ.get("GPU_TWO_APPS_SAME_GPU"))
# the NCCL (or, on CPU, gloo) halves; GPU_TWO_APPS_FABRIC_ONLY=1 leaves them out (profiling)
BASELINE = not SAME and not os.environ.get("GPU_TWO_APPS_FABRIC_ONLY")
# GPU_TWO_APPS_WARM_FILE=path: the decoder creates it once two KvCache requests have landed
# (benchmarks/device/perf_kv.sh starts sampling then, not during the set-up)
WARM_FILE = os.environ.get("GPU_TWO_APPS_WARM_FILE", "")


def _sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def _kv_layout() -> Any:
    """Llama-3.1-70B's (with KV_LAYERS layers)."""
    from fabric_apps.kvcache import llama31_70b

    return dataclasses.replace(llama31_70b(KV_BLOCKS, kv_split=KV_SPLIT), num_layers=KV_LAYERS)  # type: ignore[arg-type]


def _kv_caches(fill: bool) -> list[Any]:
    return gpu_apps._kv_caches(fill, DEV, KV_LAYERS, KV_SPLIT)


def _pages_of(cache: Any, pages: Any) -> Any:
    """``cache``'s K and V of ``pages`` (an index tensor), whatever the layout."""
    return cache[:, pages] if PAGE_DIM == 1 else cache[pages]


def _body(rank: int, port: int, reps: int, only: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fabric_core import open_engine

    if DEV == "cuda":
        torch.cuda.set_device(0 if SAME else rank)  # before the engine: its CUDA IPC domain binds to it
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))  # type: ignore[attr-defined]
    dist.init_process_group(  # type: ignore[attr-defined]
        "nccl" if DEV == "cuda" and not SAME else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=2,
    )
    engine = open_engine("efa", efa_provider="shm")
    out: dict[str, Any] = {"details": {k: str(v) for k, v in engine.domains[0].details.items()}}
    try:
        if only in (None, "kv"):
            out["kvcache"] = _kv(rank, store, engine, reps)
        if only in (None, "weights"):
            out["weights"] = [_weights(rank, store, engine, reps, cast) for cast in (None, "float8_e4m3fn")]
    finally:
        engine.close()
        dist.destroy_process_group()
    return out


def _kv(rank: int, store: Any, engine: Any, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fabric_apps.kvcache import KvDecoder, KvPrefiller
    from fabric_core.models import DomainAddress

    layout = _kv_layout()
    caches = _kv_caches(rank == 0)
    src = torch.as_tensor(_kv_src(), dtype=torch.int64, device=DEV)
    _sync()
    fab: list[float] = []
    nccl: list[float] = []
    if rank == 0:
        pf = KvPrefiller(engine, layout, caches, timeout=60)
        store.set("kv/prefill", pf.address.raw)
        stage = [torch.empty_like(caches[0].narrow(PAGE_DIM, 0, KV_PAGES)) for _ in range(KV_LAYERS)]
        stamps = []  # per repetition: request in hand, every layer submitted, every write done
        for rep in range(reps + 1):
            req = pf.next_request(60)
            t_req = time.perf_counter()
            job = pf.begin(req, _kv_src(), timeout=60)
            for layer in range(KV_LAYERS):
                job.write_layer(layer)
            t_sub = time.perf_counter()
            job.wait(60)
            stamps.append((t_req, t_sub, time.perf_counter()))
            if not BASELINE:
                continue
            store.get(f"kv/nccl-go/{rep}")  # the decoder asks
            for layer in range(KV_LAYERS):
                torch.index_select(caches[layer], PAGE_DIM, src, out=stage[layer])
                dist.send(stage[layer], 1)
            _sync()
        store.set("kv/prefill-stamps", json.dumps(stamps))
        store.get("kv/done")
        pf.close(timeout=10)
        return {}
    dec = KvDecoder(engine, layout, caches, timeout=60)
    prefill = DomainAddress(raw=store.get("kv/prefill"))
    dec.connect(prefill, timeout=60)
    want = _kv_caches(True)
    stage = [torch.empty_like(caches[0].narrow(PAGE_DIM, 0, KV_PAGES)) for _ in range(KV_LAYERS)]
    starts: list[float] = []
    calls: list[float] = []  # the decoder's receive() call alone

    def check(pages: Any, what: str) -> None:
        for layer in range(KV_LAYERS):
            a = _pages_of(caches[layer], pages).view(torch.int16)
            b = _pages_of(want[layer], src).view(torch.int16)
            if not torch.equal(a, b):
                raise SystemExit(f"kvcache ({what}): layer {layer} differs from the prefill's pages")

    for rep in range(reps + 1):
        t0 = time.perf_counter()
        h = dec.receive(prefill, f"seq{rep}", KV_PAGES)
        calls.append(time.perf_counter() - t0)
        h.wait(60)
        fab.append(time.perf_counter() - t0)
        starts.append(t0)
        if rep == 1 and WARM_FILE:  # past the first (mapping, checked) requests: a profiler may start
            open(WARM_FILE, "w").close()
        pages = torch.as_tensor(h.pages, dtype=torch.int64, device=DEV)
        if rep == 0:
            check(pages, "fabric")
            for layer in range(KV_LAYERS):
                if PAGE_DIM == 1:
                    caches[layer][:, pages] = 0
                else:
                    caches[layer][pages] = 0
            _sync()
        if not BASELINE:
            h.release()
            continue
        # NCCL, into the same pages
        t0 = time.perf_counter()
        store.set(f"kv/nccl-go/{rep}", "1")
        for layer in range(KV_LAYERS):
            dist.recv(stage[layer], 0)
            caches[layer].index_copy_(PAGE_DIM, pages, stage[layer])
        _sync()
        nccl.append(time.perf_counter() - t0)
        if rep == 0:
            check(pages, "NCCL")
        h.release()
    stamps = json.loads(store.get("kv/prefill-stamps"))
    store.set("kv/done", "1")
    dec.close(timeout=10)
    nbytes = KV_LAYERS * 2 * KV_PAGES * 16 * 8 * 128 * 2
    f = statistics.median(fab[1:])  # the first maps the peer's memory
    c = statistics.median(nccl[1:]) if nccl else float("nan")
    # where a request's time goes (one host, one monotonic clock): the request reaching the
    # prefill, its Python submitting every layer, the writes landing after that
    phases = {
        "decoder_receive_call_ms": [c * 1e3 for c in calls][1:],
        "request_to_prefill_ms": [(s[0] - t0) * 1e3 for s, t0 in zip(stamps, starts, strict=True)][1:],
        "prefill_submit_ms": [(s[1] - s[0]) * 1e3 for s in stamps][1:],
        "prefill_submitted_to_done_ms": [(s[2] - s[1]) * 1e3 for s in stamps][1:],
        "prefill_done_to_decoder_done_ms": [
            (t0 + d - s[2]) * 1e3 for s, t0, d in zip(stamps, starts, fab, strict=True)
        ][1:],
    }
    writes = KV_LAYERS * KV_PAGES * (1 if KV_SPLIT == "interleaved" else 2)
    return {
        "request": f"Llama-3.1-70B, 4096 tokens: 256 pages x 80 layers x K,V of 32 KiB, scattered both ends, "
        f"{KV_SPLIT} caches",
        "kv_split": KV_SPLIT,
        "bytes": nbytes,
        "work_requests": writes,
        "phases_median_ms": {k: statistics.median(v) for k, v in phases.items()},
        "fabric_ms": f * 1e3,
        "nccl_ms": c * 1e3,
        "fabric_gb_s": nbytes / f / 1e9,
        "nccl_gb_s": nbytes / c / 1e9,
        "fabric_over_nccl_time": f / c,
        "fabric_ms_all": [x * 1e3 for x in fab],
        "nccl_ms_all": [x * 1e3 for x in nccl],
    }


def _trainer_buffer(source: Any) -> Any:
    """The trainer's buffer: random bf16 values that stay finite (exponent bits kept small, so
    casts are defined), from a fixed seed, so that the inference rank can make it again."""
    import torch

    buf = source.layout(0).allocate(DEV)
    g = torch.Generator(device=DEV).manual_seed(11)
    buf.view(torch.int16).copy_(
        torch.randint(0, 1 << 14, (buf.numel() // 2,), generator=g, device=DEV, dtype=torch.int16)
    )
    _sync()
    return buf


def _entry_bytes(src: Any, e: Any) -> Any:
    """The bytes one plan write lands: its source range, cast by torch where the plan casts."""
    import torch

    piece = src[e.src_offset : e.src_offset + e.src_length]
    if e.cast is not None:
        piece = piece.view(getattr(torch, e.cast[0])).to(getattr(torch, e.cast[1])).view(torch.uint8)
    return piece.contiguous()


def _apply_plan(entries: list[Any], src: Any, dst: Any) -> Any:
    """The plan's writes done by torch: what the destination must hold."""

    for e in entries:
        dst[e.dst_offset : e.dst_offset + e.length].copy_(_entry_bytes(src, e))
    _sync()
    return dst


def _weights(rank: int, store: Any, engine: Any, reps: int, cast: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fabric_apps.weights import WeightsReceiver, WeightsSender, make_plan
    from fabric_apps.weights.bench import synthetic_model

    source, destination = synthetic_model(WEIGHT_BYTES, 1, 1, cast=cast)
    plan = make_plan(source, destination)
    entries = list(plan.entries())
    if any(e.count > 1 for e in entries):
        raise SystemExit("the NCCL equivalent does not pack: a 1 -> 1 plan should have no packed writes")
    tag = cast or "bf16"
    prefix = f"w/{tag}"
    fab: list[float] = []
    nccl: list[float] = []
    if rank == 0:
        buf = _trainer_buffer(source)
        sender = WeightsSender.connect(
            engine, store, rank=0, source=source, buffer=buf, prefix=prefix, timeout=120
        )
        for rep in range(reps + 1):
            store.get(f"{prefix}/ready/{rep}")
            t0 = time.perf_counter()
            store.set(f"{prefix}/t0/{rep}", repr(t0))
            sender.send_step(rep + 1, timeout=120)
            if not BASELINE:
                continue
            store.get(f"{prefix}/nccl-ready/{rep}")
            t0 = time.perf_counter()
            store.set(f"{prefix}/u0/{rep}", repr(t0))
            for e in entries:
                dist.send(_entry_bytes(buf, e), 1)
            _sync()
        store.get(f"{prefix}/done")
        sender.close()
        return {}
    layout = destination.layout(0)
    buf = layout.allocate(DEV)
    ref = layout.allocate(DEV)
    receiver = WeightsReceiver.connect(
        engine, store, rank=0, destination=destination, buffer=buf, prefix=prefix, timeout=120
    )
    expected = _apply_plan(entries, _trainer_buffer(source), layout.allocate(DEV))
    for rep in range(reps + 1):
        store.set(f"{prefix}/ready/{rep}", "1")
        receiver.wait_step(rep + 1, timeout=120)
        t1 = time.perf_counter()
        fab.append(t1 - float(store.get(f"{prefix}/t0/{rep}")))
        if rep == 0 and not torch.equal(buf, expected):
            bad = int((buf != expected).sum().item())
            raise SystemExit(
                f"weights ({tag}): fabric landed other bytes than the plan applied by torch ({bad})"
            )
        if not BASELINE:
            continue
        store.set(f"{prefix}/nccl-ready/{rep}", "1")
        for e in entries:
            dist.recv(ref[e.dst_offset : e.dst_offset + e.length], 0)
        _sync()
        t1 = time.perf_counter()
        nccl.append(t1 - float(store.get(f"{prefix}/u0/{rep}")))
        if rep == 0 and not torch.equal(buf, ref):
            bad = int((buf != ref).sum().item())
            raise SystemExit(f"weights ({tag}): fabric and NCCL landed different bytes ({bad} differ)")
    store.set(f"{prefix}/done", "1")
    receiver.close()
    f = statistics.median(fab[1:])
    c = statistics.median(nccl[1:]) if nccl else float("nan")
    return {
        "model": f"synthetic {WEIGHT_BYTES / 1e9:.1f} GB bf16, 1 trainer -> 1 inference rank",
        "cast": cast,
        "writes": len(entries),
        "bytes_landed": plan.total_bytes,
        "fabric_ms": f * 1e3,
        "nccl_ms": c * 1e3,
        "fabric_over_nccl_time": f / c,
        "fabric_ms_all": [x * 1e3 for x in fab],
        "nccl_ms_all": [x * 1e3 for x in nccl],
    }


def main() -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=["kv", "weights"], default=None)
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    result = run_two_ranks(_body, store.port, args.reps, args.only)[1]
    result["reps"] = args.reps
    result["gpus"] = [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())]
    result["torch"] = torch.__version__
    result["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if DEV == "cuda" else None
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if "kvcache" in result:
        kv = result["kvcache"]
        phases = kv["phases_median_ms"]
        sys.stdout.write(
            f"kvcache: fabric {kv['fabric_ms']:.1f} ms ({kv['fabric_gb_s']:.1f} GB/s), "
            f"NCCL {kv['nccl_ms']:.1f} ms ({kv['nccl_gb_s']:.1f} GB/s): "
            f"fabric/NCCL time {kv['fabric_over_nccl_time']:.2f} ({kv['kv_split']} caches, "
            f"{kv['work_requests']} writes)\n"
            f"  phases (median ms): {json.dumps({k: round(v, 2) for k, v in phases.items()})}\n"
        )
    for w in result.get("weights", []):
        sys.stdout.write(
            f"weights ({w['cast'] or 'bf16'}, {w['writes']} writes): fabric {w['fabric_ms']:.1f} ms, NCCL "
            f"{w['nccl_ms']:.1f} ms: fabric/NCCL time {w['fabric_over_nccl_time']:.2f}\n"
        )
    sys.stdout.write(f"details: {json.dumps(result['details'])}\n")


if __name__ == "__main__":
    main()
