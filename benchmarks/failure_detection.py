"""How long a fault takes to become a typed error, on both sides, across network-namespace
hosts (efa backend on tcp;ofi_rxm): the detection-time distribution of the failure contract
(docs/concepts/failures.md).

For each fault and repetition, host 0 writes to host 1 (32 MiB, which cannot complete while
host 1 is cut off or stopped; host 0's link is rate-limited to 50 Mbit/s so it is still in
flight) while host 1 waits on a counter naming host 0; the fault hits
(host 1 for the sender's view; host 0 for the target's view), and the time until each side's
call fails is recorded with the error type. Liveness settings are the ones given (defaults:
interval 0.2 s, timeout 1.0 s). Needs root, iproute2 and nftables.

``nic1_link_down`` is a fault the contract survives rather than reports: two hosts on two
rails, host 0 streams 24 sharded WriteImms of 256 KiB to host 1 with both NICs, and NIC 1's
link goes down after the 9th. Recorded: the seconds from the fault until the last transfer
completed (the lost path taken for lost, its connection reset, its WriteImms reconciled and
retried on NIC 0), "exact" if host 1 counted every imm exactly ``imms_at_target`` times and
every byte is in place, else what differed.

    python benchmarks/failure_detection.py --reps 5 --json benchmarks/results/failure-detection.json
    python benchmarks/failure_detection.py --faults nic1_link_down --reps 10 \
        --json benchmarks/results/nic-loss-recovery.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from fabric_core.ops import Pinned
from fabric_core.testing.netns import NetnsLab, netns_unavailable
from fabric_core.testing.remote import WorkerPool

MiB = 1 << 20
FAULTS = ("kill", "stop", "link_down", "blackhole")
RECOVERED = ("nic1_link_down",)


def _one(fault: str, side: str, live: dict[str, Any]) -> tuple[float, str]:
    """Seconds from the fault to the failure seen by ``side`` ("sender" or "target")."""
    with NetnsLab(hosts=2, tag="bench") as lab:
        pool = WorkerPool(workers=0, arena_bytes=1 << 27)
        try:
            a, b = lab.engine(pool, 0, **live), lab.engine(pool, 1, **live)
            src, dst = pool.alloc(32 * MiB), pool.alloc(32 * MiB)
            mr, desc = a.register(src), b.register(dst).descriptor
            a.submit_write(mr, 0, 4096, desc, 0, imm=1).wait(10)
            b.counter(1).wait(1, timeout=10, peer=a.address)
            victim = 1 if side == "sender" else 0
            if side == "sender":
                lab.rate_limit(0, 50)  # 32 MiB at 50 Mbit/s: still in flight when the fault hits
            result: list[tuple[float, str]] = []
            started = threading.Event()
            t0 = [float("inf")]

            def observe() -> None:
                started.set()
                try:
                    if side == "sender":
                        a.submit_write(mr, 0, 32 * MiB, desc, 0, imm=2).wait(60)
                    else:
                        b.counter(3).wait(1, timeout=60, peer=a.address)
                    result.append((max(time.monotonic() - t0[0], 0.0), "none"))
                except Exception as exc:
                    result.append((max(time.monotonic() - t0[0], 0.0), type(exc).__name__))

            th = threading.Thread(target=observe, daemon=True)
            th.start()
            started.wait()
            time.sleep(0.2)
            t0[0] = time.monotonic()
            if fault == "kill":
                lab.kill(victim)
            elif fault == "stop":
                lab.stop(victim)
            elif fault == "link_down":
                lab.link_down(victim)
            else:
                lab.blackhole(victim)
            th.join(70)
            return result[0] if result else (float("inf"), "hang")
        finally:
            for w in pool.workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(18)
            pool.close()


def _nic_loss(live: dict[str, Any]) -> tuple[float, str]:
    """Seconds from NIC 1's link going down to the last of the stream's transfers completing,
    and "exact" or what the target counted wrong (see the module's doc)."""
    with NetnsLab(hosts=2, rails=2, tag="bench") as lab:
        pool = WorkerPool(workers=0, arena_bytes=1 << 27)
        try:
            a, b = lab.engine(pool, 0, nics=2, **live), lab.engine(pool, 1, nics=2, **live)
            size, chunk, rounds = 8 * MiB, 256 * 1024, 24
            src, dst = pool.alloc(size), pool.alloc(size)
            src[:] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            mr, desc = a.register(src), b.register(dst).descriptor
            a.submit_imm(desc, 99).wait(10)
            b.counter(99).wait(1, timeout=10)
            a.fence([desc], timeout=10)  # WriteImms use both NICs from here
            warm = a.submit_write(mr, 0, chunk, desc, 0, imm=98, routing=Pinned(1))  # NIC 1 connected
            warm.wait(10)
            transfers = []
            t0 = float("inf")
            for i in range(rounds):
                off = (i % (size // chunk)) * chunk
                transfers.append(a.submit_write(mr, off, chunk, desc, off, imm=100 + i))
                if i == rounds // 3:
                    t0 = time.monotonic()
                    lab.link_down(0, 1)
            failed = []
            for t in transfers:
                try:
                    t.wait(60)
                except Exception as exc:
                    failed.append(type(exc).__name__)
            took = time.monotonic() - t0
            if failed:
                return took, "failed: " + ",".join(sorted(set(failed)))
            time.sleep(0.2)
            wrong = [i for i, t in enumerate(transfers) if b.counter(100 + i).value != t.imms_at_target]
            if wrong or not np.array_equal(dst[: rounds * chunk], src[: rounds * chunk]):
                return took, f"counts off for imms {[100 + i for i in wrong]}" if wrong else "bytes differ"
            return took, "exact"
        finally:
            pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    known = FAULTS + RECOVERED
    ap.add_argument("--faults", default=",".join(known), help="comma-separated: " + ", ".join(known))
    args = ap.parse_args()
    chosen = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"unknown faults: {', '.join(unknown)}")
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    live = {"liveness_interval_s": args.interval, "liveness_timeout_s": args.timeout, "timeout_s": 60.0}
    rows = []
    for fault in chosen:
        for side in ("sender", "target") if fault in FAULTS else ("sender (recovered)",):
            if fault in FAULTS:
                samples = [_one(fault, side, live) for _ in range(args.reps)]
            else:
                samples = [_nic_loss(live) for _ in range(args.reps)]
            times = [t for t, _ in samples]
            row = {
                "fault": fault,
                "side": side,
                "errors": sorted({e for _, e in samples}),
                "seconds": times,
                "median_s": statistics.median(times),
                "max_s": max(times),
            }
            rows.append(row)
            line = f"{fault:14s} {side:7s} median {row['median_s']:.3f} s  max {row['max_s']:.3f} s"
            sys.stdout.write(f"{line}  {row['errors']}\n")
    out = {
        "what": "seconds from a fault to the typed error, per side (efa on tcp;ofi_rxm, netns hosts); "
        "for nic1_link_down, to the last transfer's completion and whether the counts were exact",
        "liveness_interval_s": args.interval,
        "liveness_timeout_s": args.timeout,
        "reps": args.reps,
        "host": platform.node(),
        "numpy": np.__version__,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
