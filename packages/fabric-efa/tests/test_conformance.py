"""The efa backend runs the conformance suite for real on libfabric's shm and tcp;ofi_rxm
providers, with chaos mode (shuffled posting and completion order) on every seed.

``2proc``: every engine of a test lives in its own worker process (``RemoteHarness``), so each
byte crosses from one process's endpoint to another's, as between two hosts. ``inproc``: the
engines share this process, which also exercises the guard against writing to an endpoint
closed in the same process (and the NIC faults, which only this harness injects).

Half of the four keep the efa provider's local-registration rules, checked at every post
(``efa_strict_mr``): shm between processes and tcp in one process, so that each provider and
each harness runs both with and without them. shm and tcp ignore descriptors, so a missing or
wrong one would otherwise show only on EFA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from fabric_core.api import TransferEngine
from fabric_core.settings import load_settings
from fabric_core.testing import Harness, TransferEngineConformance
from fabric_core.testing.remote import RemoteHarness, WorkerPool

os.environ.setdefault("FI_TCP_IFACE", "lo")  # never the first interface: loopback only

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}
LIVENESS = {"liveness_interval_s": 0.2, "liveness_timeout_s": 2.0}
MAX_NICS = 4
STRICT_MR = ("shm-2proc", "tcp-inproc")  # (the module's docstring)


class EfaHarness(Harness):
    """Engines in this process, one endpoint per emulated NIC."""

    max_nics = MAX_NICS
    supports_nic_faults = True  # injected into the endpoint (LibfabricDomain::inject_failure)

    def __init__(self, provider: str, chaos_seed: int | None, strict_mr: bool = False) -> None:
        super().__init__()
        self.provider, self.chaos_seed, self.strict_mr = provider, chaos_seed, strict_mr
        # shm addresses name their process, so the engine knows an endpoint closed here; a
        # tcp address is a port that any process may bind next, and tcp says nothing
        self.detects_closed_peers = provider == "shm"
        # tcp drops the connection on a refused key and the engine asks the target why
        # (Engine::check_access); on shm the writer reads the target's region table and never
        # posts a write the target would refuse (fabric/region_table.hpp: shm would wedge)
        self.survives_refused_writes = True
        self.reports_remote_access_errors = True

    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine:
        from fabric_efa.engine import EfaEngine

        settings = load_settings(
            backend="efa",
            efa_provider=self.provider,
            nics=nics,
            chaos_seed=self.chaos_seed,
            timeout_s=20,
            efa_strict_mr=self.strict_mr,
            **config,
        )
        return EfaEngine(settings)

    def kill_nic(self, engine: TransferEngine, nic: int) -> None:
        self._inject(engine, nic, True)

    def restore_nic(self, engine: TransferEngine, nic: int) -> None:
        self._inject(engine, nic, False)

    def _inject(self, engine: TransferEngine, nic: int, failed: bool) -> None:
        from fabric_efa.engine import EfaEngine

        assert isinstance(engine, EfaEngine)
        engine._core.inject_nic_failure(nic, failed, self.chaos_seed or 0)


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    # four workers: the largest test (a scatter to three targets) puts each engine in its own
    with WorkerPool(workers=4, arena_bytes=1 << 28) as pool:
        yield pool


@pytest.fixture(params=["shm-2proc", "tcp-2proc", "shm-inproc", "tcp-inproc"])
def fabric_harness(request: pytest.FixtureRequest, fabric_seed: int) -> Iterator[Harness]:
    from fabric_efa import EfaBackend

    name, mode = request.param.split("-")
    provider = PROVIDERS[name]
    strict_mr = request.param in STRICT_MR
    probe = EfaBackend.probe(load_settings(efa_provider=provider))
    if not probe.available:
        pytest.skip(probe.reason)
    harness: Harness
    if mode == "2proc":
        harness = RemoteHarness(
            request.getfixturevalue("worker_pool"),
            {
                "backend": "efa",
                "efa_provider": provider,
                "chaos_seed": fabric_seed,
                "timeout_s": 20,
                "efa_strict_mr": strict_mr,
                **LIVENESS,
            },
            max_nics=MAX_NICS,
            reports_remote_access_errors=True,
            # shm and tcp are silent about a peer closed in another process: the liveness
            # probes tell (within LIVENESS's interval + timeout)
            detects_closed_peers=True,
            survives_refused_writes=True,
            # SIGSTOP of the engine's worker process. Not on shm: a process stopped while it
            # holds its shared-memory region's lock blocks every writer inside the provider
            # (docs/concepts/failures.md, "Known limits")
            supports_stall=name == "tcp",
        )
    else:
        harness = EfaHarness(provider, chaos_seed=fabric_seed, strict_mr=strict_mr)
    yield harness
    harness.close()


class TestEfaConformance(TransferEngineConformance):
    pass
