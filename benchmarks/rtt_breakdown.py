"""Where an imm round trip's time goes, between two processes on one host.

A client writes an imm to a server and waits on its counter for one back; the server waits on
its counter and writes one back: the latency phase of ``fabric bench`` with a server, made of
the public API only. Each side stamps ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux:
one clock for both processes) around its calls, so each round trip splits into:

- ``client_submit``: the client's ``submit_imm`` call (``submit_write`` of ``--size`` bytes with
  the imm when ``--size`` is given: ``fabric bench``'s first leg);
- ``forward``: from that call's return to the server's ``wait`` returning (the provider, the
  server's engine counting the imm, its waiter waking and coming back to Python);
- ``server_submit``: the server's ``submit_imm`` call;
- ``back``: from that call's return to the client's ``wait`` returning;
- ``total``: the round trip as ``fabric bench`` times it.

    python benchmarks/rtt_breakdown.py --provider shm --iters 20000 [--size 8] [--json FILE]

Prints the median and 90th percentile of each part (after ``--warmup`` round trips).
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
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PING, PONG = 10, 9


def _engine(provider: str) -> Any:
    from fabric_core import open_engine

    return open_engine(backend="efa", efa_provider=provider, nics=1)


def _server(conn: Connection, provider: str, iters: int) -> None:
    from fabric_core.models import MemoryRegionDescriptor

    engine = _engine(provider)
    buf = np.zeros(4096, dtype=np.uint8)
    conn.send(engine.register(buf).descriptor.to_bytes())
    client = MemoryRegionDescriptor.from_bytes(conn.recv())
    counter, now = engine.counter(PING), time.perf_counter_ns
    woke = np.zeros(iters, dtype=np.int64)
    sent = np.zeros(iters, dtype=np.int64)
    for i in range(iters):
        counter.wait(1, 30.0)
        woke[i] = now()
        engine.submit_imm(client, PONG)
        sent[i] = now()
    conn.send((woke.tobytes(), sent.tobytes()))
    conn.recv()  # the client is done with this engine
    engine.close()


def _quantiles(ns: np.ndarray[Any, Any]) -> dict[str, float]:
    us = ns / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm", help="libfabric provider (shm, tcp;ofi_rxm)")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--size", type=int, default=0, help="bytes written with the client's imm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.provider.startswith("tcp"):
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    from fabric_core.models import MemoryRegionDescriptor

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=_server, args=(there, args.provider, args.iters), daemon=True)
    server.start()
    engine = _engine(args.provider)
    buf = np.zeros(4096, dtype=np.uint8)
    target = MemoryRegionDescriptor.from_bytes(here.recv())
    region = engine.register(buf)
    here.send(region.descriptor.to_bytes())
    counter, now = engine.counter(PONG), time.perf_counter_ns
    size = args.size
    if not 0 <= size <= buf.nbytes:
        ap.error(f"--size must be within 0..{buf.nbytes}")
    start = np.zeros(args.iters, dtype=np.int64)
    posted = np.zeros(args.iters, dtype=np.int64)
    back = np.zeros(args.iters, dtype=np.int64)
    for i in range(args.iters):
        start[i] = now()
        if size:
            transfer = engine.submit_write(region, 0, size, target, 0, imm=PING)
        else:
            transfer = engine.submit_imm(target, PING)
        posted[i] = now()
        counter.wait(1, 30.0)
        back[i] = now()
        transfer.wait(30.0)  # (untimed, as in fabric bench)
    woke_b, sent_b = here.recv()
    here.send(b"done")
    server.join(30)
    engine.close()
    woke, sent = np.frombuffer(woke_b, dtype=np.int64), np.frombuffer(sent_b, dtype=np.int64)
    w = slice(args.warmup, None)
    parts = {
        "client_submit": posted[w] - start[w],
        "forward": woke[w] - posted[w],
        "server_submit": sent[w] - woke[w],
        "back": back[w] - sent[w],
        "total": back[w] - start[w],
    }
    rows = {name: _quantiles(ns) for name, ns in parts.items()}
    for name, q in rows.items():
        sys.stdout.write(f"{name:14s} p50 {q['p50_us']:7.2f} us   p90 {q['p90_us']:7.2f} us\n")
    shares = statistics.median((posted[w] - start[w] + sent[w] - woke[w]) / (back[w] - start[w]))
    sys.stdout.write(f"the two submit calls: {100 * shares:.0f} % of the round trip (median)\n")
    if args.json:
        doc = {
            "what": "an imm round trip split by timestamps on one clock (benchmarks/rtt_breakdown.py)",
            "provider": args.provider,
            "size": size,
            "iters": args.iters,
            "warmup": args.warmup,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "parts": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
