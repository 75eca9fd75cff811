"""The conformance suite on the verbs backend, where an RDMA device exists (a ConnectX NIC,
or Soft-RoCE: ``sudo rdma link add rxe0 type rxe netdev eth0``; docs/backends/verbs.md).

``2proc``: every engine of a test lives in its own worker process (``RemoteHarness``), so each
byte crosses from one process's queue pairs to another's, as between two hosts. ``inproc``:
the engines share this process. Several NICs per group may share one device (NIC i uses
device i mod count), so multi-NIC routing runs on a single Soft-RoCE device too.

Where no device exists every test is collected and skipped with the probe's reason (what is
missing and how to get it), never silently absent: ``test_skips_say_why`` holds that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric_core.api import TransferEngine
from fabric_core.settings import load_settings
from fabric_core.testing import Harness, TransferEngineConformance
from fabric_core.testing.remote import RemoteHarness, WorkerPool

MAX_NICS = 4


def _probe() -> tuple[bool, str]:
    from fabric_verbs import VerbsBackend

    probe = VerbsBackend.probe(load_settings(backend="verbs"))
    return probe.available, probe.reason


class VerbsHarness(Harness):
    """Engines in this process, one verbs domain per NIC."""

    max_nics = MAX_NICS
    reports_remote_access_errors = True  # a bad rkey is IBV_WC_REM_ACCESS_ERR at the writer
    detects_closed_peers = True  # a closed peer's QPs are gone: retries exhausted, PeerUnreachable

    def __init__(self, chaos_seed: int | None) -> None:
        super().__init__()
        self.chaos_seed = chaos_seed

    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine:
        from fabric_verbs.engine import VerbsEngine

        settings = load_settings(
            backend="verbs", nics=nics, chaos_seed=self.chaos_seed, timeout_s=20, **config
        )
        return VerbsEngine(settings)


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    # four workers: the largest test (a scatter to three targets) puts each engine in its own
    with WorkerPool(workers=4, arena_bytes=1 << 28) as pool:
        yield pool


@pytest.fixture(params=["2proc", "inproc"])
def fabric_harness(request: pytest.FixtureRequest, fabric_seed: int) -> Iterator[Harness]:
    available, reason = _probe()
    if not available:
        pytest.skip(f"verbs backend unavailable: {reason}")
    harness: Harness
    if request.param == "2proc":
        harness = RemoteHarness(
            request.getfixturevalue("worker_pool"),
            {"backend": "verbs", "chaos_seed": fabric_seed, "timeout_s": 20},
            max_nics=MAX_NICS,
            reports_remote_access_errors=True,
            detects_closed_peers=True,
        )
    else:
        harness = VerbsHarness(chaos_seed=fabric_seed)
    yield harness
    harness.close()


class TestVerbsConformance(TransferEngineConformance):
    pass


def test_skips_say_why() -> None:
    """Without a device the suite is collected and every test skipped with the probe's reason."""
    available, reason = _probe()
    if available:
        pytest.skip("an RDMA device is present: the suite runs for real")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env["COLUMNS"] = "1000"  # the skip reasons unabridged
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(Path(__file__)),
            "-k",
            "TestVerbsConformance",
            "-q",
            "-rs",
            "--fabric-seeds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).parents[3],
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    summary = out.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    skipped = int(summary.split(" skipped")[0].split()[-1])
    assert skipped >= 80, summary  # both harnesses, every test of the suite
    assert f"verbs backend unavailable: {reason}"[:150] in out.replace("\n", " ")
