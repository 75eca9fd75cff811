"""What the benchmarks' spawned processes start with."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def child_env(**extra: str) -> Iterator[None]:
    """The environment processes spawned inside it inherit (values already set win): one
    OpenMP thread per process (each pool otherwise spins on every core against the other
    processes and the engines' threads), libfabric's tcp provider on loopback, and
    ``extra``."""
    want = {"OMP_NUM_THREADS": "1", "FI_TCP_IFACE": "lo", **extra}
    saved = {k: os.environ.get(k) for k in want}
    for k, v in want.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def reap(procs: Iterable[Any], *, kill: bool) -> None:
    """Join spawned processes (killing them first if ``kill``, e.g. after a failure, when the
    others would wait for the failed one); one that outlives a 5 s join is killed."""
    for p in procs:
        if kill:
            p.kill()
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
