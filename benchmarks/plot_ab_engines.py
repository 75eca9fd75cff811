"""Summarize and plot an alternated A/B of two engine builds (benchmarks/ab_engines.sh).

    python benchmarks/plot_ab_engines.py OUT

Reads OUT/rtt-{base,new}-PROVIDER-ROUND.json (benchmarks/rtt_breakdown.py) and
OUT/bench-{base,new}-PROVIDER-ROUND.json (``fabric bench``), writes OUT/summary.json (for
every row: each round's figure per build, their medians, new/base per round and how many
rounds the new build did better in) and OUT/ab.png (medians, each round's figures as dots).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# row -> (unit, higher is better)
_ROWS: dict[str, tuple[str, bool]] = {
    "round trip, imm only (rtt_breakdown)": ("us", False),
    "round trip, 8 B write + imm back (fabric bench)": ("us", False),
    "64 KiB writes": ("GB/s", True),
    "1 MiB writes": ("GB/s", True),
    "16 MiB writes": ("GB/s", True),
    "paged 4 KiB": ("k pages/s", True),
    "submit cost": ("us", False),
}


def _figures(path: Path) -> dict[str, float]:
    doc = json.loads(path.read_text())
    if path.name.startswith("rtt-"):
        return {"round trip, imm only (rtt_breakdown)": doc["parts"]["total"]["p50_us"]}
    by_size = {r["size"]: r for r in doc["results"]}
    return {
        "round trip, 8 B write + imm back (fabric bench)": by_size[8]["latency_us_p50"],
        "64 KiB writes": by_size[65536]["bandwidth_gbytes_per_s"],
        "1 MiB writes": by_size[1 << 20]["bandwidth_gbytes_per_s"],
        "16 MiB writes": by_size[16 << 20]["bandwidth_gbytes_per_s"],
        "paged 4 KiB": doc["paged"]["pages_per_s"] / 1e3,
        "submit cost": doc["submit_cost_us"],
    }


def summarize(out: Path) -> dict[str, Any]:
    # (provider, row) -> build -> round -> figure
    got: dict[tuple[str, str], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for path in sorted(out.glob("*.json")):
        parts = path.stem.split("-")
        if len(parts) != 4 or parts[0] not in ("rtt", "bench"):
            continue
        _, build, provider, rnd = parts
        for row, value in _figures(path).items():
            got[(provider, row)][build][int(rnd)] = value
    rows = []
    for (provider, row), builds in sorted(got.items()):
        unit, higher = _ROWS[row]
        base, new = builds.get("base", {}), builds.get("new", {})
        paired = sorted(set(base) & set(new))
        ratios = [new[r] / base[r] for r in paired if base[r]]
        better = sum(1 for r in paired if (new[r] > base[r]) == higher and new[r] != base[r])
        rows.append(
            {
                "provider": provider,
                "row": row,
                "unit": unit,
                "higher_is_better": higher,
                "base": [base[r] for r in sorted(base)],
                "new": [new[r] for r in sorted(new)],
                "base_median": statistics.median(base.values()) if base else None,
                "new_median": statistics.median(new.values()) if new else None,
                "new_over_base_per_round": ratios,
                "new_better_in": f"{better} of {len(paired)}",
            }
        )
    return {"what": "two engine builds alternated (benchmarks/ab_engines.sh)", "rows": rows}


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    providers = sorted({r["provider"] for r in rows})
    names = [name for name in _ROWS if any(r["row"] == name for r in rows)]
    fig, axes = plt.subplots(
        len(providers), len(names), figsize=(1.9 * len(names), 2.8 * len(providers)), squeeze=False
    )
    for r in rows:
        ax = axes[providers.index(r["provider"])][names.index(r["row"])]
        for x, build, colour in ((0, "base", "tab:gray"), (1, "new", "tab:blue")):
            if r[f"{build}_median"] is None:
                continue
            ax.bar(x, r[f"{build}_median"], color=colour, alpha=0.6)
            ax.scatter([x] * len(r[build]), r[build], color="k", s=8, zorder=3)
        ax.set_xticks([0, 1], ["base", "new"])
        ax.set_title(f"{r['provider']}\n{r['row']}".replace(" (", "\n("), fontsize=6)
        ax.set_ylabel(r["unit"], fontsize=7)
        ax.tick_params(labelsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    out = Path(sys.argv[1])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in summary["rows"]:
        sys.stdout.write(
            f"{r['provider']:4s} {r['row']:48s} base {r['base_median']:9.2f}  new {r['new_median']:9.2f} "
            f"{r['unit']:9s} new better in {r['new_better_in']}\n"
        )
    plot(summary, out / "ab.png")


if __name__ == "__main__":
    main()
