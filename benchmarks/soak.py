"""A long soak across processes on the efa backend (fabric_core.testing.soak), with NIC faults.

Per provider (shm, tcp;ofi_rxm): a writer engine in this process (two NICs; its NIC 1 is
taken down every fourth round) and a target engine in a worker process, running rounds of
mixed traffic for ``--minutes``. Every round's counts, bytes and messages are checked
exactly; after each round the resident memory, open file descriptors and threads of both
processes, and both engines' registrations, are sampled. Reported: rounds, transfers,
retries, problems (must be none) and, after warm-up, the slope per round of each resource
and its growth (median of the last third minus the first). With ``--plot``, resident memory
over the rounds.

    python benchmarks/soak.py --minutes 5 --json benchmarks/results/soak.json \
        --plot benchmarks/results/soak.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("FI_TCP_IFACE", "lo")  # never the first interface: loopback only

from fabric_core.settings import load_settings
from fabric_core.testing.remote import RemoteEngine, WorkerPool
from fabric_core.testing.soak import SoakReport, run_soak
from fabric_efa.engine import EfaEngine

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}


def soak(pool: WorkerPool, provider: str, seconds: float, seed: int) -> SoakReport:
    name = PROVIDERS[provider]
    writer = EfaEngine(load_settings(backend="efa", efa_provider=name, nics=2, timeout_s=30))
    worker = pool.workers[0]
    target = RemoteEngine(pool, worker, {"backend": "efa", "efa_provider": name, "nics": 2, "timeout_s": 30})
    try:
        return run_soak(
            writer,
            target,
            pool.alloc,
            pids={"writer": os.getpid(), "target": worker.pid},
            seconds=seconds,
            seed=seed,
            sample_every=10,
            kill_nic=lambda nic: writer._core.inject_nic_failure(nic, True, seed),
            restore_nic=lambda nic: writer._core.inject_nic_failure(nic, False, seed),
        )
    finally:
        writer.close()
        target.close()


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (provider, doc) in zip(axes[0], results.items(), strict=True):
        rounds = [s["round"] for s in doc["samples"]]
        for proc in ("writer", "target"):
            rss = [s["rss_kib"][proc] / 1024 for s in doc["samples"]]
            slope = doc["slopes"].get(proc, {}).get("rss_kib_per_round", 0.0)
            ax.plot(rounds, rss, label=f"{proc} ({slope:+.2f} KiB/round after warm-up)")
        ax.set_title(f"efa/{provider}: {doc['rounds']} rounds, {doc['transfers']} transfers")
        ax.set_xlabel("round")
        ax.set_ylabel("resident memory (MiB)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="per provider (default 5)")
    parser.add_argument("--providers", default="shm,tcp", help="comma-separated: shm, tcp")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="plot resident memory over the rounds here (png)")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    failed = False
    with WorkerPool(workers=2, arena_bytes=1 << 24) as pool:
        for provider in args.providers.split(","):
            report = soak(pool, provider, args.minutes * 60, args.seed)
            doc = report.to_json()
            results[provider] = doc
            growth = doc["growth_after_warmup"]
            _say(
                f"efa/{provider}: {report.rounds} rounds, {report.transfers} transfers, {report.messages} "
                f"messages, {report.nic_faults} NIC faults, {report.retries} retried work requests, "
                f"{len(report.problems)} problems"
            )
            for proc, s in doc["slopes"].items():
                _say(
                    f"  {proc}: rss {s['rss_kib_per_round']:+.3f} KiB/round, growth "
                    f"{growth['rss_kib'][proc]:+.0f} KiB; fds {growth['fds'][proc]:+.0f}, "
                    f"threads {growth['threads'][proc]:+.0f}"
                )
            for p in report.problems[:10]:
                _say(f"  problem: {p}")
            failed = failed or bool(report.problems)
            failed = failed or any(growth[w][p] != 0 for w in ("fds", "threads") for p in growth[w])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"host": platform.node(), "python": sys.version.split()[0], "minutes": args.minutes}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
