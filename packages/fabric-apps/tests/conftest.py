"""Fixtures of the KV-cache tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvworld import World


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    seed = request.node.callspec.params.get("fabric_seed", 0) if hasattr(request.node, "callspec") else 0
    w = World(seed)
    yield w
    w.close()
