"""The connection handshake (csrc/handshake.hpp) against a fake transport that drops,
duplicates, delays and reorders its datagrams, on an explicit clock.

Two machines, A and B, play the two domains. The transport carries the very bytes the
Domain would put on its UD queue pair. The properties: with finitely many losses both sides
end CONNECTED, each with the other's queue pair parameters and epoch; with every packet
lost each side that started ends FAILED at its deadline; in every case the simulation runs
dry (no message in flight, no timer armed) in bounded time: never a hang.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fabric_verbs import _verbs

RETRY_INITIAL = 0.005
RETRY_MAX = 0.25
TIMEOUT = 5.0
HORIZON = 120.0  # simulated seconds: far beyond any deadline
MAX_STEPS = 200_000


def address(qpn: int, gid_byte: int) -> bytes:
    return _verbs.encode_address(
        gid=bytes(10) + b"\xff\xff" + bytes([10, 0, 0, gid_byte]),
        lid=0,
        port=1,
        gid_index=3,
        ud_qpn=qpn,
        qkey=0x1234,
        mtu=5,
        ethernet=True,
        roce_v2=True,
    )


def machine(local: bytes, peer: bytes, seed: int, timeout: float = TIMEOUT) -> _verbs.HandshakeMachine:
    return _verbs.HandshakeMachine(local, peer, seed, RETRY_INITIAL, RETRY_MAX, timeout)


@dataclass
class Network:
    """Datagrams between two machines: each is lost, duplicated and delayed at random."""

    rng: random.Random
    drop: float = 0.0
    drops_left: float = 0  # losses allowed (math.inf: any)
    dup: float = 0.0
    max_delay: float = 0.0
    queue: list[tuple[float, int, int, bytes]] = field(default_factory=list)
    order: itertools.count[int] = field(default_factory=itertools.count)
    log: list[tuple[int, bytes]] = field(default_factory=list)
    lost: int = 0

    def send(self, now: float, dst: int, data: bytes) -> None:
        self.log.append((dst, data))
        if self.drops_left > 0 and self.rng.random() < self.drop:
            self.drops_left -= 1
            self.lost += 1
            return
        copies = 1
        while copies < 4 and self.rng.random() < self.dup:
            copies += 1
        for _ in range(copies):
            at = now + self.rng.uniform(0, self.max_delay)
            heapq.heappush(self.queue, (at, next(self.order), dst, data))


@dataclass
class Sim:
    a: _verbs.HandshakeMachine
    b: _verbs.HandshakeMachine
    net: Network
    now: float = 0.0
    actions: list[tuple[float, str, int]] = field(default_factory=list)  # (time, "start"/"reset", side)
    steps: int = 0

    @property
    def sides(self) -> tuple[_verbs.HandshakeMachine, _verbs.HandshakeMachine]:
        return (self.a, self.b)

    def collect(self) -> None:
        for i, m in enumerate(self.sides):
            for data in m.outbox():
                self.net.send(self.now, 1 - i, data)

    def run(self) -> None:
        """Until nothing is in flight, no timer is armed and no action is left."""
        pending = sorted(self.actions)
        while True:
            self.steps += 1
            assert self.steps < MAX_STEPS, "the handshake never settles (livelock)"
            candidates = [self.a.next_timer(), self.b.next_timer()]
            if self.net.queue:
                candidates.append(self.net.queue[0][0])
            if pending:
                candidates.append(pending[0][0])
            t = min(candidates)
            if math.isinf(t):
                return
            assert t <= HORIZON, f"still busy at t={t}: a hang"
            self.now = max(self.now, t)
            if pending and pending[0][0] <= self.now:
                _, what, side = pending.pop(0)
                m = self.sides[side]
                if what == "reset":
                    if m.state == "connected":  # a QP error: torn down, rebuilt on next use
                        m.reset()
                        m.start(self.now)
                else:
                    m.start(self.now)
            elif self.net.queue and self.net.queue[0][0] <= self.now:
                _, _, dst, data = heapq.heappop(self.net.queue)
                assert self.sides[dst].deliver(data, self.now)
            for m in self.sides:
                if m.next_timer() <= self.now:
                    m.tick(self.now)
            self.collect()


def assert_connected(a: _verbs.HandshakeMachine, b: _verbs.HandshakeMachine) -> None:
    assert (a.state, b.state) == ("connected", "connected"), (a.failure, b.failure)
    assert a.remote_params() == b.local_params() and b.remote_params() == a.local_params()
    assert a.remote_epoch == b.local_epoch and b.remote_epoch == a.local_epoch
    assert a.active != b.active  # exactly one side sent the REQ that was answered


def pair(seed: int, a_lower: bool) -> tuple[_verbs.HandshakeMachine, _verbs.HandshakeMachine, bytes, bytes]:
    x, y = address(1000, 1), address(2000, 2)
    lo, hi = sorted((x, y))
    a_addr, b_addr = (lo, hi) if a_lower else (hi, lo)
    return machine(a_addr, b_addr, seed), machine(b_addr, a_addr, seed + 1), a_addr, b_addr


scenario = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32),
        "a_lower": st.booleans(),
        "drop": st.floats(0, 0.6),
        "drops": st.integers(0, 8),
        "dup": st.floats(0, 0.5),
        "max_delay": st.sampled_from([0.0, 0.001, 0.02, 0.2]),
        "b_starts": st.one_of(st.none(), st.floats(0, 0.3)),
        "resets": st.lists(st.tuples(st.floats(0, 2.0), st.integers(0, 1)), max_size=2),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario)
def test_finite_loss_always_ends_connected_with_matching_parameters(s: dict[str, Any]) -> None:
    a, b, _, _ = pair(s["seed"], s["a_lower"])
    net = Network(random.Random(s["seed"]), s["drop"], s["drops"], s["dup"], s["max_delay"])
    sim = Sim(a, b, net)
    sim.actions.append((0.0, "start", 0))
    if s["b_starts"] is not None:
        sim.actions.append((s["b_starts"], "start", 1))
    sim.actions.extend((t, "reset", side) for t, side in s["resets"])
    sim.run()
    assert_connected(a, b)
    event(f"lost {min(net.lost, 3)}{'+' if net.lost >= 3 else ''} datagrams")
    event(f"epochs {a.local_epoch}/{b.local_epoch}")
    event("A was the active side" if a.active else "B was the active side")
    # every message ever sent, delivered once more in any order, changes nothing
    sim.actions.clear()
    before = (a.local_params(), b.local_params(), a.local_epoch, b.local_epoch)
    a.events()
    b.events()
    log = list(net.log)
    random.Random(s["seed"]).shuffle(log)
    for dst, data in log:
        assert sim.sides[dst].deliver(data, sim.now)
    net.drops_left = 0
    sim.collect()
    sim.run()
    assert_connected(a, b)
    assert (a.local_params(), b.local_params(), a.local_epoch, b.local_epoch) == before
    assert not [e for e in a.events() + b.events() if e.startswith(("open_qp", "teardown", "failed"))]


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    a_lower=st.booleans(),
    b_starts=st.one_of(st.none(), st.floats(0, 3.0)),
    timeout=st.sampled_from([0.05, 1.0, 5.0]),
)
def test_when_every_packet_is_lost_each_side_fails_at_its_deadline(
    seed: int, a_lower: bool, b_starts: float | None, timeout: float
) -> None:
    x, y = sorted((address(1000, 1), address(2000, 2)))
    a_addr, b_addr = (x, y) if a_lower else (y, x)
    a, b = machine(a_addr, b_addr, seed, timeout), machine(b_addr, a_addr, seed + 1, timeout)
    sim = Sim(a, b, Network(random.Random(seed), drop=1.0, drops_left=math.inf))
    sim.actions.append((0.0, "start", 0))
    if b_starts is not None:
        sim.actions.append((b_starts, "start", 1))
    sim.run()
    assert a.state == "failed" and "no answer from the peer" in a.failure
    assert b.state == ("idle" if b_starts is None else "failed")
    # A failed by its deadline (the last event of the run is the last deadline)
    start = max([0.0] + ([b_starts] if b_starts is not None else []))
    assert sim.now == pytest.approx(start + timeout)
    assert a.sent >= 2  # it retried before giving up


def test_a_lost_rep_is_recovered_by_the_req_retry_without_a_second_queue_pair() -> None:
    a, b, _, _ = pair(7, a_lower=True)
    a.start(0.0)
    req = a.outbox()
    assert len(req) == 1 and _verbs.decode_handshake(req[0])["type"] == "REQ"
    assert b.deliver(req[0], 0.001)
    (rep,) = b.outbox()  # lost on the way
    assert _verbs.decode_handshake(rep)["type"] == "REP" and b.state == "rep_sent"
    # A's REQ retry (after the initial backoff) reaches B, a duplicate: B resends its REP
    a.tick(a.next_timer())
    (req2,) = a.outbox()
    assert req2 == req[0]  # idempotent: the same REQ
    assert b.deliver(req2, 0.01)
    (rep2,) = b.outbox()
    assert rep2 == rep
    assert a.deliver(rep2, 0.011)
    (ack,) = a.outbox()
    assert b.deliver(ack, 0.012)
    assert_connected(a, b)
    assert [e for e in b.events() if e.startswith("open_qp")] == ["open_qp 1"]


def test_a_duplicate_req_is_answered_with_the_same_rep() -> None:
    a, b, _, _ = pair(11, a_lower=False)
    a.start(0.0)
    (req,) = a.outbox()
    for t in (0.001, 0.002, 0.003):
        assert b.deliver(req, t)
    reps = b.outbox()
    assert len(reps) == 3 and len(set(reps)) == 1
    assert [e for e in b.events() if e.startswith("open_qp")] == ["open_qp 1"]


@pytest.mark.parametrize("a_lower", [True, False])
def test_simultaneous_open_is_resolved_by_the_lower_address(a_lower: bool) -> None:
    a, b, a_addr, b_addr = pair(3, a_lower)
    a.start(0.0)
    b.start(0.0)
    (req_a,) = a.outbox()
    (req_b,) = b.outbox()
    assert a.deliver(req_b, 0.001) and b.deliver(req_a, 0.001)
    winner, loser = (a, b) if a_addr < b_addr else (b, a)
    assert winner.state == "req_sent" and not winner.outbox()  # ignores the loser's REQ
    assert loser.state == "rep_sent"
    (rep,) = loser.outbox()
    assert winner.deliver(rep, 0.002)
    (ack,) = winner.outbox()
    assert loser.deliver(ack, 0.003)
    assert_connected(a, b)
    assert winner.active and not loser.active
    # each side made one queue pair: the loser answered with the one made for its own REQ
    for m in (a, b):
        assert [e for e in m.events() if e.startswith("open_qp")] == ["open_qp 1"]


def test_a_rebuilt_side_reconnects_with_new_epochs_and_the_old_ones_are_ignored() -> None:
    a, b, _, _ = pair(5, a_lower=True)
    net = Network(random.Random(5))
    sim = Sim(a, b, net, actions=[(0.0, "start", 0)])
    sim.run()
    assert_connected(a, b)
    sim.actions.clear()
    old = list(net.log)
    a.reset()  # A's QP went to the error state
    a.start(sim.now)
    sim.collect()
    sim.run()
    assert_connected(a, b)
    assert a.local_epoch == 2 and b.local_epoch == 2
    assert any(e.startswith("teardown") for e in b.events())  # B failed its in-flight work
    for dst, data in old:  # the first incarnation's messages, late
        assert sim.sides[dst].deliver(data, sim.now)
    sim.collect()
    sim.run()
    assert_connected(a, b)
    assert (a.local_epoch, b.local_epoch) == (2, 2)


def test_messages_for_other_ends_and_garbage_are_not_delivered() -> None:
    a, b, a_addr, b_addr = pair(9, a_lower=True)
    stranger = address(3000, 3)
    a.start(0.0)
    (req,) = a.outbox()
    c = machine(stranger, a_addr, 1)
    assert not c.deliver(req, 0.0)  # addressed to B
    assert not b.deliver(b"\0" * 128, 0.0)
    assert not b.deliver(req[:-1], 0.0)
    assert b.state == "idle"
    forged = _verbs.encode_handshake("REQ", 1, 0, stranger, b_addr, _verbs.decode_handshake(req)["params"])
    assert not b.deliver(forged, 0.0)  # from someone who is not B's peer
    assert b.state == "idle"


def test_a_queue_pair_that_cannot_connect_fails_the_handshake_with_the_reason() -> None:
    a, b, _, _ = pair(13, a_lower=True)
    b.fail_connect = True
    a.start(0.0)
    (req,) = a.outbox()
    assert b.deliver(req, 0.001)
    assert b.state == "failed" and "connect refused (injected)" in b.failure
    assert any(e.startswith("failed:") for e in b.events())


def test_backoff_doubles_up_to_the_cap() -> None:
    a = machine(address(1000, 1), address(2000, 2), 1)
    a.start(0.0)
    times = []
    t = 0.0
    while a.state == "req_sent":
        t = a.next_timer()
        a.tick(t)
        if a.outbox():
            times.append(t)
    gaps = [round(y - x, 6) for x, y in itertools.pairwise([0.0, *times])]
    assert gaps[:6] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.16]
    assert set(gaps[7:]) == {0.25}
    assert t == pytest.approx(TIMEOUT) and a.state == "failed"
