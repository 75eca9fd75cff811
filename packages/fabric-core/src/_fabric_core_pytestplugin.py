"""pytest plugin of fabric's conformance suite: ``--fabric-seeds`` and the ``fabric_seed`` fixture.

It is a top-level module on purpose (as hypothesis does with ``_hypothesis_pytestplugin``):
pytest loads entry-point plugins before pytest-cov starts measuring, and a plugin inside
``fabric_core`` would import the package too early for its coverage to be seen.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fabric", "fabric conformance suite")
    group.addoption(
        "--fabric-seeds",
        type=int,
        default=None,
        help="run seed-parametrized conformance tests over this many seeds (default: 20, "
        "or FABRIC_CONFORMANCE_SEEDS)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fabric_faults: needs a harness that can inject faults")
    config.addinivalue_line(
        "markers", "fabric_seeds(n): run these seed-parametrized tests over at most n seeds"
    )


def _seeds(config: pytest.Config) -> int:
    import os

    value = config.getoption("--fabric-seeds")
    if value is None:
        value = int(os.environ.get("FABRIC_CONFORMANCE_SEEDS", "20"))
    return max(1, int(value))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fabric_seed" in metafunc.fixturenames:
        n = _seeds(metafunc.config)
        cap = metafunc.definition.get_closest_marker("fabric_seeds")
        if cap is not None:
            n = max(1, min(n, int(cap.args[0])))
        metafunc.parametrize("fabric_seed", range(n), ids=[f"seed{i}" for i in range(n)])
