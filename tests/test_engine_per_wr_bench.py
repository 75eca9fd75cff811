"""The native benchmarks build and run. ``benchmarks/native/engine_per_wr.cpp`` (the engine
core's own cost per work request, quoted in docs/gpu.md) builds against the engine core and
completes every request it submits."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "native" / "engine_per_wr.cpp"
INCLUDE = ROOT / "packages" / "fabric-core" / "src" / "fabric_core" / "include"


def test_the_engine_per_wr_benchmark_builds_and_completes_every_request(tmp_path: Path) -> None:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here (./dev test installs it)")
    exe = tmp_path / "engine_per_wr"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-pthread", "-I", str(INCLUDE), str(SOURCE), "-o", str(exe)],
        check=True,
        timeout=300,
    )
    done = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"80 x 512 page writes with an imm: median (\d+) ns per work request", done.stdout)
    assert m is not None and int(m.group(1)) > 0, done.stdout


def test_the_region_table_cost_benchmark_builds_and_every_check_passes(tmp_path: Path) -> None:
    """``benchmarks/native/region_table_cost.cpp`` (quoted in docs/concepts/security.md)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here (./dev test installs it)")
    exe = tmp_path / "region_table_cost"
    source = ROOT / "benchmarks" / "native" / "region_table_cost.cpp"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-I", str(INCLUDE), str(source), "-o", str(exe)], check=True, timeout=300
    )
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"region table: ([\d.]+) ns per work request", done.stdout)
    assert m is not None and float(m.group(1)) > 0, done.stdout
