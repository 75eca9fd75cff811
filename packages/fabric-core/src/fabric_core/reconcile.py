"""Exact imm accounting across a lost NIC: which of a path's failed WriteImms were counted.

A work request that fails on a dying NIC is ambiguous: its bytes and its imm may have landed
and been counted at the target before the acknowledgement was lost, or not. Retrying it with
its imm could count it twice; not retrying could leave the target short forever. Both ends
therefore keep, per path (one peer, one NIC), the power sums of the imm values moved on it:

    S_j = sum over imms x of (x + 1) ** j   (mod P),   j = 0 .. DEGREE - 1

The target adds every imm it counts from the path; the sender adds every imm work request of
the path that completed successfully. Once the path is quiet (nothing of it in flight), the
difference of the two is exactly the power sums of the failed work requests whose imms were
counted. Knowing the imm values of the failed work requests (and how many carry each), the
number that landed per value follows from a Vandermonde system over the prime field, as long
as there are at most ``DEGREE`` distinct values among them. To tell more values apart, the
sums are kept in ``BUCKETS`` independent sets, an imm value's set chosen by a hash of it: the
system is then solved per set, each with its own values (at most ``DEGREE`` each). None-landed
and all-landed are recognised for any number of values. The state per path is
``BUCKETS * DEGREE`` integers at each end, whatever the number of transfers: nothing grows
with traffic.

The C++ engine (``fabric/reconcile.hpp``) does the same arithmetic; both are tested against
the same cases.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BUCKETS", "DEGREE", "PRIME", "PowerSums", "bucket_of", "landed_per_imm"]

PRIME = (1 << 61) - 1
"""The field's modulus (a Mersenne prime: products of two residues fit 122 bits)."""

DEGREE = 8
"""Power sums kept per set: up to this many distinct imm values of one set are told apart."""

BUCKET_BITS = 4
BUCKETS = 1 << BUCKET_BITS
"""Independent sets of power sums per path; an imm value's set is ``bucket_of(imm)``."""


def bucket_of(imm: int) -> int:
    """The set an imm value's sums go to (a multiplicative hash of the 32-bit value)."""
    return ((imm * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - BUCKET_BITS)


class PowerSums:
    """The power sums of a multiset of imm values (one path, one direction), per set."""

    __slots__ = ("sums",)

    def __init__(self, sums: list[list[int]] | None = None) -> None:
        self.sums = [list(b) for b in sums] if sums is not None else [[0] * DEGREE for _ in range(BUCKETS)]

    def add(self, imm: int, times: int = 1) -> None:
        x, v = imm + 1, times % PRIME
        s = self.sums[bucket_of(imm)]
        for j in range(DEGREE):
            s[j] = (s[j] + v) % PRIME
            v = v * x % PRIME

    def minus(self, other: PowerSums) -> list[list[int]]:
        return [
            [(a - b) % PRIME for a, b in zip(mine, theirs, strict=True)]
            for mine, theirs in zip(self.sums, other.sums, strict=True)
        ]

    def __repr__(self) -> str:
        return f"PowerSums(count={sum(b[0] for b in self.sums) % PRIME})"


def _solve(rows: list[list[int]], rhs: list[int]) -> list[int] | None:
    """Gaussian elimination mod PRIME on a square system; None if singular."""
    n = len(rhs)
    a = [[*row, b] for row, b in zip(rows, rhs, strict=True)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r][col]), None)
        if pivot is None:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        inv = pow(a[col][col], PRIME - 2, PRIME)
        a[col] = [v * inv % PRIME for v in a[col]]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col]
                a[r] = [(v - f * w) % PRIME for v, w in zip(a[r], a[col], strict=True)]
    return [a[r][n] for r in range(n)]


def _landed_in_set(delta: list[int], failed: dict[int, int]) -> dict[int, int] | None:
    values = sorted(failed)
    expect_all = PowerSums()
    for x in values:
        expect_all.add(x, failed[x])
    if all(d == 0 for d in delta):
        return dict.fromkeys(values, 0)
    if values and delta == expect_all.sums[bucket_of(values[0])]:
        return {x: failed[x] for x in values}
    if not values or len(values) > DEGREE or delta[0] > sum(failed.values()):
        return None
    m = len(values)
    nodes = [(x + 1) % PRIME for x in values]
    rows = [[pow(v, j, PRIME) for v in nodes] for j in range(m)]
    sol = _solve(rows, delta[:m])
    if sol is None:
        return None
    out = dict(zip(values, sol, strict=True))
    if any(not 0 <= out[x] <= failed[x] for x in values):
        return None
    check = PowerSums()
    for x in values:
        check.add(x, out[x])
    if check.sums[bucket_of(values[0])] != delta:  # the rows not used must agree too
        return None
    return out


def landed_per_imm(delta: list[list[int]], failed: Mapping[int, int]) -> dict[int, int] | None:
    """How many of the failed work requests landed, per imm value.

    ``delta``: the target's power sums of the path minus the sender's (successful ones),
    per set; ``failed``: imm value -> number of failed work requests carrying it. Returns imm
    value -> number counted at the target (0 .. failed[imm]), or None when the sums do not
    determine it (more than ``DEGREE`` distinct values of one set with a partial landing) or
    are inconsistent with ``failed`` (the target's sums do not come from this sender's
    traffic: say, a restarted peer): the caller must then treat the work requests as failed.
    """
    if len(delta) != BUCKETS or any(len(d) != DEGREE for d in delta):
        raise ValueError(f"expected {BUCKETS} sets of {DEGREE} power sums")
    per_set: list[dict[int, int]] = [{} for _ in range(BUCKETS)]
    for x, n in failed.items():
        per_set[bucket_of(x)][x] = n
    out: dict[int, int] = {}
    for b in range(BUCKETS):
        if not per_set[b]:
            if any(delta[b]):
                return None  # counts of values that did not fail here
            continue
        got = _landed_in_set(delta[b], per_set[b])
        if got is None:
            return None
        out.update(got)
    return out
