"""Fixtures shared by the test modules of fabric-core."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import fabric_sim
from fabric_core import WriteRequest


@pytest.fixture
def misplaced_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken backend: every simulated single write lands one byte past where it was asked to."""
    original = fabric_sim.SimEngine.submit

    def off_by_one(self: fabric_sim.SimEngine, request: Any, **kw: Any) -> Any:
        if isinstance(request, WriteRequest):
            request = dataclasses.replace(request, dst_offset=request.dst_offset + 1)
        return original(self, request, **kw)

    monkeypatch.setattr(fabric_sim.SimEngine, "submit", off_by_one)
