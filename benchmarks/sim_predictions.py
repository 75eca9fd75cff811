"""The simulator's predictions next to the reference system's published figures (docs/sim.md).

Runs every scenario of ``fabric_sim.predict`` with the cluster presets unchanged and writes
``benchmarks/results/sim/<scenario>.json`` (each prediction whole), ``predictions.json`` (the
table) and ``predictions.png`` (predicted vs reported, per figure); ``--only`` reruns one
scenario and replaces its rows in the table. Takes about ten minutes
and ~6 GB of memory on a 2-core machine (RL at 384 ranks is most of it).

    python benchmarks/sim_predictions.py [--only moe|rl|kv|peak] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fabric_sim.predict import Prediction, predict_kv, predict_moe, predict_peak, predict_rl, report

OUT = Path(__file__).parent / "results" / "sim"


def _save(pred: Prediction, name: str, out: Path) -> Prediction:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(pred.to_json() + "\n")
    sys.stdout.write(report(pred) + "\n")
    sys.stdout.flush()
    return pred


def run(only: str | None, out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(figure: str, pred: Prediction, phase: str, reported: float | None, unit: str) -> None:
        ph = pred.phases[phase]
        rows.append(
            {
                "figure": figure,
                "cluster": pred.cluster,
                "predicted": ph.makespan_s,
                "predicted_mean_rank": ph.mean_rank_s,
                "reported": reported,
                "ratio": ph.makespan_s / reported if reported else None,
                "unit": unit,
                "busiest_link": ph.summary["links"][0]["link"] if ph.summary["links"] else None,
                "busiest_utilisation": ph.summary["links"][0]["utilisation"] if ph.summary["links"] else None,
            }
        )

    if only in (None, "peak"):
        for cluster in ("cx7-400g", "efa-p5", "efa-p5en"):
            p = _save(predict_peak(cluster), f"peak-{cluster}", out)
            rows.append(
                {
                    "figure": "peak bandwidth, one GPU",
                    "cluster": cluster,
                    "predicted": p.extra["gbps"],
                    "reported": (p.reference or {}).get("gbps"),
                    "ratio": p.extra["gbps"] / p.reference["gbps"] if p.reference else None,
                    "unit": "Gbit/s",
                }
            )
    if only in (None, "moe"):
        for cluster in ("cx7-400g", "efa-p5"):
            for ep in (8, 64):
                p = _save(predict_moe(cluster, ep), f"moe-{cluster}-ep{ep}", out)
                ref = p.reference or {}
                row(f"MoE EP{ep} dispatch", p, "dispatch", ref.get("dispatch_s"), "s")
                row(f"MoE EP{ep} combine", p, "combine", ref.get("combine_s"), "s")
        p = _save(predict_moe("cx7-400g", 8, nvlink=False), "moe-cx7-400g-ep8-no-nvlink", out)
        row("MoE EP8 dispatch, no NVLink path", p, "dispatch", None, "s")
        row("MoE EP8 combine, no NVLink path", p, "combine", None, "s")
    if only in (None, "rl"):
        for cluster in ("cx7-400g", "efa-p5"):
            p = _save(predict_rl(cluster), f"rl-{cluster}", out)
            row("RL weight update, Kimi-K2 256->128", p, "step", (p.reference or {}).get("step_s"), "s")
            rows[-1]["bound"] = p.extra["bound_s"]
    if only in (None, "kv"):
        for cluster in ("cx7-400g", "efa-p5"):
            for layer_s in (0.0, 1e-3):
                p = _save(predict_kv(cluster, layer_s=layer_s), f"kv-{cluster}-layer{layer_s * 1e3:g}ms", out)
                row(f"KvCache 8 x 8K tokens, layers every {layer_s * 1e3:g} ms", p, "kv", None, "s")
                rows[-1]["tail_after_last_layer"] = p.extra["tail_after_last_layer_s"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("reported")]
    if not shown:
        return False  # nothing published to set these against
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.2))
    labels = [f"{r['figure']} ({r['cluster']})" for r in shown]
    ratios = [r["ratio"] for r in shown]
    ax.barh(
        range(len(shown)), ratios, color=["tab:blue" if 0.7 <= x <= 1.3 else "tab:orange" for x in ratios]
    )
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvspan(0.7, 1.3, color="tab:green", alpha=0.1, label="within ±30%")
    ax.set_yticks(range(len(shown)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("predicted / reported (network-only prediction, presets unchanged)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("moe", "rl", "kv", "peak"))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    t0 = time.monotonic()
    rows = run(args.only, args.out)
    table = args.out / "predictions.json"
    if args.only is not None and table.exists():
        # one scenario rerun: its rows replace their old ones in the whole table
        kept = [r for r in json.loads(table.read_text()) if _scenario(r) != args.only]
        rows = sorted(kept + rows, key=lambda r: _ORDER.index(_scenario(r)))
    table.write_text(json.dumps(rows, indent=1) + "\n")
    plotted = plot(rows, args.out / "predictions.png")
    also = " and .png" if plotted else ""
    sys.stdout.write(f"wrote {table}{also} in {time.monotonic() - t0:.0f} s\n")


_ORDER = ("peak", "moe", "rl", "kv")


def _scenario(row: dict[str, Any]) -> str:
    figure = str(row["figure"])
    for prefix, name in (("peak", "peak"), ("MoE", "moe"), ("RL", "rl"), ("KvCache", "kv")):
        if figure.startswith(prefix):
            return name
    raise ValueError(f"a row of no known scenario: {figure!r}")


if __name__ == "__main__":
    main()
