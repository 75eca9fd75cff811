"""fabric-efa against the raw-libfabric ceiling, side by side in one run, as ratios.

Usage: python benchmarks/efa_vs_ceiling.py CEILING_BINARY OUT_DIR [--reps N] [--providers shm,tcp]

For each provider, alternating ``--reps`` times: the ceiling program (fi_ceiling.c: fi_writedata
in a window of 64, CQ polling, no engine) and ``fabric bench --backend efa`` (writer here,
target in a bench-server process) on the same sizes. Medians over the repetitions; ratios are
fabric / ceiling. Writes ``efa-vs-ceiling.json`` and ``efa-vs-ceiling.png`` to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SIZES = [4096, 65536, 1 << 20, 16 << 20]
PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}


def _ceiling(binary: str, provider: str) -> dict[str, Any]:
    sizes = ",".join(str(s) for s in SIZES)
    out = subprocess.run(
        [binary, "-p", provider, "-s", sizes, "-r", "3"],
        env={**os.environ, "FI_TCP_IFACE": "lo"},
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    bw = {r["size"]: r for r in rows if r["kind"] == "bandwidth"}
    lat = [r for r in rows if r["kind"] != "bandwidth"]
    return {"bandwidth": bw, "latency": lat}


def _fabric(provider: str, tmp: Path) -> dict[str, Any]:
    out = tmp / "sweep.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env.update(FABRIC_EFA_PROVIDER=provider, FI_TCP_IFACE="lo")
    sizes = ",".join(str(s) for s in SIZES)
    cmd = [sys.executable, "-m", "fabric_core.cli", "bench", "--backend", "efa", "--nics", "1"]
    subprocess.run([*cmd, "--sizes", sizes, "--json", str(out)], env=env, check=True, timeout=900)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ceiling")
    ap.add_argument("out", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--providers", default="shm,tcp")
    args = ap.parse_args()
    report: dict[str, Any] = {"sizes": SIZES, "reps": args.reps, "providers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for tag in args.providers.split(","):
            provider = PROVIDERS[tag]
            ceil_bw: dict[int, list[float]] = {s: [] for s in SIZES}
            ceil_wps: dict[int, list[float]] = {s: [] for s in SIZES}
            fab_bw: dict[int, list[float]] = {s: [] for s in SIZES}
            fab_rtt: dict[int, list[float]] = {s: [] for s in SIZES}
            paged: list[float] = []
            submit: list[float] = []
            for _ in range(args.reps):
                c = _ceiling(args.ceiling, provider)
                f = _fabric(provider, Path(tmp))
                for s in SIZES:
                    ceil_bw[s].append(c["bandwidth"][s]["gbytes_per_s"])
                    ceil_wps[s].append(c["bandwidth"][s]["mwrites_per_s"] * 1e6)
                for r in f["results"]:
                    fab_bw[r["size"]].append(r["bandwidth_gbytes_per_s"])
                    fab_rtt[r["size"]].append(r["latency_us_p50"])
                paged.append(f["paged"]["pages_per_s"])
                submit.append(f["submit_cost_us"])
            med = statistics.median
            rows = []
            for s in SIZES:
                rows.append(
                    {
                        "size": s,
                        "ceiling_gbytes_per_s": med(ceil_bw[s]),
                        "fabric_gbytes_per_s": med(fab_bw[s]),
                        "ratio": med(fab_bw[s]) / med(ceil_bw[s]),
                        "fabric_round_trip_us_p50": med(fab_rtt[s]),
                    }
                )
            report["providers"][tag] = {
                "provider": provider,
                "rows": rows,
                "paged_pages_per_s": med(paged),
                "ceiling_4k_writes_per_s": med(ceil_wps[4096]),
                "paged_ratio": med(paged) / med(ceil_wps[4096]),
                "submit_cost_us": med(submit),
            }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "efa-vs-ceiling.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, args.out / "efa-vs-ceiling.png")
    for tag, p in report["providers"].items():
        for r in p["rows"]:
            sys.stdout.write(
                f"{tag:4} {r['size']:>9} B  fabric {r['fabric_gbytes_per_s']:7.3f} GB/s  "
                f"ceiling {r['ceiling_gbytes_per_s']:7.3f} GB/s  ratio {r['ratio']:.2f}\n"
            )
        sys.stdout.write(
            f"{tag:4} paged {p['paged_pages_per_s']:.0f} pages/s, "
            f"ratio {p['paged_ratio']:.2f} of 4 KiB writes/s\n"
        )
    return 0


def _plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for tag, p in report["providers"].items():
        sizes = [r["size"] for r in p["rows"]]
        ax.loglog(
            sizes, [r["ceiling_gbytes_per_s"] for r in p["rows"]], "s--", label=f"raw libfabric ({tag})"
        )
        ax.loglog(sizes, [r["fabric_gbytes_per_s"] for r in p["rows"]], "o-", label=f"fabric-efa ({tag})")
    ax.set(xlabel="write size (bytes)", ylabel="GB/s", title="fabric-efa vs raw libfabric, two processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
