"""Where the host time of an MoE step goes: ``fabric bench moe``'s run with a timer around each
stage of ``MoeAllToAll`` and of the ``all_to_all_single`` baseline, in every rank.

The bench times a phase end to end; this script says which calls inside it take the time, so a
change aimed at one of them can be checked against its share. Each wrapped call costs about a
microsecond of timer; times are inclusive (``dispatch_send`` contains ``submit_write``).

    python benchmarks/moe_phases.py --device cuda --tokens 128 --steps 40 [--json out.json]

On a host without GPUs use ``--device cpu`` (efa on shm, gloo for the baseline; torch's CPU
kernels then dominate). Prints, per implementation and stage: calls per step, median and mean
microseconds per call, and microseconds per step (mean x calls), for each rank. The rows
``engine._process (completion thread)`` and ``(drainer)`` time the batches of completions
handed to Python by the engine's completion thread (which holds the GIL meanwhile) and by a
waiting thread. ``MOE_PHASES_COMPLETION_NAP_S=S`` makes the completion thread nap S seconds
before each batch, so that waiting threads take most completions themselves (an experiment on
GIL hand-offs, docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

_DIR_ENV = "MOE_PHASES_DIR"


def _install() -> dict[str, list[float]]:
    """Wrap the stages of both implementations with timers; returns the per-label lists."""
    import torch

    from fabric_apps.moe import alltoall, baseline
    from fabric_core import counters, native

    spans: dict[str, list[float]] = defaultdict(list)

    def wrap(owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spans[label].append(time.perf_counter() - t0)

        setattr(owner, name, timed)

    for name in (
        "dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "_wait_all", "_drain",
        "_buffers_ready", "_check_records", "_raise_failed_sends", "_payload_imms",
    ):  # fmt: skip
        wrap(alltoall.MoeAllToAll, name, f"fabric {name}")
    for name in ("dispatch", "combine", "_a2a"):
        wrap(baseline.CollectiveMoe, name, f"baseline {name}")
    for module, impl in ((alltoall, "fabric"), (baseline, "baseline")):
        for name in ("check_inputs", "destinations", "group_received", "combine_positions", "weighted_sum"):
            wrap(module, name, f"{impl} {name}")
    for name in ("submit_write", "submit_imm", "submit_scatter"):
        wrap(native.NativeEngine, name, f"fabric engine.{name}")
    wrap(counters.TableCounter, "expect", "fabric counter.expect")
    # completions handed to Python, by the thread that did it: the completion thread holds
    # the GIL meanwhile (the main thread's torch calls release and retake it), a drainer is
    # the waiting thread itself
    inner_process: Callable[..., Any] = native.NativeEngine._process

    def process(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner_process(self, *args)
        finally:
            who = "completion thread" if "completion" in threading.current_thread().name else "drainer"
            spans[f"fabric engine._process ({who})"].append(time.perf_counter() - t0)

    native.NativeEngine._process = process  # type: ignore[method-assign]
    # Experiment (MOE_PHASES_COMPLETION_NAP_S): the completion thread naps that long before each
    # batch it takes, so the waiting thread hands most completions to Python itself (no GIL
    # hand-off between threads in the middle of the step's torch calls).
    nap = float(os.environ.get("MOE_PHASES_COMPLETION_NAP_S", "0"))
    if nap > 0:
        next_batch: Callable[..., Any] = native.NativeEngine._next_batch

        def napping(self: Any) -> Any:
            time.sleep(nap)
            return next_batch(self)

        native.NativeEngine._next_batch = napping  # type: ignore[method-assign]
    if torch.cuda.is_available():
        wrap(torch.cuda, "synchronize", "both torch.cuda.synchronize")
    return spans


def _rank(rank: int, spec: Any, port: int, conn: Any) -> None:
    """A bench rank with the timers in; they go to a file when the rank is done."""
    from fabric_apps.moe import bench

    spans = _install()
    try:
        bench._process_rank(rank, spec, port, conn)
    finally:
        path = Path(os.environ[_DIR_ENV]) / f"rank{rank}.json"
        path.write_text(json.dumps(spans))


def _summary(spans: dict[str, list[float]], steps: int) -> list[dict[str, Any]]:
    rows = []
    for label in sorted(spans, key=lambda s: (s.split()[0], -sum(spans[s]))):
        xs = spans[label]
        rows.append(
            {
                "stage": label,
                "calls_per_step": len(xs) / steps,
                "median_us": statistics.median(xs) * 1e6,
                "mean_us": statistics.fmean(xs) * 1e6,
                "us_per_step": sum(xs) / steps * 1e6,
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from fabric_apps.moe import bench

    spec = bench.MoeBenchSpec(
        backend="efa",
        ranks=2,
        shapes=(("decode", args.tokens),),
        steps=args.steps,
        warmup=args.warmup,
        device=args.device,
        baseline=not args.no_baseline,
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[_DIR_ENV] = tmp
        bench._process_rank = _rank  # the spawned ranks run _rank (this module, by name)
        result = bench.run_moe_bench(spec)
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(spec.ranks)]
    total = spec.steps + spec.warmup
    report: dict[str, Any] = {
        "spec": {"device": args.device, "tokens": args.tokens, "steps": args.steps, "warmup": args.warmup},
        "phases_p50_us": {
            impl: {phase: t.p50_us for phase, t in phases.items()}
            for impl, phases in result.times["decode"].items()
        },
        "ranks": [_summary(s, total) for s in per_rank],
        "host": result.host,
    }
    out = sys.stdout
    out.write(f"phase p50 (bench, slower rank): {json.dumps(report['phases_p50_us'])}\n")
    for r, rows in enumerate(report["ranks"]):
        out.write(f"rank {r} ({total} steps, warm-up included)\n")
        out.write(f"  {'stage':44s} {'calls':>6s} {'median us':>10s} {'mean us':>10s} {'us/step':>10s}\n")
        for row in rows:
            out.write(
                f"  {row['stage']:44s} {row['calls_per_step']:6.2f} {row['median_us']:10.1f} "
                f"{row['mean_us']:10.1f} {row['us_per_step']:10.1f}\n"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
