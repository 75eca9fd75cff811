"""The simulator runs the whole conformance suite, over many seeds (``--fabric-seeds``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fabric_core.testing import TransferEngineConformance
from fabric_sim.testing import SimHarness


@pytest.fixture
def fabric_harness(fabric_seed: int) -> Iterator[SimHarness]:
    harness = SimHarness(seed=fabric_seed, chunk_bytes=4096)
    yield harness
    harness.close()


class TestSimConformance(TransferEngineConformance):
    pass
