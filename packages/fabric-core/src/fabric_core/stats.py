"""What ``engine.stats()`` breaks down: per NIC, per peer, and counter-wait latency.

Every backend fills the same records. The native engines count in C++ (atomics the worker
bumps, read without stopping it); the simulator counts in Python as its events run. Counter
waits are timed in ``fabric_core.counters`` for every backend alike, and a native counter
table's blocking waits that end in C++ are tallied there (``WaitLatency.add_source``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from .models import DomainAddress

__all__ = [
    "WAIT_BUCKETS_S",
    "NicStats",
    "PeerStats",
    "TrafficTally",
    "WaitLatency",
    "WaitStats",
    "stats_dict",
]

WAIT_BUCKETS_S: tuple[float, ...] = (
    1e-5,
    3e-5,
    1e-4,
    3e-4,
    1e-3,
    3e-3,
    1e-2,
    3e-2,
    0.1,
    0.3,
    1.0,
    3.0,
    10.0,
)
"""Upper bounds (seconds) of the counter-wait latency buckets; one more bucket above the last."""


@dataclass(frozen=True, slots=True)
class NicStats:
    """One NIC of the engine's group."""

    nic: int
    work_requests: int = 0
    """Writes that completed successfully on this NIC."""
    bytes_written: int = 0
    """Their bytes (an imm-only write carries none)."""
    errors: int = 0
    """Writes that failed on this NIC (a retried one counts here and in ``retries``)."""
    retries: int = 0
    """Of those, retried on another NIC (NIC loss)."""
    inflight: int = 0
    """Writes posted on this NIC and not completed yet."""
    imms_received: int = 0
    """Imms counted here that arrived on this NIC."""


@dataclass(frozen=True, slots=True)
class PeerStats:
    """Traffic to one peer (named by its NIC 0 address) since this engine first wrote to it."""

    peer: DomainAddress
    work_requests: int = 0
    bytes_written: int = 0
    errors: int = 0
    inflight: int = 0


@dataclass(frozen=True, slots=True)
class WaitStats:
    """Counter waits (``wait``, ``wait_async``, ``expect``) that ended, and how long they took.

    ``buckets[i]`` counts satisfied waits of at most ``WAIT_BUCKETS_S[i]`` seconds (and more
    than the bound before it); the last entry counts those above ``WAIT_BUCKETS_S[-1]``.
    """

    satisfied: int = 0
    failed: int = 0
    """Ended with an error: timeout, lost peer, closed engine (not counted in ``buckets``)."""
    total_s: float = 0.0
    """Summed latency of the satisfied waits."""
    buckets: tuple[int, ...] = (0,) * (len(WAIT_BUCKETS_S) + 1)


