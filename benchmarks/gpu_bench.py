"""GPU memory through the contract, on one GPU: registration cost, GPU-to-GPU write bandwidth
against a device-to-device copy (the ceiling), and imm latency to a GPU-side wait.

    python benchmarks/gpu_bench.py --out results.json [--plot results.png] [--reps 9]

What runs, side by side in one process tree (medians over ``--reps``):

* ``register``: ``register`` + ``deregister`` of a CUDA tensor of each size, on the simulator
  (the driver's checks only) and on fabric-efa's shm provider (FI_HMEM_CUDA: the provider
  takes a CUDA IPC handle).
* ``bandwidth``: WriteImm of each size, GPU memory to GPU memory, from this process to
  another process's engine on the same GPU (fabric-efa over shm, which moves CUDA memory by
  CUDA IPC), timed from the first ``submit`` of a burst to the last imm counted at the
  target; against ``torch`` copying the same bytes device to device in bursts of the same
  length, and the simulator (in-process, its device copies) for reference.
* ``imm_latency``: a 4 KiB WriteImm ping-pong between the two processes, GPU memory to GPU
  memory: half the round trip, p50/p99.
* ``device_wait``: the time from a write's ``submit`` to the GPU work queued behind a
  ``DeviceCounter.wait`` finishing, against the host-side path (``counter.wait()`` on the
  host, then launch the same work); measured in one process with the simulator and with two
  efa shm engines.
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
# before CUDA starts: see docs/gpu.md, "Hazards" (lazy kernel loading and shared hardware
# queues would put this process's own first launches and copies behind its GPU-side waits)
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch

from fabric_core import (
    MemoryRegionDescriptor,
    WriteRequest,
    cuda,
    open_engine,
)
from fabric_sim import SimFabric

MiB = 1 << 20
SIZES = [64 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _efa() -> Any | None:
    try:
        import fabric_efa  # noqa: F401
    except ImportError:
        return None
    e = open_engine("efa", efa_provider="shm")
    if not e.capabilities.cuda_memory:
        e.close()
        return None
    return e


def _efa_verdict() -> str:
    try:
        import fabric_efa  # noqa: F401
    except ImportError:
        return "fabric-efa not installed"
    e = open_engine("efa", efa_provider="shm")
    verdict = str(e.domains[0].details.get("cuda_memory"))
    e.close()
    return verdict


def bench_register(reps: int) -> list[dict[str, Any]]:
    rows = []
    sim = SimFabric(0).open_engine(nics=1)
    efa = _efa()
    for size in [MiB, 64 * MiB, 1024 * MiB]:
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        for name, e in (("sim", sim), ("efa-shm", efa)):
            if e is None:
                continue
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r = e.register(t)
                e.deregister(r)
                times.append(time.perf_counter() - t0)
            rows.append({"backend": name, "bytes": size, "register_deregister_us": _median(times) * 1e6})
        del t
    sim.close()
    if efa is not None:
        efa.close()
    return rows


def _target(conn: Any, size: int) -> None:
    """The other process: an efa shm engine with a CUDA buffer; counts imms, reports done."""
    e = open_engine("efa", efa_provider="shm")
    buf = torch.zeros(size, dtype=torch.uint8, device="cuda")
    r = e.register(buf)
    conn.send(bytes(r.descriptor))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "pong":  # answer each imm with a 4 KiB write back
            _, peer_desc, imm, back, count = msg
            back_desc = MemoryRegionDescriptor.from_bytes(peer_desc)
            for _ in range(count):
                e.counter(imm).wait(1, timeout=60)
                e.submit(WriteRequest(r, 0, 4096, back_desc, 0, imm=back))
            conn.send(0)
            continue
        imm, n, check = msg
        e.counter(imm).wait(n, timeout=60)
        conn.send(int(buf[:check].to(torch.int64).sum().item()) if check else 0)
    e.close()


def _burst(size: int) -> int:
    """Writes (and copies) of ``size`` timed together: 256 MiB or 64 of them, at least one,
    so that fixed costs (a sync, the target's answer through a pipe) are spread alike."""
    return max(1, min(64, max(SIZES) // size))


def bench_bandwidth(reps: int, latency_reps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    top = max(SIZES)
    src = torch.randint(0, 256, (top,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(top, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    # the ceiling: torch device-to-device copies, a burst of them then one sync
    for size in SIZES:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(_burst(size)):
                dst[:size].copy_(src[:size])
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / _burst(size))
        rows.append({"path": "torch-d2d-copy", "bytes": size, "seconds": _median(times)})
    # the simulator, in process (one NIC: one device copy per chunk)
    fabric = SimFabric(0, chunk_bytes=64 * MiB)
    a, b = fabric.open_engine(nics=1), fabric.open_engine(nics=1)
    rs, rd = a.register(src), b.register(dst)
    for i, size in enumerate(SIZES):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a.submit(WriteRequest(rs, 0, size, rd.descriptor, 0, imm=100 + i))
            b.counter(100 + i).wait(1, timeout=60)
            times.append(time.perf_counter() - t0)
        rows.append({"path": "sim-writeimm", "bytes": size, "seconds": _median(times)})
    assert torch.equal(src[: SIZES[-1]], dst[: SIZES[-1]])
    a.close()
    b.close()
    # fabric-efa over shm, to another process on this GPU
    probe = _efa()
    if probe is None:
        return rows, latency
    probe.close()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, top), daemon=True)
    proc.start()
    try:
        desc = MemoryRegionDescriptor.from_bytes(here.recv())
        e = open_engine("efa", efa_provider="shm")
        rsrc = e.register(src)
        want = int(src[: 4 * MiB].to(torch.int64).sum().item())
        for i, size in enumerate(SIZES):
            imm = 200 + i
            times = []
            burst = _burst(size)
            for rep in range(reps + 1):
                here.send((imm, burst, 4 * MiB if (rep == 0 and size >= 4 * MiB) else 0))
                t0 = time.perf_counter()
                sent = [e.submit(WriteRequest(rsrc, 0, size, desc, 0, imm=imm)) for _ in range(burst)]
                got = here.recv()  # the target counted the burst's imms
                elapsed = (time.perf_counter() - t0) / burst
                for t in sent:
                    t.wait(timeout=60)
                if rep == 0:
                    if size >= 4 * MiB and got != want:
                        raise SystemExit(f"efa shm wrote wrong bytes: checksum {got} != {want}")
                    continue  # warm-up (first touch of the IPC mapping)
                times.append(elapsed)
            rows.append({"path": "efa-shm-writeimm", "bytes": size, "seconds": _median(times)})
        # imm latency: ping-pong of 4 KiB writes between the two processes' GPU memory
        back = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        rback = e.register(back)
        count = 20 + latency_reps
        here.send(("pong", bytes(rback.descriptor), 300, 301, count))
        lat = []
        for i in range(count):
            t0 = time.perf_counter()
            e.submit(WriteRequest(rsrc, 0, 4096, desc, 0, imm=300))
            e.counter(301).wait(1, timeout=60)
            if i >= 20:
                lat.append((time.perf_counter() - t0) / 2)
        here.recv()
        lat.sort()
        latency.append(
            {
                "path": "efa-shm cuda-ipc ping-pong, half round trip",
                "bytes": 4096,
                "p50_us": lat[len(lat) // 2] * 1e6,
                "p99_us": lat[int(len(lat) * 0.99)] * 1e6,
            }
        )
        e.close()
    finally:
        here.send(None)
        proc.join(30)
    return rows, latency


def _latency(a: Any, b: Any, reps: int, label: str) -> list[dict[str, Any]]:
    # 4 KiB writes into GPU memory where the backend carries it, else into host memory (the
    # GPU work after the wait then reads a GPU tensor of its own: the imm is what is timed)
    where = "cuda" if b.capabilities.cuda_memory and a.capabilities.cuda_memory else "cpu"
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=where)
    dst = torch.zeros(4096, dtype=torch.uint8, device=where)
    seen = dst if where == "cuda" else torch.zeros(4096, dtype=torch.uint8, device="cuda")
    rs, rd = a.register(src), b.register(dst)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    imm_dev, imm_host = 0x500, 0x501
    dc = b.device_counter(imm_dev)
    gpu, host = [], []
    for _ in range(reps):
        with torch.cuda.stream(stream):
            dc.wait(1, stream, timeout=30)
            out.add_(seen[:64].to(torch.int64).sum())
            ev = torch.cuda.Event()
            ev.record(stream)
        time.sleep(0.002)  # the wait is queued on the GPU
        t0 = time.perf_counter()
        a.submit(WriteRequest(rs, 0, 4096, rd.descriptor, 0, imm=imm_dev, routing=_pinned()))
        while not ev.query():
            pass
        gpu.append(time.perf_counter() - t0)
        # the host path: wait on the host, then launch the same work
        t0 = time.perf_counter()
        a.submit(WriteRequest(rs, 0, 4096, rd.descriptor, 0, imm=imm_host, routing=_pinned()))
        b.counter(imm_host).wait(1, timeout=30)
        with torch.cuda.stream(stream):
            out.add_(seen[:64].to(torch.int64).sum())
            ev = torch.cuda.Event()
            ev.record(stream)
        while not ev.query():
            pass
        host.append(time.perf_counter() - t0)
    dc.check()
    gpu.sort()
    host.sort()
    q = int(0.99 * (len(gpu) - 1))
    label = f"{label} ({where} memory)"
    return [
        {"backend": label, "path": "device-wait", "p50_us": _median(gpu) * 1e6, "p99_us": gpu[q] * 1e6},
        {
            "backend": label,
            "path": "host-wait-then-launch",
            "p50_us": _median(host) * 1e6,
            "p99_us": host[q] * 1e6,
        },
    ]


def _pinned() -> Any:
    from fabric_core import Pinned

    return Pinned(0)


def bench_device_wait(reps: int) -> list[dict[str, Any]]:
    fabric = SimFabric(0)
    a, b = fabric.open_engine(nics=1), fabric.open_engine(nics=1)
    rows = _latency(a, b, reps, "sim")
    a.close()
    b.close()
    try:
        import fabric_efa  # noqa: F401
    except ImportError:
        return rows
    a = open_engine("efa", efa_provider="shm")
    if a is not None:
        b = open_engine("efa", efa_provider="shm")
        try:
            rows += _latency(a, b, reps, "efa-shm")
        except Exception as exc:  # report what the provider did, keep the rest
            rows.append({"backend": "efa-shm", "error": f"{type(exc).__name__}: {exc}"})
        a.close()
        b.close()
    return rows


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    paths = sorted({r["path"] for r in result["bandwidth"]})
    for p in paths:
        pts = [(r["bytes"], r["bytes"] / r["seconds"] / 1e9) for r in result["bandwidth"] if r["path"] == p]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per write")
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"GPU-to-GPU on one {result['gpu']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--latency-reps", type=int, default=200)
    args = ap.parse_args()
    if not cuda.available() or not torch.cuda.is_available():
        raise SystemExit(f"needs a CUDA GPU: {cuda.unavailable_reason() or 'torch has no CUDA'}")
    torch.zeros(1, device="cuda")
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "reps": args.reps,
    }
    result["efa_shm_cuda"] = _efa_verdict()
    _say(f"efa shm and CUDA memory: {result['efa_shm_cuda']}")
    result["register"] = bench_register(args.reps)
    _say(json.dumps(result["register"], indent=1))
    result["bandwidth"], result["imm_latency"] = bench_bandwidth(args.reps, args.latency_reps)
    for r in result["bandwidth"]:
        gbps = r["bytes"] / r["seconds"] / 1e9
        _say(f"{r['path']:>18} {r['bytes'] >> 10:>8} KiB {gbps:8.1f} GB/s")
    _say(json.dumps(result["imm_latency"], indent=1))
    result["device_wait"] = bench_device_wait(args.latency_reps)
    _say(json.dumps(result["device_wait"], indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    sys.exit(main())
