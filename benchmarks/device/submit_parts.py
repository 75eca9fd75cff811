"""Costs of a small submit_imm's parts on this host (timeit, best of 7): the whole call, the
Transfer made for it, the C++ fast path alone, and a satisfied counter wait. Run by hand on a
lent host (benchmarks/device/run.sh's setup first)."""
import time
import timeit

import numpy as np

from fabric_core import open_engine
from fabric_core.native import _ONE_NIC
from fabric_core.transfer import Transfer, _ids

a = open_engine(backend="efa", efa_provider="shm", nics=1)
b = open_engine(backend="efa", efa_provider="shm", nics=1)
buf = np.zeros(4096, dtype=np.uint8)
desc = b.register(buf).descriptor
a.submit_imm(desc, 1).wait(5)
N = 2000


def best(fn, n=N):
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


core = a._core
print(f"submit_imm (worker busy or napping, as it comes): {best(lambda: a.submit_imm(desc, 7)):.2f} us")
time.sleep(0.5)
print(f"Transfer(): {best(lambda: Transfer((), default_timeout=60.0)):.2f} us")
# (a fresh id each: the engine keys its live requests by id; their completions find no
# Transfer and are dropped)
print(f"core.fast_imm: {best(lambda: core.fast_imm(next(_ids), desc, 7, _ONE_NIC, -1.0)):.2f} us")
time.sleep(0.5)
c = b.counter(7)
print(f"satisfied counter wait: {best(lambda: c.wait(1, 1.0), n=1000):.2f} us")
print(f"empty python call: {best(lambda: None):.3f} us")
a.close()
b.close()
