"""The apps with GPU buffers, in two processes of one host, on fabric-efa over shm (CUDA
memory over the CUDA IPC domain).

    python benchmarks/gpu_apps.py --out apps.json [--steps 50] [--kv-reps 5]

KvCache: a Llama-3.1-70B request of 4096 tokens (256 pages of 16 tokens, 80 layers, K and V:
1.34 GB) from a prefill process into a decode process's paged cache, timed in the decoder
from ``receive`` (the request goes out) to every page of every layer landed; against the
same pages gathered and scattered by ``torch`` on the GPU (one index copy per layer), the
device-side ceiling. The first request is checked page for page.

MoE:
Each rank is a process of its own with its own engine; both use the one GPU the machine lends
(two GPUs, and so NCCL between them, were not available: NCCL refuses two ranks on one GPU).
Shapes: DeepSeek-V3-like (256 experts, top-8, hidden 7168, bf16), EP2, at decode (128 tokens
per rank) and prefill (4096). A step is ``dispatch_send`` → ``dispatch_recv`` → experts (a
row-wise scale, on the GPU) → ``combine_send`` → ``combine_recv``. Dispatch (send + recv)
and combine (send + recv) are timed apart, the experts not at all; the ranks meet at a
barrier before each, and a phase's time is the slower rank's. Step 0 of each shape is
checked bit for bit against ``reference_moe``; warm-up steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("FI_TCP_IFACE", "lo")
# one intra-op CPU thread per rank, as torchrun sets: each process's OpenMP pool otherwise
# spins on every core against the other rank's and the engines' threads (measured: a
# two-element repeat_interleave took 8.8 ms in dispatch_recv)
os.environ.setdefault("OMP_NUM_THREADS", "1")

SHAPES = {"decode": 128, "prefill": 4096}
EXPERTS, TOP_K, HIDDEN = 256, 8, 7168


def _expert(expert: int, rows: Any) -> Any:
    import torch

    return (rows.to(torch.float32) * (1.0 + expert / 64.0)).to(rows.dtype)


def _inputs(tokens: int, rank: int, seed: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed * 2 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    w = torch.rand(tokens, TOP_K, generator=g)
    return x, idx, w


def _rank(rank: int, conn: Any, barrier: Any, steps: int, warmup: int, profile: str | None) -> None:
    import cProfile
    import pstats

    import torch

    from fabric_apps.moe import MoeAllToAll, MoeConfig, apply_experts, reference_moe
    from fabric_core import open_engine

    torch.cuda.set_device(rank % torch.cuda.device_count())  # a GPU per rank where there are two
    engine = open_engine("efa", efa_provider="shm")
    out: dict[str, Any] = {"cuda_memory": engine.domains[0].details["cuda_memory"]}
    for name, tokens in SHAPES.items():
        config = MoeConfig(2, rank, EXPERTS, HIDDEN, TOP_K, tokens, device="cuda")
        moe = MoeAllToAll(engine, config, layer=1 if name == "decode" else 2)
        conn.send(moe.endpoint.to_bytes())
        moe.connect(conn.recv())
        x, idx, w = _inputs(tokens, rank, 0)
        xg, idxg, wg = x.cuda(), idx.cuda(), w.cuda()
        dispatch, combine = [], []
        prof = cProfile.Profile() if profile and rank == 0 else None
        for step in range(warmup + steps):
            barrier.wait(timeout=120)
            if prof and step == warmup:
                prof.enable()
            t0 = time.perf_counter()
            moe.dispatch_send(xg, idxg, wg)
            got = moe.dispatch_recv(timeout=60)
            torch.cuda.synchronize()
            dispatch.append(time.perf_counter() - t0)
            outputs = apply_experts(got, _expert)  # the experts: not timed
            torch.cuda.synchronize()
            barrier.wait(timeout=120)
            t0 = time.perf_counter()
            moe.combine_send(outputs)
            y = moe.combine_recv(timeout=60)
            torch.cuda.synchronize()
            combine.append(time.perf_counter() - t0)
            if step == 0:
                conn.send((x, idx, w))
                xs, idxs, ws = conn.recv()
                want = reference_moe(config, xs, idxs, ws, _expert)[rank]
                if not torch.equal(y.cpu().view(torch.uint8), want.view(torch.uint8)):
                    raise SystemExit(f"rank {rank} {name}: combined bytes differ from the reference")
        out[name] = (dispatch[warmup:], combine[warmup:])
        if prof:
            prof.disable()
            with open(f"{profile}.{name}.txt", "w") as f:
                stats = pstats.Stats(prof, stream=f)
                stats.sort_stats("cumulative").print_stats(60)
                stats.sort_stats("tottime").print_stats(40)
        moe.close()
    conn.send(out)
    engine.close()


KV_LAYERS, KV_BLOCKS, KV_PAGES = 80, 512, 256


def _kv_caches(
    fill: bool, device: str = "cuda", layers: int = KV_LAYERS, kv_split: str = "stacked"
) -> list[Any]:
    """``layers`` Llama-3.1-70B layer caches on ``device`` (``kv_split`` layout): zeros, or
    random (seed 9, so that another process makes the same ones)."""
    import torch

    from fabric_apps.kvcache import llama31_70b

    shape = llama31_70b(KV_BLOCKS, kv_split=kv_split).accepted_shapes()[0]  # type: ignore[arg-type]
    g = torch.Generator(device=device).manual_seed(9)
    if not fill:
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    return [
        torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device, generator=g).view(
            torch.bfloat16
        )
        for _ in range(layers)
    ]


def _kv_src() -> Any:
    import torch

    return torch.randperm(KV_BLOCKS, generator=torch.Generator().manual_seed(5))[:KV_PAGES].numpy()


def _kv_prefill(conn: Any, reps: int) -> None:
    import torch

    from fabric_apps.kvcache import KvPrefiller, llama31_70b
    from fabric_core import open_engine

    torch.cuda.set_device(0)
    engine = open_engine("efa", efa_provider="shm")
    caches = _kv_caches(True)
    torch.cuda.synchronize()
    pf = KvPrefiller(engine, llama31_70b(KV_BLOCKS), caches, timeout=60)
    conn.send(pf.address.raw)
    src = _kv_src()
    for _ in range(reps):
        job = pf.begin(pf.next_request(60), src, timeout=60)
        for layer in range(KV_LAYERS):
            job.write_layer(layer)
        job.wait(60)
    conn.recv()  # the decoder is done
    pf.close(timeout=10)
    engine.close()


def _kv_decode(conn: Any, reps: int) -> None:
    import torch

    from fabric_apps.kvcache import KvDecoder, llama31_70b
    from fabric_core import open_engine
    from fabric_core.models import DomainAddress

    torch.cuda.set_device(0)
    engine = open_engine("efa", efa_provider="shm")
    caches = _kv_caches(False)
    dec = KvDecoder(engine, llama31_70b(KV_BLOCKS), caches, timeout=60)
    prefill = DomainAddress(raw=conn.recv())
    dec.connect(prefill, timeout=60)
    times = []
    for rep in range(reps):
        t0 = time.perf_counter()
        h = dec.receive(prefill, f"seq{rep}", KV_PAGES)
        h.wait(60)
        times.append(time.perf_counter() - t0)
        if rep == 0:
            want = _kv_caches(True)
            pages = torch.as_tensor(h.pages, dtype=torch.int64, device="cuda")
            src = torch.as_tensor(_kv_src(), dtype=torch.int64, device="cuda")
            for layer in range(KV_LAYERS):
                a = caches[layer][:, pages].view(torch.int16)
                b = want[layer][:, src].view(torch.int16)
                if not torch.equal(a, b):
                    raise SystemExit(f"kvcache: layer {layer} differs from the prefill's pages")
            # the ceiling: the same pages gathered and scattered on the GPU by torch
            ceiling = []
            for _ in range(5):
                torch.cuda.synchronize()
                c0 = time.perf_counter()
                for layer in range(KV_LAYERS):
                    caches[layer][:, pages] = want[layer][:, src]
                torch.cuda.synchronize()
                ceiling.append(time.perf_counter() - c0)
            del want
        h.release()
    conn.send({"times": times, "ceiling": ceiling})
    dec.close(timeout=10)
    engine.close()


def bench_kv(reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    (p_here, p_there), (d_here, d_there) = ctx.Pipe(), ctx.Pipe()
    procs = [
        ctx.Process(target=_kv_prefill, args=(p_there, reps), daemon=True),
        ctx.Process(target=_kv_decode, args=(d_there, reps), daemon=True),
    ]
    for p in procs:
        p.start()
    p_there.close()  # a child that dies then ends our recv with EOFError, not a hang
    d_there.close()
    d_here.send(p_here.recv())  # the prefill's address
    got = d_here.recv()
    p_here.send(None)
    for p in procs:
        p.join(60)
    nbytes = KV_LAYERS * 2 * KV_PAGES * 16 * 8 * 128 * 2
    fabric_s = statistics.median(got["times"][1:] or got["times"])  # the first maps the peer's memory
    ceiling_s = statistics.median(got["ceiling"])
    return {
        "request": "Llama-3.1-70B, 4096 tokens: 256 pages x 80 layers x K,V of 32 KiB",
        "bytes": nbytes,
        "fabric_s": fabric_s,
        "fabric_gb_s": nbytes / fabric_s / 1e9,
        "torch_index_copy_s": ceiling_s,
        "torch_index_copy_gb_s": nbytes / ceiling_s / 1e9,
        "reps": len(got["times"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kv-reps", type=int, default=5)
    ap.add_argument("--only", choices=["kv", "moe"], default=None)
    ap.add_argument("--profile", metavar="PREFIX", help="cProfile rank 0's MoE steps into PREFIX.<shape>.txt")
    args = ap.parse_args()
    report: dict[str, Any] = {}
    if args.only != "moe":
        report["kvcache"] = bench_kv(args.kv_reps)
        kv = report["kvcache"]
        sys.stdout.write(
            f"kvcache: {kv['fabric_s'] * 1e3:.1f} ms ({kv['fabric_gb_s']:.1f} GB/s) against torch index "
            f"copies {kv['torch_index_copy_s'] * 1e3:.1f} ms ({kv['torch_index_copy_gb_s']:.1f} GB/s)\n"
        )
        sys.stdout.flush()
    if args.only == "kv":
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [
        ctx.Process(
            target=_rank, args=(r, pipes[r][1], barrier, args.steps, args.warmup, args.profile), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for _, there in pipes:
        there.close()
    conns = [p[0] for p in pipes]
    for _ in SHAPES:
        endpoints = [c.recv() for c in conns]
        for c in conns:
            c.send(endpoints)
        inputs = [c.recv() for c in conns]
        both = ([i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs])
        for c in conns:
            c.send(both)
    results = [c.recv() for c in conns]
    for p in procs:
        p.join(60)
    import torch

    report |= {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ranks": f"2 processes, {min(2, torch.cuda.device_count())} GPU(s)",
        "shape": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "dtype": "bfloat16"},
        "cuda_memory": results[0]["cuda_memory"],
        "steps": args.steps,
    }
    for name in SHAPES:
        report[name] = {"tokens_per_rank": SHAPES[name]}
        for i, phase in enumerate(("dispatch", "combine")):
            # a phase's time is the slower rank's
            pairs = zip(results[0][name][i], results[1][name][i], strict=True)
            per_step = sorted(max(a, b) for a, b in pairs)
            p50 = statistics.median(per_step) * 1e6
            p99 = per_step[min(len(per_step) - 1, int(len(per_step) * 0.99))] * 1e6
            report[name][phase] = {"p50_us": p50, "p99_us": p99}
            sys.stdout.write(f"{name:>8} {phase:>8}: p50 {p50:.0f} us, p99 {p99:.0f} us\n")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
