"""The arithmetic that tells how many of a lost NIC's WriteImms the target counted."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_core.reconcile import BUCKETS, DEGREE, PRIME, PowerSums, bucket_of, landed_per_imm

IMMS = st.integers(min_value=0, max_value=(1 << 32) - 1)


def _sums(counts: dict[int, int]) -> PowerSums:
    s = PowerSums()
    for imm, n in counts.items():
        s.add(imm, n)
    return s


def _delta(background: dict[int, int], landed: dict[int, int]) -> list[list[int]]:
    """The target counted background + landed; the sender knows background completed."""
    target = _sums(background)
    for imm, n in landed.items():
        target.add(imm, n)
    return target.minus(_sums(background))


def _same_set(count: int) -> list[int]:
    values = [x for x in range(100_000) if bucket_of(x) == 3]
    return values[:count]


@settings(max_examples=300, deadline=None)
@given(
    failed=st.dictionaries(IMMS, st.integers(1, 50), min_size=1, max_size=DEGREE),
    background=st.dictionaries(IMMS, st.integers(0, 10**6), max_size=20),
    seed=st.integers(0, 2**32),
)
def test_landed_counts_are_recovered_exactly(
    failed: dict[int, int], background: dict[int, int], seed: int
) -> None:
    rng = random.Random(seed)
    landed = {imm: rng.randint(0, n) for imm, n in failed.items()}
    assert landed_per_imm(_delta(background, landed), failed) == landed


@settings(max_examples=50, deadline=None)
@given(first=st.integers(0, (1 << 32) - 200), seed=st.integers(0, 2**32))
def test_many_values_spread_over_the_sets_are_told_apart(first: int, seed: int) -> None:
    """Consecutive imm values (one per request, say) spread over the sets: dozens at once."""
    rng = random.Random(seed)
    values = range(first, first + 4 * BUCKETS)
    # the hash spreads consecutive values evenly: no set gets more than it can tell apart
    assert all(sum(1 for x in values if bucket_of(x) == b) <= DEGREE for b in range(BUCKETS))
    failed = {x: rng.randint(1, 3) for x in values}
    landed = {x: rng.randint(0, n) for x, n in failed.items()}
    assert landed_per_imm(_delta({first: 5}, landed), failed) == landed


@settings(max_examples=100, deadline=None)
@given(failed=st.dictionaries(IMMS, st.integers(1, 5), min_size=DEGREE + 1, max_size=3 * DEGREE))
def test_none_or_all_landed_is_recognised_for_any_number_of_values(failed: dict[int, int]) -> None:
    assert landed_per_imm(_delta({}, {}), failed) == dict.fromkeys(failed, 0)
    assert landed_per_imm(_delta({1: 3}, failed), failed) == failed


def test_a_partial_landing_of_too_many_values_in_one_set_is_not_guessed() -> None:
    failed = {imm: 2 for imm in _same_set(DEGREE + 1)}
    landed = {imm: i % 3 for i, imm in enumerate(failed)}
    assert landed_per_imm(_delta({}, landed), failed) is None
    fits = dict(list(failed.items())[:DEGREE])  # one value fewer: told apart
    landed = {imm: i % 3 for i, imm in enumerate(fits)}
    assert landed_per_imm(_delta({}, landed), fits) == landed


def _one_set(b: int, sums: list[int]) -> list[list[int]]:
    out = [[0] * DEGREE for _ in range(BUCKETS)]
    out[b] = sums
    return out


@pytest.mark.parametrize(
    "delta",
    [
        _one_set(bucket_of(7), [5] + [0] * (DEGREE - 1)),  # five counted, but sums of no imm
        _sums({9: 1}).sums,  # an imm that was not among the failed ones
        _sums({7: 3}).sums,  # more than failed of a value
        _one_set(bucket_of(7), [PRIME - 1] * DEGREE),  # fewer counted than completed here
    ],
)
def test_sums_that_do_not_fit_the_failed_requests_are_refused(delta: list[list[int]]) -> None:
    assert landed_per_imm(delta, {7: 2, 8: 1}) is None


def test_zero_is_an_imm_like_any_other() -> None:
    failed = {0: 3, 1: 2}
    assert landed_per_imm(_delta({0: 4}, {0: 2, 1: 1}), failed) == {0: 2, 1: 1}


def test_wrong_shape_of_sums_is_an_error() -> None:
    with pytest.raises(ValueError, match="power sums"):
        landed_per_imm([[0, 0]], {1: 1})


def test_power_sums_stay_in_the_field_and_read_well() -> None:
    s = _sums({(1 << 32) - 1: 10**9})
    assert all(0 <= v < PRIME for b in s.sums for v in b)
    assert repr(s) == "PowerSums(count=1000000000)"
