"""Shared by the efa tests: the ``netns`` marker, for tests that run engines as hosts in the
network-namespace lab on tcp;ofi_rxm. They are skipped, with the reason, where the lab cannot
run (not root, no iproute2 or nftables) or the provider is missing."""

from __future__ import annotations

import functools

import pytest


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
