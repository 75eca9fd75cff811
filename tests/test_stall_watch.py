"""The arithmetic of the compiled engines' stall watchdog (``fabric_core.native.StallWatch``).

The watchdog closes an engine whose progress it has watched inside one step for
``liveness_timeout_s`` (``EngineWedged``; the engine side is in
``packages/fabric-efa/tests/test_backend.py`` and case 19 of ``test_native_liveness.py``).
What it counts decides whether a healthy engine can be closed by mistake, so it is pinned
here with made-up clocks.
"""

from __future__ import annotations

import pytest

from fabric_core.native import StallWatch


def test_one_step_seen_all_along_counts_the_time_between_looks() -> None:
    w = StallWatch()
    assert w.look(7, 100.0) == 0.0  # first sight of the step
    seen = [w.look(7, 100.0 + 0.05 * i) for i in range(1, 21)]
    assert seen[-1] == pytest.approx(1.0)
    assert seen == sorted(seen)


def test_another_step_or_none_starts_the_count_again() -> None:
    w = StallWatch()
    w.look(7, 0.0)
    assert w.look(7, 0.2) == pytest.approx(0.2)
    assert w.look(8, 0.4) == 0.0  # the worker moved on: a new step
    assert w.look(8, 0.5) == pytest.approx(0.1)
    assert w.look(0, 0.6) == 0.0  # between steps
    assert w.look(8, 0.7) == 0.0  # the same start again after a gap in steps is a fresh sight


def test_a_gap_between_looks_counts_at_most_gap_s() -> None:
    """A process stopped as a whole (SIGSTOP, a debugger) resumes mid-step: the watcher did
    not run either, so the long gap counts as one short look, and the engine stays open."""
    w = StallWatch(gap_s=0.25)
    w.look(7, 0.0)
    assert w.look(7, 100.0) == pytest.approx(0.25)
    assert w.look(7, 100.05) == pytest.approx(0.30)


def test_a_clock_that_goes_back_counts_nothing() -> None:
    w = StallWatch()
    w.look(7, 10.0)
    assert w.look(7, 9.0) == 0.0


def test_kv_work_in_flight_when_its_engine_closed_itself_says_so() -> None:
    """The KV app's prefiller and decoder fail the work in flight when their engine's ``recv``
    raises ``EngineClosed``; an engine that closed itself stuck in the provider keeps its type
    (``EngineWedged``, with how long it was stuck) and its reason in that error."""
    from fabric_apps.kvcache.errors import engine_gone
    from fabric_core.errors import EngineClosed, EngineWedged

    wedged = engine_gone(
        "the decoder's engine closed with this request in flight", EngineWedged("stuck 1.1 s", stalled_s=1.1)
    )
    assert type(wedged) is EngineWedged and wedged.stalled_s == 1.1
    assert str(wedged) == "the decoder's engine closed with this request in flight: stuck 1.1 s"
    closed = engine_gone("the prefill's engine closed with this job in flight", EngineClosed("engine closed"))
    assert (
        type(closed) is EngineClosed and str(closed) == "the prefill's engine closed with this job in flight"
    )
