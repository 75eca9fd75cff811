"""The conformance suite every fabric backend runs (pytest).

A backend provides a ``fabric_harness`` fixture returning a :class:`Harness` and subclasses
:class:`TransferEngineConformance` (or any of its parts)::

    import pytest
    from fabric_core.testing import Harness, TransferEngineConformance

    @pytest.fixture
    def fabric_harness(fabric_seed):
        harness = MyHarness(seed=fabric_seed)
        yield harness
        harness.close()

    class TestMyBackend(TransferEngineConformance):
        pass

The pytest plugin (entry point ``pytest11``) adds ``--fabric-seeds N`` and parametrizes the
``fabric_seed`` fixture over that many seeds.
"""

from .bad_input import BadInputConformance
from .conformance import (
    CallbackConformance,
    CounterConformance,
    FaultConformance,
    LifecycleConformance,
    PagedConformance,
    RoutingConformance,
    ScatterConformance,
    SendRecvConformance,
    TransferEngineConformance,
    ValidationConformance,
    WriteConformance,
)
from .harness import Harness

__all__ = [
    "BadInputConformance",
    "CallbackConformance",
    "CounterConformance",
    "FaultConformance",
    "Harness",
    "LifecycleConformance",
    "PagedConformance",
    "RoutingConformance",
    "ScatterConformance",
    "SendRecvConformance",
    "TransferEngineConformance",
    "ValidationConformance",
    "WriteConformance",
]
