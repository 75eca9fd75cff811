"""Costs of a small ``submit_imm``'s parts on this host (timeit, best of 7): the whole call,
the ``Transfer`` made for it, the C++ fast path alone, a satisfied counter wait, and an empty
Python call for scale. Two shm engines in this process; run it where fabric-efa is built
(on a lent GPU machine, after benchmarks/device/run.sh's setup).

    python benchmarks/device/submit_parts.py
"""

from __future__ import annotations

import sys
import time
import timeit
from collections.abc import Callable

import numpy as np

from fabric_core import open_engine
from fabric_core.native import _ONE_NIC
from fabric_core.transfer import Transfer

N = 2000


def best(fn: Callable[[], object], n: int = N) -> float:
    """Microseconds per call, the best of 7 runs of ``n``."""
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def main() -> None:
    a = open_engine(backend="efa", efa_provider="shm", nics=1)
    b = open_engine(backend="efa", efa_provider="shm", nics=1)
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        desc = b.register(buf).descriptor
        a.submit_imm(desc, 1).wait(5)
        core = a._core
        out = sys.stdout.write
        out(f"submit_imm: {best(lambda: a.submit_imm(desc, 7)):.2f} us\n")
        time.sleep(0.5)
        out(f"Transfer(): {best(lambda: Transfer((), default_timeout=60.0)):.2f} us\n")
        # (the transfers it makes are the engine's in-flight ones, completed as usual)
        out(f"the C++ fast path: {best(lambda: core.fast_imm(desc, 7, _ONE_NIC, -1.0)):.2f} us\n")
        time.sleep(0.5)
        counter = b.counter(7)
        out(f"satisfied counter wait: {best(lambda: counter.wait(1, 1.0), n=1000):.2f} us\n")
        out(f"an empty Python call: {best(lambda: None):.3f} us\n")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
