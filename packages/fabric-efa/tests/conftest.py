"""Shared by the efa tests: the ``netns`` marker, for tests that run engines as hosts in the
network-namespace lab on tcp;ofi_rxm. They are skipped, with the reason, where the lab cannot
run (not root, no iproute2 or nftables) or the provider is missing. And ``efa_engine``: engines
of one NIC in this process, skipped where the provider is missing."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")


@functools.cache
def _netns_unavailable() -> str | None:
    from fabric_core.settings import load_settings
    from fabric_core.testing.netns import netns_unavailable

    reason = netns_unavailable()
    if reason is not None:
        return reason
    from fabric_efa import EfaBackend

    probe = EfaBackend.probe(load_settings(efa_provider="tcp;ofi_rxm"))
    return None if probe.available else probe.reason


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: runs engines as hosts in the network-namespace lab")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("netns") is not None:
            reason = _netns_unavailable()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def efa_engine() -> Callable[..., EfaEngine]:
    """Opens an engine of one NIC on a provider (tcp;ofi_rxm unless named), with a 20 s
    timeout and any other settings given; the test is skipped where the provider is missing."""
    from fabric_core.settings import load_settings
    from fabric_efa import EfaBackend
    from fabric_efa.engine import EfaEngine

    def open_engine(provider: str = "tcp;ofi_rxm", **extra: object) -> EfaEngine:
        settings = load_settings(backend="efa", efa_provider=provider, nics=1, **{"timeout_s": 20.0, **extra})
        probe = EfaBackend.probe(settings)
        if not probe.available:
            pytest.skip(probe.reason)
        return EfaEngine(settings)

    return open_engine
