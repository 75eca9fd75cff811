"""A writer that waits on each small write, against a target busy after each wait.

The writer (this process) submits one 8-byte write with an imm, waits for its transfer,
sleeps 2 ms, N times; the target (a child process) waits for the imm, then computes in
Python for 1 ms without calling the engine. Prints the writer's completion times. On
tcp;ofi_rxm, with ``efa_eager_max`` as given (0: every write delivery complete).

    FI_TCP_IFACE=lo python busy_target.py 4096
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from fabric_core.settings import load_settings
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")
WRITES = 300


def engine(eager_max: int) -> EfaEngine:
    settings = load_settings(
        backend="efa", efa_provider="tcp;ofi_rxm", nics=1, timeout_s=10, efa_eager_max=eager_max
    )
    return EfaEngine(settings)


def target(conn: Connection, eager_max: int) -> None:
    with engine(eager_max) as t:
        dst = np.zeros(64, dtype=np.uint8)
        region = t.register(dst)
        counter = t.counter(3)
        conn.send(region.descriptor)
        for _ in range(WRITES):
            counter.wait(1, timeout=10)
            until = time.perf_counter() + 0.001
            while time.perf_counter() < until:  # compute, no call into the engine
                pass
        conn.recv()


def main() -> None:
    eager_max = int(sys.argv[1])
    here, there = mp.Pipe()
    child = mp.get_context("fork").Process(target=target, args=(there, eager_max))
    child.start()
    desc = here.recv()
    took = []
    with engine(eager_max) as w:
        src = np.ones(64, dtype=np.uint8)
        region = w.register(src)
        for _ in range(WRITES):
            t0 = time.perf_counter()
            w.submit_write(region, 0, 8, desc, 0, imm=3).wait(10)
            took.append(time.perf_counter() - t0)
            time.sleep(0.002)
        here.send(1)
        child.join()
    took.sort()
    p50, p90 = took[WRITES // 2] * 1e6, took[int(WRITES * 0.9)] * 1e6
    sys.stdout.write(
        f"eager_max={eager_max}: completion p50 {p50:.0f} us p90 {p90:.0f} us max {took[-1] * 1e6:.0f}\n"
    )


if __name__ == "__main__":
    main()
