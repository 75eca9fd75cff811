"""The conformance suite ships as a pytest plugin that any backend's tests get."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest_plugins = ["pytester"]


def test_plugin_is_registered_for_every_installation() -> None:
    (ep,) = [e for e in entry_points(group="pytest11") if e.name == "fabric_conformance"]
    assert ep.value == "_fabric_core_pytestplugin"


def test_backend_suite_in_three_lines_runs_over_seeds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_mybackend="""
        import pytest
        from fabric_core.testing import WriteConformance
        from fabric_sim.testing import SimHarness

        @pytest.fixture
        def fabric_harness(fabric_seed):
            h = SimHarness(seed=fabric_seed)
            yield h
            h.close()

        class TestMine(WriteConformance):
            pass
        """
    )
    result = pytester.runpytest("--fabric-seeds", "3", "-q", "-k", "zero_length")
    result.assert_outcomes(passed=3)
