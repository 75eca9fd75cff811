"""What confirming a write costs on tcp;ofi_rxm, with no engine in the way.

A completed fabric write has its bytes in place at the target. On tcp that takes a
confirmation the plain ceiling never waits for: fabric asks the provider for
FI_DELIVERY_COMPLETE (the target's provider acknowledges each write). The other way to get it
is for the target's software to acknowledge writes itself, as fabric's eager writes do. This
runs benchmarks/ceiling/fi_ceiling.c in four modes, rotated round by round so that no mode
always runs first: plain (transmit complete), ``-d`` (delivery complete), ``-a -A 1`` (the
target sends an acknowledgement after each poll that saw writes) and ``-a -A 16`` (after
every 16 writes at most), and reports each mode's GB/s and its ratio to the plain run of the
same round (median over rounds). Writes the runs (JSON lines), the summary (JSON) and a plot.

This 2-core machine runs loopback tcp in two states, and flips between them from one process
to the next whatever the CPU placement: about 3.5-4 GB/s at 64 KiB, or about 1.4. A ratio
between runs in different states says nothing about the modes, so the summary also gives the
medians over the "fast" rounds alone: those where every mode's 64 KiB run reached 2.5 GB/s.

    cc -O2 -o /tmp/fi_ceiling benchmarks/ceiling/fi_ceiling.c -lfabric
    python benchmarks/confirm_cost.py /tmp/fi_ceiling OUT_DIR [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODES: dict[str, list[str]] = {
    "plain": [],
    "delivery_complete": ["-d"],
    "target_acks_1": ["-a", "-A", "1"],
    "target_acks_16": ["-a", "-A", "16"],
}
SIZES = (65536, 1048576, 16777216)


def run(ceiling: str, args: list[str]) -> list[dict[str, object]]:
    cmd = [ceiling, "-p", "tcp;ofi_rxm", "-s", ",".join(map(str, SIZES)), "-r", "3", "-l", "0"]
    cmd += ["-n", str(1 << 30), *args]
    env = dict(os.environ, FI_TCP_IFACE="lo")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


FAST_64K = 2.5  # GB/s at 64 KiB: the machine's fast state (see above)


def summarize(runs: list[dict[str, object]]) -> dict[str, object]:
    def gbps(mode: str, size: int, rnd: int) -> float:
        (hit,) = [r for r in runs if r["mode"] == mode and r["size"] == size and r["round"] == rnd]
        return float(hit["gbytes_per_s"])  # type: ignore[arg-type]

    rounds = sorted({int(r["round"]) for r in runs})  # type: ignore[call-overload]
    fast = [k for k in rounds if all(gbps(m, SIZES[0], k) >= FAST_64K for m in MODES)]
    rows = []
    for size in SIZES:
        for mode in MODES:
            values = [gbps(mode, size, k) for k in rounds]
            ratios = [gbps(mode, size, k) / gbps("plain", size, k) for k in rounds]
            fast_ratios = [gbps(mode, size, k) / gbps("plain", size, k) for k in fast]
            rows.append(
                {
                    "size": size,
                    "mode": mode,
                    "gbytes_per_s_median": statistics.median(values),
                    "gbytes_per_s": values,
                    "ratio_to_plain_median": statistics.median(ratios),
                    "ratio_to_plain": ratios,
                    "fast_gbytes_per_s": [gbps(mode, size, k) for k in fast],
                    "fast_ratio_to_plain_median": statistics.median(fast_ratios) if fast else None,
                }
            )
    return {"provider": "tcp;ofi_rxm", "rounds": len(rounds), "fast_rounds": fast, "rows": rows}


def plot(summary: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    assert isinstance(rows, list)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, mode in enumerate(MODES):
        key = "fast_ratio_to_plain_median" if summary["fast_rounds"] else "ratio_to_plain_median"
        ys = [r[key] for r in rows if r["mode"] == mode]
        ax.bar([x + i * width for x in range(len(SIZES))], ys, width, label=mode)
    ax.set_xticks([x + 1.5 * width for x in range(len(SIZES))], ["64 KiB", "1 MiB", "16 MiB"])
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylabel("GB/s against plain, same round\n(median over the fast rounds)")
    ax.set_title("fi_ceiling on tcp;ofi_rxm: what confirming writes costs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ceiling")
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--from-runs", action="store_true", help="summarize OUT/runs.jsonl again; run nothing"
    )
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    names = list(MODES)
    runs: list[dict[str, object]] = []
    if a.from_runs:
        runs = [json.loads(line) for line in (a.out / "runs.jsonl").read_text().splitlines()]
    for rnd in range(1, 0 if a.from_runs else a.rounds + 1):
        for k in range(len(names)):
            mode = names[(k + rnd) % len(names)]
            for row in run(a.ceiling, MODES[mode]):
                runs.append({**row, "mode": mode, "round": rnd})
    (a.out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    summary = summarize(runs)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, a.out / "confirm-cost.png")
    for r in summary["rows"]:  # type: ignore[attr-defined]
        fast = r["fast_ratio_to_plain_median"]
        sys.stdout.write(
            f"{r['size']:>9} {r['mode']:>18}: {r['gbytes_per_s_median']:.2f} GB/s, "
            f"{r['ratio_to_plain_median']:.2f} of plain; fast rounds {r['fast_gbytes_per_s']} GB/s, "
            f"{fast if fast is None else round(fast, 2)} of plain\n"
        )
    sys.stdout.write(f"fast rounds: {summary['fast_rounds']}\n")


if __name__ == "__main__":
    main()
