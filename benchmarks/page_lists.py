"""Paged writes on tcp;ofi_rxm with and without lists (several pages a write), against the
raw-libfabric ceiling's 4 KiB writes, alternated round by round on one host.

Each round runs, in an order rotated from round to round: the ceiling (``fi_ceiling -s 4096``,
its plain and its delivery-complete writes, ``-b`` so that the writes cycle through 64 MiB as
pages of a KV cache do) and ``fabric bench --backend efa --nics 1 --sizes 4K`` with
``FABRIC_EFA_LIST_PAGES`` at 1 (a write a page) and at the default (4). The paged rate is the
bench's (1,024 pages of 4 KiB to a shuffled page list, one imm per page, checked). Ratios are
taken within a round, since this host's speed moves between runs.

    python benchmarks/page_lists.py CEILING_BINARY OUT_DIR [--rounds 6]

Writes ``page-lists.json`` and ``page-lists.png`` to OUT_DIR.
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

TCP = "tcp;ofi_rxm"


def _ceiling(binary: str, delivery: bool) -> float:
    cmd = [binary, "-p", TCP, "-s", "4096", "-r", "3", "-l", "0", "-b", str(64 << 20)]
    if delivery:
        cmd.append("-d")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return float(row["mwrites_per_s"]) * 1e6


def _fabric(list_pages: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        env = {**os.environ, "FABRIC_EFA_PROVIDER": TCP, "FABRIC_EFA_LIST_PAGES": str(list_pages)}
        cmd = [sys.executable, "-m", "fabric_core.cli", "bench", "--backend", "efa", "--nics", "1"]
        cmd += ["--sizes", "4K", "--iters", "200", "--json", str(path)]
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=300)
        return float(json.loads(path.read_text())["paged"]["pages_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ceiling")
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    steps: dict[str, Any] = {
        "ceiling": lambda: _ceiling(args.ceiling, False),
        "ceiling_dc": lambda: _ceiling(args.ceiling, True),
        "pages_1": lambda: _fabric(1),
        "pages_4": lambda: _fabric(4),
    }
    names = list(steps)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {name: steps[name]() for name in order}
        rounds.append(got)
        line = f"round {r + 1}: " + ", ".join(f"{k} {got[k] / 1e3:.0f}k" for k in names)
        sys.stdout.write(line + f"; lists/none {got['pages_4'] / got['pages_1']:.2f}\n")
        sys.stdout.flush()

    def med(f: Any) -> float:
        return statistics.median(f(x) for x in rounds)

    summary = {
        "rounds": rounds,
        "median_per_s": {k: med(lambda x, k=k: x[k]) for k in names},
        "ratio_lists_to_none": med(lambda x: x["pages_4"] / x["pages_1"]),
        "ratio_lists_to_ceiling": med(lambda x: x["pages_4"] / x["ceiling"]),
        "ratio_lists_to_ceiling_dc": med(lambda x: x["pages_4"] / x["ceiling_dc"]),
        "ratio_none_to_ceiling": med(lambda x: x["pages_1"] / x["ceiling"]),
        "ratio_none_to_ceiling_dc": med(lambda x: x["pages_1"] / x["ceiling_dc"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "page-lists.json").write_text(json.dumps(summary, indent=1) + "\n")
    sys.stdout.write(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {
        "ceiling": "ceiling, 4 KiB writes",
        "ceiling_dc": "ceiling, delivery complete",
        "pages_1": "fabric paged, a write a page",
        "pages_4": "fabric paged, 4 pages a write",
    }
    for k in names:
        ax.plot(range(1, len(rounds) + 1), [x[k] / 1e3 for x in rounds], marker="o", label=labels[k])
    ax.set_xlabel("round")
    ax.set_ylabel("thousand writes or pages per second")
    ax.set_title("tcp;ofi_rxm, 4 KiB pages: lists against a write a page")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "page-lists.png", dpi=110)


if __name__ == "__main__":
    main()
