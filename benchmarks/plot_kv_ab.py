"""Summarize and plot a KvCache engine A/B (benchmarks/device/ab_kv.sh): per run, fabric's time
over NCCL's for the new and base engines, per cache layout, and the median phases.

Usage: python benchmarks/plot_kv_ab.py RESULTS_DIR OUT.png > summary.txt
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

NAME = re.compile(r"kv-(new|base)-(stacked|interleaved)-(\d+)\.json")


def load(folder: Path) -> dict[tuple[str, str], list[tuple[int, dict]]]:  # type: ignore[type-arg]
    runs: dict[tuple[str, str], list[tuple[int, dict]]] = {}  # type: ignore[type-arg]
    for f in sorted(folder.glob("kv-*.json")):
        m = NAME.fullmatch(f.name)
        if m is None:
            continue
        kv = json.loads(f.read_text())
        kv = kv.get("kvcache", kv)
        runs.setdefault((m[1], m[2]), []).append((int(m[3]), kv))
    for v in runs.values():
        v.sort(key=lambda x: x[0])
    return runs


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    runs = load(folder)
    layouts = [s for s in ("stacked", "interleaved") if any(k[1] == s for k in runs)]
    fig, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 4), squeeze=False)
    for ax, layout in zip(axes[0], layouts, strict=True):
        say = sys.stdout.write
        say(f"{layout}: fabric time / NCCL time per run (median of the run's repetitions)\n")
        for tag, style in (("new", "o-"), ("base", "s--")):
            rows = runs.get((tag, layout), [])
            if not rows:
                continue
            ratios = [kv["fabric_over_nccl_time"] for _, kv in rows]
            fab = [kv["fabric_ms"] for _, kv in rows]
            nccl = [kv["nccl_ms"] for _, kv in rows]
            phases = {
                k: statistics.median(kv["phases_median_ms"][k] for _, kv in rows)
                for k in ("prefill_submit_ms", "prefill_submitted_to_done_ms")
            }
            say(
                f"  {tag:4s} runs {' '.join(f'{r:.2f}' for r in ratios)}; "
                f"median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}; "
                f"fabric {min(fab):.1f}-{max(fab):.1f} ms, NCCL {min(nccl):.1f}-{max(nccl):.1f} ms; "
                f"submit {phases['prefill_submit_ms']:.2f} ms, "
                f"after it {phases['prefill_submitted_to_done_ms']:.2f} ms (medians)\n"
            )
            ax.plot([i for i, _ in rows], ratios, style, label=f"{tag} engine")
        ax.set_xticks(sorted({i for tag in ("new", "base") for i, _ in runs.get((tag, layout), [])}))
        ax.axhline(1.25, color="red", lw=0.8, ls=":", label="target 1.25")
        ax.axhline(1.0, color="gray", lw=0.6)
        ax.set(title=f"KvCache, {layout} caches", xlabel="round", ylabel="fabric time / NCCL time")
        ax.set_ylim(0, 1.6)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
