"""The Python time of one large paged request: ``submit_paged_write`` of ``--pages`` pages of 4 KiB
(default 10,000, the issue's figure) to a shuffled page list, one imm per page, on an idle engine.

A writer process submits one request, waits for it, and again (``--calls`` times, the first
``--warmup`` left out), timing each call by the wall clock and by the calling thread's CPU time.
The target is a second process. ``fabric bench``'s paged "submit" figure is a different thing: the
median of calls made back to back, each of which may wait for queue room behind the ones before.

    python benchmarks/paged_submit.py --provider shm [--pages 10000] [--json FILE]
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

import numpy as np
from paged_rate import PAGE, _target  # (the benchmarks' own folder is first on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm", help="libfabric provider (shm, tcp;ofi_rxm)")
    ap.add_argument("--pages", type=int, default=10000)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.provider.startswith("tcp"):
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    from fabric_core import open_engine
    from fabric_core.models import MemoryRegionDescriptor

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_target, args=(there, args.provider, args.pages), daemon=True)
    target.start()
    engine = open_engine(backend="efa", efa_provider=args.provider, nics=1)
    src = np.ones(args.pages * PAGE, dtype=np.uint8)
    mr = engine.register(src)
    dst = MemoryRegionDescriptor.from_bytes(here.recv())
    src_pages = np.arange(args.pages, dtype=np.int64)
    dst_pages = np.random.default_rng(0).permutation(args.pages).astype(np.int64)
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(args.calls):
        w0, c0 = time.perf_counter(), time.thread_time()
        transfer = engine.submit_paged_write(mr, src_pages, PAGE, dst, dst_pages, PAGE, PAGE, imm=3)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
        transfer.wait(60.0)
    here.send(b"done")
    target.join(30)
    engine.close()
    w = [x * 1e3 for x in wall[args.warmup :]]
    c = [x * 1e3 for x in cpu[args.warmup :]]
    row = {
        "what": "one paged request's submit call on an idle engine (benchmarks/paged_submit.py)",
        "provider": args.provider,
        "pages": args.pages,
        "calls": len(w),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "wall_ms_p50": statistics.median(w),
        "wall_ms_min": min(w),
        "wall_ms_max": max(w),
        "thread_cpu_ms_p50": statistics.median(c),
    }
    sys.stdout.write(
        f"{args.provider}: {args.pages:,}-page submit: wall {row['wall_ms_p50']:.3f} ms median "
        f"({row['wall_ms_min']:.3f}-{row['wall_ms_max']:.3f}), the calling thread's CPU "
        f"{row['thread_cpu_ms_p50']:.3f} ms\n"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
