"""Where the time of a paged write goes, per work request: GPU memory (the CUDA IPC domain)
against host memory (the shm provider), with and without an imm per page.

    python benchmarks/gpu_per_wr.py

Two efa shm engines in one process; one paged write of N pages, timed from ``submit`` to the
last imm counted (with imms) or to the transfer's completion (without); median of 3 after a
warm-up. If GPU and host memory cost the same per work request, the cost is the engine's,
not the data path's.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("FI_TCP_IFACE", "lo")

import numpy as np
import torch

from fabric_core import open_engine


def run(where: str, n: int, page: int, imm: bool, reps: int = 3) -> None:
    a = open_engine("efa", efa_provider="shm")
    b = open_engine("efa", efa_provider="shm")
    src = torch.empty(n * page, dtype=torch.uint8, device=where)
    dst = torch.zeros(n * page, dtype=torch.uint8, device=where)
    rs, rd = a.register(src), b.register(dst)
    pages = np.arange(n, dtype=np.int64)
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        x = a.submit_paged_write(rs, pages, page, rd.descriptor, pages, page, page, imm=(7 if imm else None))
        if imm:
            b.counter(7).wait(n, timeout=120)
        x.wait(timeout=120)
        if r:
            times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    sys.stdout.write(
        f"{where:5} n={n:6} page={page >> 10:5}KiB imm={imm!s:5}: {t * 1e3:8.1f} ms "
        f"{t / n * 1e6:6.2f} us/WR {n * page / t / 1e9:7.1f} GB/s\n"
    )
    sys.stdout.flush()
    a.close()
    b.close()


def main() -> None:
    for where in ("cuda", "cpu"):
        for imm in (True, False):
            run(where, 20480, 32 << 10, imm)
    run("cuda", 2048, 1 << 20, True)
    run("cuda", 20480, 4 << 10, True)


if __name__ == "__main__":
    main()
