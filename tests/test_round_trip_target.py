"""The round trip's target in ``benchmarks/efa_vs_ceiling.py``: twice ``fi_pingpong``'s latency plus
5 us, where that latency (``usec/xfer``) is half a round trip."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "efa_vs_ceiling.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("efa_vs_ceiling", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("efa_vs_ceiling", module)
    spec.loader.exec_module(module)
    return module


def test_the_target_is_the_pingpongs_round_trip_plus_5_us() -> None:
    script = _script()
    # fi_pingpong said 8.5 us per transfer: a round trip of 17 us, so 22 us
    assert script._round_trip_target(8.5, 40.0) == pytest.approx(22.0)
    # without fi_pingpong, the ceiling's own write round trip (17 us) stands in for the pingpong's
    assert script._round_trip_target(None, 17.0) == pytest.approx(22.0)
    assert script._round_trip_target(None, None) is None


def _fi_info_has(provider: str) -> bool:
    out = subprocess.run(
        ["fi_info", "-p", provider, "-t", "FI_EP_RDM"], capture_output=True, text=True, timeout=30
    )
    return out.returncode == 0 and "provider:" in out.stdout


@pytest.mark.skipif(shutil.which("fi_pingpong") is None, reason="fi_pingpong (libfabric-bin) not installed")
def test_fi_pingpong_runs_on_shm_and_gives_half_its_round_trip() -> None:
    if not _fi_info_has("shm"):
        pytest.skip("no shm provider")
    script = _script()
    iters = 2000
    start = time.monotonic()
    latency = script._pingpong_latency("shm", iters=iters)
    wall = time.monotonic() - start
    assert latency is not None
    assert latency > 0
    # iters round trips of 2 * latency each took no longer than the whole run
    assert iters * 2 * latency * 1e-6 <= wall


def test_no_fi_pingpong_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setattr(script.shutil, "which", lambda name: None)
    assert script._pingpong_latency("shm") is None