class WaitLatency:
    """Thread-safe accumulator behind ``WaitStats`` (one per counter table).

    ``record`` is on every counter wait's path, so it only appends to a deque (atomic in
    CPython, no lock: about a tenth of the locked histogram update it replaced); the samples
    are folded into the histogram under the lock by ``snapshot``, and by ``record`` itself
    every ``_FOLD_AT`` samples, so the deque stays bounded whether or not anyone reads.

    A native counter table tallies the blocking waits it settles alone in C++ (satisfied, no
    Python on their path); ``add_source`` hands ``snapshot`` that tally to add in."""

    _FOLD_AT = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * (len(WAIT_BUCKETS_S) + 1)
        self._satisfied = 0
        self._failed = 0
        self._total = 0.0
        self._samples: collections.deque[float] = collections.deque()  # seconds; -1.0: failed
        self._sources: list[Callable[[], tuple[int, float, list[int]]]] = []

    def add_source(self, tally: Callable[[], tuple[int, float, list[int]]]) -> None:
        """Waits tallied elsewhere: ``tally()`` returns (satisfied, total seconds, buckets) over
        ``WAIT_BUCKETS_S``, cumulative; ``snapshot`` adds them to what ``record`` saw."""
        buckets = tally()[2]
        if len(buckets) != len(WAIT_BUCKETS_S) + 1:
            raise ValueError(f"a wait tally needs {len(WAIT_BUCKETS_S) + 1} buckets, it has {len(buckets)}")
        self._sources.append(tally)

    def record(self, seconds: float, ok: bool) -> None:
        samples = self._samples
        samples.append(seconds if ok else -1.0)
        if len(samples) >= self._FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        with self._lock:
            samples, pop = self._samples, self._samples.popleft
            for _ in range(len(samples)):  # (appends that race with this wait for the next fold)
                seconds = pop()
                if seconds < 0:
                    self._failed += 1
                    continue
                self._satisfied += 1
                self._total += seconds
                self._buckets[bisect.bisect_left(WAIT_BUCKETS_S, seconds)] += 1

    def snapshot(self) -> WaitStats:
        self._fold()
        with self._lock:
            satisfied, total, buckets = self._satisfied, self._total, list(self._buckets)
            failed = self._failed
        for tally in self._sources:
            n, seconds, counts = tally()
            satisfied += n
            total += seconds
            buckets = [a + b for a, b in zip(buckets, counts, strict=True)]
        return WaitStats(satisfied, failed, total, tuple(buckets))


class TrafficTally:
    """Per-NIC and per-peer traffic counted in Python (the simulator's ``stats()``).

    Call ``posted`` when a write is handed to a NIC, ``reported`` when the NIC reports it
    (completed or failed), ``retried`` when a failed one is retried elsewhere, ``imm`` for an
    imm counted here. Callers serialise the updates (the simulator holds its lock). Peers are
    keyed by whatever the caller names them with (the simulator: engine ids), turned into
    addresses only when read.
    """

    _WRS, _BYTES, _ERRORS, _RETRIES, _INFLIGHT, _IMMS = range(6)

    def __init__(self, nics: int) -> None:
        self._nics = [[0] * 6 for _ in range(nics)]
        self._peers: dict[Hashable, list[int]] = {}

    def posted(self, nic: int, peer: Hashable) -> None:
        self._nics[nic][self._INFLIGHT] += 1
        row = self._peers.get(peer)
        if row is None:
            row = self._peers[peer] = [0, 0, 0, 0]
        row[3] += 1

    def reported(self, nic: int, peer: Hashable, nbytes: int, ok: bool) -> None:
        n, p = self._nics[nic], self._peers[peer]
        n[self._INFLIGHT] -= 1
        p[3] -= 1
        if ok:
            n[self._WRS] += 1
            n[self._BYTES] += nbytes
            p[0] += 1
            p[1] += nbytes
        else:
            n[self._ERRORS] += 1
            p[2] += 1

    def retried(self, nic: int) -> None:
        self._nics[nic][self._RETRIES] += 1

    def imm(self, nic: int) -> None:
        self._nics[nic][self._IMMS] += 1

    def nic_stats(self) -> tuple[NicStats, ...]:
        return tuple(NicStats(i, *row) for i, row in enumerate(self._nics))

    def peer_stats(self, name: Callable[[Any], DomainAddress]) -> tuple[PeerStats, ...]:
        return tuple(PeerStats(name(peer), *row) for peer, row in list(self._peers.items()))


def stats_dict(stats: Any) -> dict[str, Any]:
    """``EngineStats`` as plain data (``dump_state``, JSON): peers named by hex address."""
    out: dict[str, Any] = {}
    for name in stats.__dataclass_fields__:
        value = getattr(stats, name)
        if name == "nics":
            value = [dataclasses.asdict(n) for n in value]
        elif name == "peers":
            value = [{**dataclasses.asdict(p), "peer": p.peer.raw.hex()} for p in value]
        elif name == "counter_waits":
            value = {**dataclasses.asdict(value), "buckets": list(value.buckets)}
        out[name] = value
    return out
