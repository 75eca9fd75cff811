"""A stream of equal writes between two processes: one Python call per write against one per batch.

A writer process keeps ``--window`` writes of ``--size`` bytes (each with an imm) in flight to a
target process, for ``--seconds``, in one of two forms:

- ``single``: ``submit_write`` per write, waiting on the oldest transfer before each new one
  (as ``fabric bench`` and the raw-libfabric ceiling's window do);
- ``batched``: ``submit_scatter`` with ``--batch`` writes to the same target range per call, so
  Python runs once per batch and the engine posts the batch's writes back to back.

With ``--ceiling BINARY`` (``benchmarks/ceiling/fi_ceiling.c``) each round also runs the ceiling
at the same size and window (delivery complete, the like-for-like one). ``--pin T,W`` pins the
target's process (and its worker, to the first CPU) to CPUs T and the writer's process to CPUs
W, each one CPU or several joined by ``+`` (``0,1+2``: the target on CPU 0, the writer on CPUs
1 and 2), so the two sides never share a core. ``--no-cma`` sets ``FI_SHM_DISABLE_CMA=1`` for
every process of the run (fabric and the ceiling): shm then moves writes above its inject size
through its bounce buffers (SAR) instead of a cross-process copy by the target. The forms
alternate ``--rounds`` times:

    python benchmarks/write_stream.py --provider shm --size 65536 --rounds 5 \\
        --ceiling /tmp/fi_ceiling --pin 0,1 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

FORMS = ("single", "batched")


def _engine(provider: str) -> Any:
    from fabric_core import open_engine

    return open_engine(backend="efa", efa_provider=provider, nics=1)


def _pin(cpus: list[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def _target(conn: Connection, provider: str, size: int, cpus: list[int] | None) -> None:
    if cpus:
        os.environ["FABRIC_WORKER_CPU"] = str(cpus[0])
    _pin(cpus)
    engine = _engine(provider)
    buf = np.zeros(size, dtype=np.uint8)
    conn.send(engine.register(buf).descriptor.to_bytes())
    expected = int(conn.recv())
    engine.counter(3).wait(expected, 30)  # every imm counted (TransferTimeout otherwise)
    state = engine.dump_state()
    conn.send({k: state.get(k) for k in ("worker_yields", "lone_yields", "worker_naps")})
    engine.close()


def _writer(conn: Connection, args: argparse.Namespace, form: str) -> None:
    from fabric_core.models import MemoryRegionDescriptor
    from fabric_core.ops import ScatterTarget

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_target, args=(there, args.provider, args.size, args.target_cpu), daemon=True)
    target.start()
    _pin(args.writer_cpu)
    engine = _engine(args.provider)
    src = np.ones(args.size, dtype=np.uint8)
    mr = engine.register(src)
    dst = MemoryRegionDescriptor.from_bytes(here.recv())
    if form == "single":
        per_call, window = 1, args.window
        submit = lambda: engine.submit_write(mr, 0, args.size, dst, 0, imm=3)  # noqa: E731
    else:
        per_call, window = args.batch, max(1, args.window // args.batch)
        batch = [ScatterTarget(dst, args.size)] * args.batch
        submit = lambda: engine.submit_scatter(mr, batch, imm=3)  # noqa: E731
    pending: collections.deque[Any] = collections.deque()
    writes, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        if len(pending) >= window:
            pending.popleft().wait(30)
        pending.append(submit())
        writes += per_call
    for transfer in pending:
        transfer.wait(30)
    elapsed = time.perf_counter() - start
    here.send(writes)
    target_state = here.recv()
    target.join(30)
    engine.close()
    conn.send(
        {
            "writes_per_s": writes / elapsed,
            "gbytes_per_s": writes * args.size / elapsed / 1e9,
            "target_yields_per_write": (target_state.get("worker_yields") or 0) / max(writes, 1),
        }
    )


def run_fabric(args: argparse.Namespace, form: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    writer = ctx.Process(target=_writer, args=(there, args, form))
    writer.start()
    out: dict[str, Any] = here.recv()
    writer.join(60)
    return out


def run_ceiling(args: argparse.Namespace) -> float:
    """The ceiling's GB/s at ``args.size`` (the same window, delivery complete)."""
    cmd = [args.ceiling, "-p", args.provider, "-s", str(args.size), "-w", str(args.window), "-d", "-l", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    for line in out.splitlines():
        row = json.loads(line)
        if row.get("kind") == "bandwidth":
            return float(row["gbytes_per_s"])
    raise RuntimeError(f"no bandwidth row in the ceiling's output: {out!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64, help="writes per submit_scatter call (batched)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ceiling", default=None, help="the fi_ceiling binary, run in each round")
    ap.add_argument("--pin", default=None, help="T,W: the target's CPUs and the writer's (CPUs joined by +)")
    ap.add_argument("--no-cma", action="store_true", help="FI_SHM_DISABLE_CMA=1 for every process")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.target_cpu = args.writer_cpu = None
    if args.pin:
        args.target_cpu, args.writer_cpu = ([int(c) for c in side.split("+")] for side in args.pin.split(","))
    if args.provider.startswith("tcp"):
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    if args.no_cma:
        os.environ["FI_SHM_DISABLE_CMA"] = "1"
    rounds = []
    for i in range(args.rounds):
        row: dict[str, Any] = {}
        if args.ceiling:
            row["ceiling_gbytes_per_s"] = run_ceiling(args)
        for form in FORMS if i % 2 == 0 else FORMS[::-1]:
            row[form] = run_fabric(args, form)
        rounds.append(row)
        ceiling = row.get("ceiling_gbytes_per_s")
        line = f"round {i + 1}:" + (f" ceiling {ceiling:.2f}" if ceiling else "")
        for form in FORMS:
            line += f", {form} {row[form]['gbytes_per_s']:.2f} GB/s"
            if ceiling:
                line += f" ({row[form]['gbytes_per_s'] / ceiling:.2f})"
            line += f" [{row[form]['target_yields_per_write']:.1f} target yields/write]"
        sys.stdout.write(line + " \n")
        sys.stdout.flush()
    summary: dict[str, Any] = {}
    for form in FORMS:
        summary[f"{form}_gbytes_per_s"] = statistics.median(r[form]["gbytes_per_s"] for r in rounds)
        if args.ceiling:
            summary[f"{form}_ratio"] = statistics.median(
                r[form]["gbytes_per_s"] / r["ceiling_gbytes_per_s"] for r in rounds
            )
    if args.ceiling:
        summary["ceiling_gbytes_per_s"] = statistics.median(r["ceiling_gbytes_per_s"] for r in rounds)
    sys.stdout.write("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()) + "\n")
    if args.json:
        from fabric_efa import _efa  # (the libfabric this process loaded: the workers load the same)

        doc = {
            "what": "a stream of equal writes, one submit_write per write against submit_scatter batches "
            "(write_stream.py)",
            "provider": args.provider,
            "libfabric": ".".join(map(str, _efa.libfabric_version())),
            "size": args.size,
            "window": args.window,
            "batch": args.batch,
            "seconds": args.seconds,
            "pin": args.pin,
            "no_cma": args.no_cma,
            "cpus": os.cpu_count(),
            "rounds": rounds,
            "medians": summary,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
