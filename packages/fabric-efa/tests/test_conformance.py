"""The efa backend runs the conformance suite for real on libfabric's shm and tcp;ofi_rxm
providers, with chaos mode (shuffled posting and completion order) on every seed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from fabric_core.api import TransferEngine
from fabric_core.settings import load_settings
from fabric_core.testing import Harness, TransferEngineConformance

os.environ.setdefault("FI_TCP_IFACE", "lo")  # never the first interface: loopback only

PROVIDERS = ["shm", "tcp;ofi_rxm"]


class EfaHarness(Harness):
    """Engines in this process, one endpoint per emulated NIC."""

    max_nics = 4
    reports_remote_access_errors = False  # shm and tcp;ofi_rxm leave such writes incomplete

    def __init__(self, provider: str, chaos_seed: int | None) -> None:
        super().__init__()
        self.provider, self.chaos_seed = provider, chaos_seed

    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine:
        from fabric_efa.engine import EfaEngine

        settings = load_settings(
            backend="efa",
            efa_provider=self.provider,
            nics=nics,
            chaos_seed=self.chaos_seed,
            timeout_s=20,
            **config,
        )
        return EfaEngine(settings)


@pytest.fixture(params=PROVIDERS, ids=["shm", "tcp"])
def fabric_harness(request: pytest.FixtureRequest, fabric_seed: int) -> Iterator[EfaHarness]:
    from fabric_efa import EfaBackend

    probe = EfaBackend.probe(load_settings(efa_provider=request.param))
    if not probe.available:
        pytest.skip(probe.reason)
    harness = EfaHarness(request.param, chaos_seed=fabric_seed)
    yield harness
    harness.close()


class TestEfaConformance(TransferEngineConformance):
    pass
