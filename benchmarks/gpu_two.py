"""WriteImm GPU to GPU across two processes on two GPUs, against NCCL send/recv, in one run.

    python benchmarks/gpu_two.py --out two.json [--reps 7] [--latency-reps 200]

Rank 0 (GPU 0) writes into rank 1's GPU 1 memory. Both ranks hold a fabric-efa engine on shm
(which moves CUDA memory over CUDA IPC, here across the GPUs' NVLink) and an NCCL group. Per
size, alternating fabric and NCCL in every repetition: a burst of the same writes (fabric
WriteImm; NCCL ``send`` on rank 0, ``recv`` on rank 1), timed from rank 0's first call to
rank 1 having all of it (fabric: its counter reached the burst's ``imms_at_target``; NCCL: its
recvs synchronized). Both ranks read one monotonic clock (one host). Then the imm latency: a
4 KiB ping-pong, half the round trip, fabric against NCCL. The first burst of each size is
checked (a checksum of the bytes at rank 1). Medians over ``--reps``; ratios fabric/NCCL of
bandwidth. ``--fabric-only`` leaves NCCL's transfers out; with ``GPU_TWO_SAME_GPU=1`` both
ranks use GPU 0 and gloo (for diagnosis: NCCL refuses two ranks on one GPU; use it with
``--fabric-only``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

MiB = 1 << 20
SIZES = [64 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def _burst(size: int) -> int:
    return max(1, min(32, (256 * MiB) // size))


def _physical_cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (SMT siblings together)."""
    allowed = os.sched_getaffinity(0)
    cores: dict[str, list[int]] = {}
    for cpu in sorted(allowed):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        try:
            with open(path) as f:
                key = f.read().strip()
        except OSError:
            key = str(cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def _pin(rank: int) -> None:
    """``GPU_TWO_PIN=N`` (diagnosis): rank r gets N physical cores of its own. Its engine's
    worker runs alone on one CPU of the last (``FABRIC_WORKER_CPU``; that core's SMT siblings
    stay idle), its other threads on the other N-1 cores and their siblings, so that no thread
    migrates or shares a core with the worker."""
    n = int(os.environ.get("GPU_TWO_PIN", "0"))
    if n < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = _physical_cores()[rank * n : (rank + 1) * n]
    if len(cores) < n:
        return
    os.sched_setaffinity(0, {cpu for core in cores[:-1] for cpu in core})
    os.environ["FABRIC_WORKER_CPU"] = str(cores[-1][0])
    sys.stderr.write(f"rank {rank}: threads on {cores[:-1]}, worker on CPU {cores[-1][0]} of {cores[-1]}\n")


def _ranked(body: Callable[..., Any], rank: int, conn: Any, args: tuple[Any, ...]) -> None:
    try:
        _pin(rank)
        conn.send(("ok", body(rank, *args)))
    except BaseException as exc:
        import traceback

        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))


