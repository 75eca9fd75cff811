"""Plot a `fabric bench --json` sweep: latency and bandwidth against message size.

Usage: python benchmarks/plot_sweep.py SWEEP.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(sweep: dict, out: Path) -> None:  # type: ignore[type-arg]
    rows = sweep["results"]
    sizes = [r["size"] for r in rows]
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    lat.loglog(sizes, [r["latency_us_p50"] for r in rows], "o-", label="wall p50")
    lat.loglog(sizes, [r["latency_us_p99"] for r in rows], "o--", label="wall p99")
    bw.loglog(sizes, [r["bandwidth_gbps"] for r in rows], "o-", label="wall")
    if "sim_latency_us_p50" in rows[0]:
        lat.loglog(sizes, [r["sim_latency_us_p50"] for r in rows], "s-", label=f"simulated ({sweep['link']})")
        bw.loglog(sizes, [r["sim_bandwidth_gbps"] for r in rows], "s-", label=f"simulated ({sweep['link']})")
    lat.set(xlabel="message size (bytes)", ylabel="write+imm latency (µs)", title="latency")
    bw.set(xlabel="message size (bytes)", ylabel="Gbit/s", title="bandwidth (pipelined)")
    for ax in (lat, bw):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"fabric bench on {sweep['backend']} ({sweep['nics']} NICs): "
        f"submit {sweep['submit_cost_us']:.1f} µs, "
        f"{sweep['sim_throughput_wrs_per_s'] / 1e3:.1f}k simulated WRs/s of wall time"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
