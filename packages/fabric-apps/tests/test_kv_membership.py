"""Membership through a torch.distributed Store, and a decoder's router over it: instances
join and leave while traffic runs, a draining prefill finishes what it has and gets nothing
new, a dead one is marked lost for everyone and its requests alone fail."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist
from kvworld import T, World, eventually, serve

from fabric_apps.kvcache import KvLayout
from fabric_apps.kvcache.membership import KvMembership, Member, NoPrefill, PrefillRouter
from fabric_core.errors import ConfigError, PeerUnreachable, TransferTimeout
from fabric_core.models import DomainAddress

A, B, C = (DomainAddress(raw=bytes([i]) * 8) for i in (1, 2, 3))


def _members() -> KvMembership:
    return KvMembership(dist.HashStore(), "t", timeout=2.0)  # type: ignore[attr-defined]


def test_join_gives_each_instance_its_own_index_and_members_lists_them_in_order() -> None:
    m = _members()
    a = m.join("prefill", "p0", A)
    b = m.join("decode", "d0", B)
    c = m.join("prefill", "p1", C)
    assert [x.index for x in (a, b, c)] == [0, 1, 2]
    assert m.members() == [a, b, c]
    assert m.members("prefill") == [a, c]
    assert m.members("decode", states=("up",)) == [b]
    assert m.get(2) == c and c.routable
    # a second view of the same store (another process) sees the same records
    other = KvMembership(m.store, "t")
    assert other.members() == [a, b, c]


def test_states_move_forward_only_and_final_states_stay() -> None:
    m = _members()
    a = m.join("prefill", "p0", A)
    assert m.drain(a).state == "draining"
    assert m.drain(a).state == "draining"  # idempotent
    assert m.mark_lost(a).state == "lost"
    assert m.leave(a).state == "lost"  # lost is final: a late leave does not undo it
    b = m.join("prefill", "p1", B)
    assert m.leave(b).state == "left"
    assert m.mark_lost(b).state == "left"  # left first: stays left
    assert m.drain(b).state == "left"
    assert [x.state for x in m.members()] == ["lost", "left"]
    assert m.members(states=("up", "draining")) == []


def test_concurrent_state_changes_land_exactly_once() -> None:
    """Eight threads race to mark one member lost while it leaves: one wins, the record is
    one of the two final states and never goes back to up."""
    m = _members()
    target = m.join("prefill", "p0", A)
    results: list[Member] = []
    lock = threading.Lock()

    def act(i: int) -> None:
        view = KvMembership(m.store, "t")
        r = view.leave(target) if i == 0 else view.mark_lost(target)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=act, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    final = m.get(0).state
    assert final in ("left", "lost")
    assert all(r.state == final for r in results)


def test_a_join_half_written_is_skipped_not_waited_for() -> None:
    m = _members()
    a = m.join("prefill", "p0", A)
    m.store.add("t/count", 1)  # index 1 claimed, its record not written yet
    assert m.members() == [a]
    with pytest.raises(ConfigError, match="no member 1"):
        m.get(1)
    c = m.join("decode", "d0", C)
    assert m.members() == [a, c]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.join("router", "x", A), "role"),
        (lambda m: m.join("prefill", "", A), "name"),
        (lambda m: m.join("prefill", "x", b"\x01"), "DomainAddress"),
        (lambda m: KvMembership(m.store, "a/b"), "prefix"),
        (lambda m: KvMembership(m.store, "a", timeout=0), "timeout"),
    ],
)
def test_bad_input_is_a_config_error_and_adds_nobody(call: Any, match: str) -> None:
    m = _members()
    with pytest.raises(ConfigError, match=match):
        call(m)
    assert m.members() == []


def test_a_corrupt_record_is_a_config_error_naming_the_member() -> None:
    m = _members()
    m.join("prefill", "p0", A)
    m.store.set("t/m/0", b"not json")
    with pytest.raises(ConfigError, match="member 0"):
        m.members()


def test_wait_for_returns_once_enough_are_up_or_times_out() -> None:
    m = _members()
    with pytest.raises(TransferTimeout, match="0 of 1 prefill"):
        m.wait_for("prefill", 1, timeout=0.1)
    threading.Timer(0.05, lambda: m.join("prefill", "p0", A)).start()
    assert [x.name for x in m.wait_for("prefill", 1, timeout=T)] == ["p0"]


# --- the router on the simulator ---------------------------------------------------------


LAYOUT = KvLayout(2, 32, 4, 2, 8, "float32", "stacked")


def _router(world: World) -> tuple[Any, KvMembership, PrefillRouter]:
    dec, _ = world.decoder(LAYOUT)
    members = _members()
    members.timeout = T
    return dec, members, PrefillRouter(dec, members, connect_timeout=T)


def _prefill(world: World, members: KvMembership, name: str) -> tuple[Any, Member]:
    pf, _ = world.prefiller(LAYOUT, seed=len(name))
    return pf, members.join("prefill", name, pf.address)


def test_router_connects_new_prefills_and_spreads_requests_by_load(world: World) -> None:
    _dec, members, router = _router(world)
    with pytest.raises(NoPrefill):
        router.receive("r0", 2)
    p0, m0 = _prefill(world, members, "p0")
    joined, gone = router.refresh()
    assert (joined, gone) == ([m0], [])
    p1, m1 = _prefill(world, members, "p1")
    assert router.refresh() == ([m1], [])
    assert router.refresh() == ([], [])
    picks = [router.receive(f"r{i}", 2) for i in range(4)]
    assert sorted(m.name for m, _ in picks) == ["p0", "p0", "p1", "p1"]  # fewest outstanding first
    assert router.outstanding() == {0: 2, 1: 2}
    src = {f"r{i}": [i, i + 4] for i in range(4)}
    for pf in (p0, p1):
        for job in serve(pf, src, 2):
            job.wait(T)
    for _, h in picks:
        h.wait(T)
        h.release()
    assert eventually(lambda: router.outstanding() == {})


def test_a_draining_prefill_finishes_its_requests_and_gets_no_new_ones(world: World) -> None:
    _dec, members, router = _router(world)
    p0, m0 = _prefill(world, members, "p0")
    p1, _m1 = _prefill(world, members, "p1")
    router.refresh()
    first = [router.receive(f"a{i}", 2) for i in range(2)]
    on_p0 = next(h for m, h in first if m.name == "p0")
    members.drain(m0)
    assert router.refresh() == ([], [members.get(0)])
    later = [router.receive(f"b{i}", 2) for i in range(3)]
    assert {m.name for m, _ in later} == {"p1"}
    # p0 still serves what it took before draining
    src = {r: [0, 1] for r in ("a0", "a1", "b0", "b1", "b2")}
    for job in serve(p0, src, 1):
        job.wait(T)
    on_p0.wait(T)
    assert on_p0.succeeded()
    for job in serve(p1, src, 4):
        job.wait(T)
    for _, h in first + later:
        h.wait(T)
        h.release()
    members.leave(m0)
    assert router.refresh() == ([], [])
    assert [m.name for m in router.prefills()] == ["p1"]


def test_a_dead_prefill_fails_its_requests_alone_and_is_marked_lost_for_everyone(world: World) -> None:
    dec, members, router = _router(world)
    p0, _m0 = _prefill(world, members, "p0")
    p1, m1 = _prefill(world, members, "p1")
    router.refresh()
    picks = [router.receive(f"r{i}", 2) for i in range(4)]
    doomed = [h for m, h in picks if m.name == "p0"]
    world.fabric.fail_peer(p0.engine)
    for h in doomed:
        with pytest.raises(PeerUnreachable):
            h.wait(T)
    router.refresh()  # reports the death to the store
    assert members.get(0).state == "lost"
    assert KvMembership(members.store, "t").members(states=("up",)) == [m1]
    later = [router.receive(f"s{i}", 2) for i in range(2)]
    assert {m.name for m, _ in later} == {"p1"}
    src = {f"r{i}": [i, i + 4] for i in range(4)} | {f"s{i}": [i, 9] for i in range(2)}
    for job in serve(p1, src, 4):
        job.wait(T)
    for m, h in picks + later:
        if m.name == "p1":
            h.wait(T)
            h.release()
    assert dec.wait_idle(T)
    dec.allocator.check_no_leaks()


def test_a_prefill_known_gone_is_dropped_as_the_request_is_made(world: World) -> None:
    """The decoder learnt of the death outside the router: the router's next request finds
    it at once (nothing sent), drops it, and reports it lost at the next refresh."""
    dec, members, router = _router(world)
    p0, _m0 = _prefill(world, members, "p0")
    router.refresh()
    world.fabric.fail_peer(p0.engine)
    with pytest.raises(PeerUnreachable):  # at once, or when the request fails
        dec.receive(p0.address, "probe", 1).wait(T)
    with pytest.raises(NoPrefill):
        router.receive("x", 2)
    assert router.prefills() == []
    p1, m1 = _prefill(world, members, "p1")
    assert router.refresh() == ([m1], [])
    assert members.get(0).state == "lost"
    member, h = router.receive("y", 2)
    assert member.name == "p1"
    for job in serve(p1, {"y": [3, 4]}, 1):
        job.wait(T)
    h.wait(T)
    h.release()


def test_router_takes_turns_among_equally_loaded_prefills(world: World) -> None:
    """Requests that finish before the next one is made leave every prefill at zero
    outstanding: the router then takes them in turn, not always the first to have joined."""
    _dec, members, router = _router(world)
    pfs = [_prefill(world, members, f"p{i}")[0] for i in range(3)]
    router.refresh()
    names = []
    for i in range(6):
        member, h = router.receive(f"t{i}", 1)
        names.append(member.name)
        pf = pfs[int(member.name[1:])]
        for job in serve(pf, {f"t{i}": [i]}, 1):
            job.wait(T)
        h.wait(T)
        h.release()
        assert eventually(lambda: router.outstanding() == {})
    assert sorted(names) == ["p0", "p0", "p1", "p1", "p2", "p2"]


def test_a_prefill_that_fails_its_hello_is_lost_or_tried_again_by_the_error(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``refresh`` connects each new prefill (HELLO). One found gone (``PeerUnreachable``) is
    marked lost for everyone and never routed to; one that does not answer in time (another
    ``FabricError``) is left alone and tried again at the next refresh."""
    dec, members, router = _router(world)
    _p0, m0 = _prefill(world, members, "p0")
    p1, m1 = _prefill(world, members, "p1")
    real = dec.connect
    tried: list[bytes] = []

    def connect(address: DomainAddress, timeout: float | None = None) -> None:
        tried.append(address.raw)
        if address == m0.address:
            raise PeerUnreachable("p0 is gone", peer=address)
        if address == m1.address and tried.count(address.raw) == 1:
            raise TransferTimeout("p1 did not answer the hello in time")
        real(address, timeout=timeout)

    monkeypatch.setattr(dec, "connect", connect)
    assert router.refresh() == ([], [])
    assert members.get(0).state == "lost"
    assert members.get(1).state == "up"
    assert router.prefills() == []
    with pytest.raises(NoPrefill):
        router.receive("x", 2)
    # the next refresh tries p1 again (and not p0: it is lost)
    assert router.refresh() == ([m1], [])
    assert tried.count(m0.address.raw) == 1 and tried.count(m1.address.raw) == 2
    member, h = router.receive("y", 2)
    assert member.name == "p1"
    for job in serve(p1, {"y": [3, 4]}, 1):
        job.wait(T)
    h.wait(T)
    h.release()