def run_two_ranks(body: Callable[..., Any], *args: Any) -> list[Any]:
    """``body(rank, *args)`` in a spawned process for rank 0 and one for rank 1 (``body`` must
    be a module-level function); their results in rank order. A rank that raises, or dies,
    ends the run with ``SystemExit`` naming it, never a hang. Shared by gpu_two_apps.py."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_ranked, args=(body, r, pipes[r][1], args)) for r in range(2)]
    for p in procs:
        p.start()
    for _, there in pipes:
        there.close()  # a rank that dies then ends our recv with EOFError, not a hang
    got = []
    for r in range(2):
        try:
            got.append(pipes[r][0].recv())
        except EOFError:
            got.append(("error", f"rank {r} died (exit code {procs[r].join(10) or procs[r].exitcode})"))
    for p in procs:
        p.join(60)
    bad = [body for status, body in got if status != "ok"]
    if bad:
        raise SystemExit("; ".join(bad))
    return [body for _, body in got]


def _body(rank: int, port: int, reps: int, latency_reps: int, nccl_on: bool = True) -> Any:
    import torch
    import torch.distributed as dist

    from fabric_core import MemoryRegionDescriptor, WriteRequest, open_engine

    same = bool(os.environ.get("GPU_TWO_SAME_GPU"))  # diagnosis: both ranks on GPU 0, gloo
    torch.cuda.set_device(0 if same else rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=40))  # type: ignore[attr-defined]
    dist.init_process_group(  # type: ignore[attr-defined]
        "gloo" if same else "nccl", store=dist.PrefixStore("pg", store), rank=rank, world_size=2
    )
    e = open_engine("efa", efa_provider="shm")
    top = max(SIZES)
    g = torch.Generator(device="cuda").manual_seed(1)
    buf = (
        torch.randint(0, 256, (top,), dtype=torch.uint8, device="cuda", generator=g)
        if rank == 0
        else (torch.zeros(top, dtype=torch.uint8, device="cuda"))
    )
    ping = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    r, rp = e.register(buf), e.register(ping)
    store.set(f"desc/{rank}", bytes(r.descriptor))
    store.set(f"ping/{rank}", bytes(rp.descriptor))
    peer = 1 - rank
    pdesc = MemoryRegionDescriptor.from_bytes(store.get(f"desc/{peer}"))
    pping = MemoryRegionDescriptor.from_bytes(store.get(f"ping/{peer}"))
    torch.cuda.synchronize()
    rows: list[dict[str, Any]] = []
    for i, size in enumerate(SIZES):
        imm, burst = 1000 + i, _burst(size)
        fab, nccl = [], []
        for rep in range(reps + 1):
            # fabric
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                sent = [e.submit(WriteRequest(r, 0, size, pdesc, 0, imm=imm)) for _ in range(burst)]
                store.set(f"n/{i}/{rep}", str(sum(t.imms_at_target for t in sent)))
                for t in sent:  # a failed write raises here rather than leave the peer waiting
                    t.wait(timeout=30)
                end = float(store.get(f"t/{i}/{rep}"))
                fab.append(end - t0)
            else:
                n = int(store.get(f"n/{i}/{rep}"))
                e.counter(imm).wait(n, timeout=30)  # a wait consumes what it counted
                store.set(f"t/{i}/{rep}", repr(time.perf_counter()))
                if rep == 0:
                    store.set(f"sum/{i}", str(int(buf[:size].to(torch.int64).sum().item())))
                    buf[:size].zero_()
                    torch.cuda.synchronize()
            # NCCL
            dist.barrier()
            torch.cuda.synchronize()
            if not nccl_on:
                nccl.append(float("nan"))
            elif rank == 0:
                t0 = time.perf_counter()
                for _ in range(burst):
                    dist.send(buf[:size], 1)
                torch.cuda.synchronize()
                end = float(store.get(f"u/{i}/{rep}"))
                nccl.append(end - t0)
            else:
                for _ in range(burst):
                    dist.recv(buf[:size], 0)
                torch.cuda.synchronize()
                store.set(f"u/{i}/{rep}", repr(time.perf_counter()))
        if rank == 0:
            want = int(buf[:size].to(torch.int64).sum().item())
            got = int(store.get(f"sum/{i}"))
            if got != want:
                raise SystemExit(f"fabric wrote wrong bytes at {size}: checksum {got} != {want}")
            f, c = statistics.median(fab[1:]), statistics.median(nccl[1:])
            rows.append(
                {
                    "bytes": size,
                    "burst": burst,
                    "fabric_gbytes_per_s": size * burst / f / 1e9,
                    "nccl_gbytes_per_s": size * burst / c / 1e9,
                    "ratio": c / f,
                }
            )
    # latency: 4 KiB ping-pong, half the round trip
    lat: dict[str, list[float]] = {"fabric": [], "nccl": []}
    count = 20 + latency_reps
    dist.barrier()
    for k in range(count):
        if rank == 0:
            t0 = time.perf_counter()
            e.submit(WriteRequest(rp, 0, 4096, pping, 0, imm=2000))
            e.counter(2001).wait(1, timeout=60)
            if k >= 20:
                lat["fabric"].append((time.perf_counter() - t0) / 2)
        else:
            e.counter(2000).wait(1, timeout=60)
            e.submit(WriteRequest(rp, 0, 4096, pping, 0, imm=2001))
    dist.barrier()
    for k in range(count if nccl_on else 0):
        if rank == 0:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.send(ping, 1)
            dist.recv(ping, 1)
            torch.cuda.synchronize()
            if k >= 20:
                lat["nccl"].append((time.perf_counter() - t0) / 2)
        else:
            dist.recv(ping, 0)
            dist.send(ping, 0)
    dist.barrier()
    out = None
    if rank == 0:
        out = {
            "bandwidth": rows,
            "latency_us": {
                k: {"p50": statistics.median(v) * 1e6, "p99": sorted(v)[int(0.99 * (len(v) - 1))] * 1e6}
                for k, v in lat.items()
                if v
            },
            "gpus": [torch.cuda.get_device_name(d) for d in range(torch.cuda.device_count())],
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "p2p": torch.cuda.can_device_access_peer(0, 1),
        }
    e.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--latency-reps", type=int, default=200)
    ap.add_argument("--fabric-only", action="store_true", help="Leave NCCL's transfers out.")
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    result = run_two_ranks(_body, store.port, args.reps, args.latency_reps, not args.fabric_only)[0]
    result["reps"] = args.reps
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in result["bandwidth"]:
        sys.stdout.write(
            f"{row['bytes'] >> 10:>8} KiB x{row['burst']:<3} fabric {row['fabric_gbytes_per_s']:7.1f} GB/s  "
            f"NCCL {row['nccl_gbytes_per_s']:7.1f} GB/s  fabric/NCCL {row['ratio']:.2f}\n"
        )
    sys.stdout.write(f"4 KiB half round trip (us): {json.dumps(result['latency_us'])}\n")


if __name__ == "__main__":
    main()
