"""Paged writes per second between two processes, and what the waiter's draining does to them.

A writer process submits paged writes of host memory (``--pages`` pages of 4 KiB to a shuffled
page list, one imm per page) to a target process, ``--window`` requests in flight, waiting on
the oldest, for ``--seconds``; it prints the rate. ``--drain always`` makes a thread waiting on
such a transfer drain it whatever its length (the behaviour before ``_DRAIN_MAX_PAGES`` in
``fabric_efa/engine.py``); ``--drain default`` keeps the backend's rule. ``--rounds N``
alternates the two N times and prints each pair, for an A/B on one host:

    python benchmarks/paged_rate.py --provider shm --rounds 5 [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PAGE = 4096


def _engine(provider: str, drain: str) -> Any:
    if drain == "always":
        import fabric_efa.engine as efa_engine

        efa_engine._DRAIN_MAX_PAGES = {}
    from fabric_core import open_engine

    return open_engine(backend="efa", efa_provider=provider, nics=1)


def _target(conn: Connection, provider: str, pages: int) -> None:
    engine = _engine(provider, "default")
    buf = np.zeros(pages * PAGE, dtype=np.uint8)
    conn.send(engine.register(buf).descriptor.to_bytes())
    conn.recv()
    engine.close()


def _writer(conn: Connection, provider: str, drain: str, pages: int, window: int, seconds: float) -> None:
    from fabric_core.models import MemoryRegionDescriptor

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_target, args=(there, provider, pages), daemon=True)
    target.start()
    engine = _engine(provider, drain)
    src = np.ones(pages * PAGE, dtype=np.uint8)
    mr = engine.register(src)
    dst = MemoryRegionDescriptor.from_bytes(here.recv())
    src_pages = np.arange(pages, dtype=np.int64)
    dst_pages = np.random.default_rng(0).permutation(pages).astype(np.int64)
    pending: collections.deque[Any] = collections.deque()
    sent, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        if len(pending) >= window:
            pending.popleft().wait(30)
        pending.append(engine.submit_paged_write(mr, src_pages, PAGE, dst, dst_pages, PAGE, PAGE, imm=3))
        sent += 1
    for transfer in pending:
        transfer.wait(30)
    rate = sent * pages / (time.perf_counter() - start)
    here.send(b"done")
    target.join(30)
    engine.close()
    conn.send(rate)


def run(provider: str, drain: str, pages: int, window: int, seconds: float) -> float:
    """Pages per second of one writer/target pair (each in its own process)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(there, provider, drain, pages, window, seconds))
    writer.start()
    rate = float(here.recv())
    writer.join(60)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--drain", choices=("default", "always"), default="default")
    ap.add_argument("--rounds", type=int, default=0, help="alternate default and always this many times")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.provider.startswith("tcp"):
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    if args.rounds <= 0:
        rate = run(args.provider, args.drain, args.pages, args.window, args.seconds)
        line = f"{args.provider} {args.pages} pages, drain {args.drain}: {rate / 1e3:.1f}k pages/s"
        sys.stdout.write(line + "\n")
        return
    pairs = []
    for i in range(args.rounds):
        row = {d: run(args.provider, d, args.pages, args.window, args.seconds) for d in ("always", "default")}
        pairs.append(row)
        sys.stdout.write(
            f"round {i + 1}: always {row['always'] / 1e3:.1f}k, default {row['default'] / 1e3:.1f}k pages/s "
            f"({row['default'] / row['always']:.2f}x)\n"
        )
    ratio = statistics.median(r["default"] / r["always"] for r in pairs)
    sys.stdout.write(f"median ratio default/always: {ratio:.2f}x over {len(pairs)} pairs\n")
    if args.json:
        doc = {
            "what": "paged writes per second, waiter draining always vs the backend's rule (paged_rate.py)",
            "provider": args.provider,
            "pages": args.pages,
            "window": args.window,
            "seconds": args.seconds,
            "cpus": os.cpu_count(),
            "pairs": pairs,
            "median_ratio": ratio,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
