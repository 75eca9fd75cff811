"""A short soak across processes (fabric_core.testing.soak; the long one: benchmarks/soak.py).

The writer lives in this process (its NIC 1 is taken down every fourth round), the target in
a worker process. Every round's counts, bytes and messages are exact, and after warm-up the
file descriptors and threads of both processes stay flat and registrations return to where
they were; resident memory is reported (its slope), and bounded loosely here: a short run on a
shared machine says little about a leak of a few bytes per round, the long run does.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from fabric_core.settings import load_settings
from fabric_core.testing.remote import RemoteEngine, WorkerPool
from fabric_core.testing.soak import run_soak
from fabric_efa import EfaBackend
from fabric_efa.engine import EfaEngine

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(workers=2, arena_bytes=1 << 24) as p:
        yield p


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_short_soak_keeps_exact_counts_and_flat_resources(pool: WorkerPool, provider: str) -> None:
    name = PROVIDERS[provider]
    settings = load_settings(backend="efa", efa_provider=name, nics=2, timeout_s=30)
    probe = EfaBackend.probe(settings)
    if not probe.available:
        pytest.skip(probe.reason)
    # Garbage of earlier tests in this process (an engine, a pipe) closed by a collection
    # during the soak would show as the writer's descriptors shrinking: collect it first.
    gc.collect()
    writer = EfaEngine(settings)
    worker = pool.workers[0]
    target = RemoteEngine(pool, worker, {"backend": "efa", "efa_provider": name, "nics": 2, "timeout_s": 30})
    try:
        report = run_soak(
            writer,
            target,
            pool.alloc,
            pids={"writer": os.getpid(), "target": worker.pid},
            rounds=48,
            seed=3,
            kill_nic=lambda nic: writer._core.inject_nic_failure(nic, True, 3),
            restore_nic=lambda nic: writer._core.inject_nic_failure(nic, False, 3),
        )
    finally:
        writer.close()
        target.close()
    assert report.problems == [], report.problems[:5]
    assert report.rounds == 48 and report.transfers == 48 * 6 and report.messages == 48 * 3
    assert report.nic_faults == 12 and report.retries > 0
    assert report.growth("fds") == {"writer": 0, "target": 0}, report.to_json()["samples"]
    assert report.growth("threads") == {"writer": 0, "target": 0}, report.to_json()["samples"]
    regs = {s.registrations for s in report.warm()}
    assert regs == {(1, 1)}, regs  # the soak's two regions; every scratch one was dropped
    slopes = report.slopes()
    assert all(s["rss_kib_per_round"] < 256 for s in slopes.values()), slopes
