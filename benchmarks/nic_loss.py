"""What losing a NIC mid-stream costs: two network-namespace hosts on two rails (efa backend
on tcp;ofi_rxm, one NIC per rail), host 0 streaming sharded WriteImms to host 1.

Host 0's rails are rate-limited (``--mbit``, 200 Mbit/s each by default) so that the stream
is still in flight when the fault hits. Per repetition, on a fresh lab: a baseline stream
(no fault), then the same stream with host 0's NIC 1 failing (``NetnsLab.nic_fail``: its TCP
connections reset, new ones refused) once a third of it is submitted. Reported: each
stream's time from first submit to last completion, the extra time the fault cost (median
over repetitions, fault minus baseline of the same repetition), what the stream takes on
one rail alone, the work requests retried, and whether the target counted exactly
``imms_at_target`` per imm and every byte landed (it must: the failure contract's "Losing a
NIC"). Needs root, iproute2 and nftables.

    python benchmarks/nic_loss.py --reps 5 --json benchmarks/results/nic-loss.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

from fabric_core.testing.netns import NetnsLab, netns_unavailable
from fabric_core.testing.remote import RemoteEngine, WorkerPool

MiB = 1 << 20


def _stream(
    lab: NetnsLab,
    a: RemoteEngine,
    b: RemoteEngine,
    mr: Any,
    desc: Any,
    src: Any,
    dst: Any,
    args: Any,
    fault: bool,
) -> dict[str, Any]:
    size, count, base = args.size, args.count, 1000 if fault else 0
    dst[:] = 0
    retries = a.stats().retries
    started = time.monotonic()
    transfers = []
    for i in range(count):
        off = (i % (len(dst) // size)) * size
        transfers.append(a.submit_write(mr, off, size, desc, off, imm=base + i))
        if fault and i == count // 3:
            lab.nic_fail(0, 1)
    for t in transfers:
        t.wait(60)
    took = time.monotonic() - started
    for i, t in enumerate(transfers):
        counter = b.counter(base + i)
        counter.wait(t.imms_at_target, timeout=10)
    time.sleep(0.2)
    exact = all(b.counter(base + i).value == 0 for i in range(count))
    span = min(count, len(dst) // size) * size
    landed = bool(np.array_equal(dst[:span], src[:span]))
    if fault:
        lab.nic_restore(0, 1)
    return {
        "seconds": took,
        "retries": a.stats().retries - retries,
        "exact_counts": exact,
        "bytes_landed": landed,
    }


def _rep(args: Any, live: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    with NetnsLab(hosts=2, rails=2, tag="nicbench") as lab:
        pool = WorkerPool(workers=0, arena_bytes=1 << 28)
        try:
            a, b = lab.engine(pool, 0, nics=2, **live), lab.engine(pool, 1, nics=2, **live)
            for rail in (0, 1):  # so the stream is still in flight when the NIC goes
                lab.rate_limit(0, args.mbit, rail)
            nbytes = 64 * MiB
            src, dst = pool.alloc(nbytes), pool.alloc(nbytes)
            src[:] = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
            mr, desc = a.register(src), b.register(dst).descriptor
            a.submit_imm(desc, 999_999).wait(10)
            b.counter(999_999).wait(1, timeout=10)
            a.fence([desc], timeout=10)  # the NIC-loss session is up: WriteImms use both NICs
            base = _stream(lab, a, b, mr, desc, src, dst, args, fault=False)
            hit = _stream(lab, a, b, mr, desc, src, dst, args, fault=True)
            return base, hit
        finally:
            pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size", type=int, default=1 * MiB, help="bytes per transfer")
    ap.add_argument("--count", type=int, default=48, help="transfers per stream")
    ap.add_argument("--mbit", type=float, default=200.0, help="rate limit of each of host 0's rails")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="liveness_timeout_s: above the time NIC 0 takes to drain what is queued ahead of a probe",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    live = {"liveness_interval_s": args.interval, "liveness_timeout_s": args.timeout, "timeout_s": 60.0}
    reps = []
    for r in range(args.reps):
        base, hit = _rep(args, live)
        reps.append({"baseline": base, "nic_lost": hit, "extra_s": hit["seconds"] - base["seconds"]})
        sys.stdout.write(
            f"rep {r}: baseline {base['seconds']:.3f} s, NIC lost {hit['seconds']:.3f} s "
            f"({hit['retries']} retried; exact counts {hit['exact_counts']}, bytes {hit['bytes_landed']})\n"
        )
    out = {
        "what": "a stream of sharded WriteImms over 2 NICs, host 0's NIC 1 lost a third of the way in "
        "(efa on tcp;ofi_rxm, netns hosts on two rails)",
        "transfer_bytes": args.size,
        "transfers": args.count,
        "rail_mbit": args.mbit,
        "liveness_interval_s": args.interval,
        "liveness_timeout_s": args.timeout,
        "reps": reps,
        "median_baseline_s": statistics.median(r["baseline"]["seconds"] for r in reps),
        "median_nic_lost_s": statistics.median(r["nic_lost"]["seconds"] for r in reps),
        "median_extra_s": statistics.median(r["extra_s"] for r in reps),
        "max_extra_s": max(r["extra_s"] for r in reps),
        # what the stream takes on one rail alone (the fault hits early: nearly all of it is
        # left to NIC 0), against which the NIC-lost time is measured
        "one_rail_s": args.count * args.size * 8 / (args.mbit * 1e6),
        "all_exact": all(r["nic_lost"]["exact_counts"] and r["nic_lost"]["bytes_landed"] for r in reps),
        "host": platform.node(),
    }
    sys.stdout.write(
        f"median extra {out['median_extra_s']:.3f} s (max {out['max_extra_s']:.3f} s); "
        f"all exact: {out['all_exact']}\n"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
