"""The raw-libfabric ceiling program (``benchmarks/ceiling/fi_ceiling.c``) that every
benchmark's bound comes from, built and run for real on shm: a pair and a many-to-many fan
count every write they time, and ``fabric bench rl`` takes its bound from the fan that has
the update's own shape."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCE = ROOT / "benchmarks" / "ceiling" / "fi_ceiling.c"


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not SOURCE.exists():
        pytest.skip("no C compiler or no benchmarks/ceiling (not a source checkout)")
    out = tmp_path_factory.mktemp("ceiling") / "fi_ceiling"
    subprocess.run(
        [cc, "-O2", "-Wall", "-Werror", "-o", str(out), str(SOURCE), "-lfabric"], check=True, timeout=120
    )
    return out


def _rows(program: Path, *args: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(program), "-p", "shm", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_a_pair_times_every_write_and_the_round_trip(program: Path) -> None:
    rows = _rows(program, "-s", "4096,65536", "-r", "2", "-l", "50", "-b", str(1 << 20))
    bw = [r for r in rows if r["kind"] == "bandwidth"]
    assert [r["size"] for r in bw] == [4096, 65536]
    assert all(r["gbytes_per_s"] > 0 and r["t_end"] > r["t_start"] and r["span"] == 1 << 20 for r in bw)
    (rtt,) = [r for r in rows if r["kind"] == "imm_round_trip"]
    assert rtt["iters"] == 50 and 0 < rtt["rtt_us_p50"] <= rtt["rtt_us_p99"]


@pytest.mark.parametrize("every", [1, 3])
def test_a_pair_whose_target_acknowledges_the_writes_counts_every_one(program: Path, every: int) -> None:
    """-a: a write counts as done once the target's acknowledgement covers it (what
    benchmarks/confirm_cost.py measures); 1,000 writes a repetition is no multiple of 3, so the
    last acknowledgement covers a short run. The program exits non-zero where the target's
    count differs from the writes timed."""
    rows = _rows(
        program, "-s", "4096,65536", "-r", "2", "-l", "0", "-a", "-A", str(every), "-n", str(1000 * 4096)
    )
    assert [(r["size"], r["confirm"], r["acks_every"]) for r in rows] == [
        (4096, "target_acks", every),
        (65536, "target_acks", every),
    ]
    assert rows[0]["writes"] == 1000 and all(r["gbytes_per_s"] > 0 for r in rows)
    (plain,) = _rows(program, "-s", "4096", "-r", "1", "-l", "0", "-n", str(100 * 4096))
    assert (plain["confirm"], plain["acks_every"]) == ("transmit_complete", 0)


@pytest.mark.parametrize(("initiators", "targets"), [(3, 2), (1, 1), (2, 3)])
def test_a_fan_counts_every_initiators_writes_at_every_target(
    program: Path, initiators: int, targets: int
) -> None:
    """The program exits non-zero if a target counts other than its share of imms or an
    initiator other than its writes: a row means every count held."""
    n = 6 * 65536
    rows = _rows(program, "-f", f"{initiators}:{targets}", "-n", str(n), "-s", "65536,131072", "-r", "2")
    assert [r["size"] for r in rows] == [65536, 131072]
    for r in rows:
        assert r["kind"] == "fan_bandwidth" and (r["initiators"], r["targets"]) == (initiators, targets)
        want = n // r["size"]
        assert r["writes_per_initiator"] == max(targets, want - want % targets)  # the same to every target
        assert r["gbytes_per_s"] > 0 and r["t_end"] > r["t_start"] and r["reps"] == 2


def test_a_fan_with_a_window_per_target_writes_the_same_to_every_target(program: Path) -> None:
    """-W keeps at most N writes outstanding per target (the raw form of the engine's queue
    depth): every initiator still writes its whole share, split evenly."""
    n = 12 * 65536
    rows = _rows(program, "-W", "1", "-f", "2:3", "-n", str(n), "-s", "65536", "-r", "2")
    assert [r["kind"] for r in rows] == ["fan_bandwidth"]
    r = rows[0]
    assert r["per_target"] == 1 and r["writes_per_initiator"] == 12 and r["targets"] == 3
    assert r["gbytes_per_s"] > 0 and r["t_end"] > r["t_start"]


def test_bad_fan_shapes_are_refused(program: Path) -> None:
    for shape in ("0:2", "2", "3:-1"):
        done = subprocess.run([str(program), "-f", shape], capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and "INITIATORS:TARGETS" in done.stderr
    for nice in ("-1", "20"):
        done = subprocess.run(
            [str(program), "-N", nice, "-f", "2:1"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 1 and "nice value from 0 to 19" in done.stderr


def test_a_fan_runs_its_initiators_at_the_nice_value_asked_for(program: Path) -> None:
    """(``fabric bench rl --sender-nice`` runs the trainers and these writers alike.) A
    writer that could not be reniced exits non-zero: a row means it ran at that value."""
    rows = _rows(program, "-N", "3", "-f", "2:1", "-n", str(4 * 65536), "-s", "65536", "-r", "1")
    assert [(r["kind"], r["initiator_nice"]) for r in rows] == [("fan_bandwidth", 3)]


def test_fabric_bench_rl_takes_its_bound_from_the_fan_of_its_own_shape(program: Path) -> None:
    """A tiny update on the simulator with the real ceiling program: the bound is the step's
    bytes over the best 3 -> 2 fan run, and the pairs (1 and 3) are reported beside it."""
    pytest.importorskip("torch")
    from fabric_apps.weights.bench import RlBenchSpec, run_rl_bench

    spec = RlBenchSpec(
        backend="sim", trainers=3, inference=2, model_bytes=1 << 21, layers=1, experts=2, vocab=256,
        steps=1, warmup=0, ceiling=str(program),
    )  # fmt: skip
    result = run_rl_bench(spec)
    c = result.ceiling
    assert c is not None and c["fan"] == "3:2" and len(c["fan_runs"]) == 2 and len(c["runs"]) == 2
    assert all(set(run) == {"1", "3"} for run in c["runs"])
    best_fan = max(v for run in c["fan_runs"] for v in run.values())
    assert result.ceiling_gbytes_per_s == best_fan
    assert result.bound_s == pytest.approx(result.bytes_per_step / (best_fan * 1e9))
    assert set(result.ratio_by_pairs()) == {"1", "3"}
