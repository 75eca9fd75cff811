"""Unit tests of fabric_core.ops.plan_request: the cutting rules and the counting rule.

The checks rebuild what the WRs move from the plan's arrays and compare it with what the
request asks for, and compare the shard layout with the rule in the module docstring.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fabric_core import (
    BarrierRequest,
    ConfigError,
    DomainAddress,
    ImmRequest,
    MemoryRegion,
    MemoryRegionDescriptor,
    NicKey,
    PagedWriteRequest,
    PeerGroup,
    Pinned,
    Plan,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
    plan_request,
)
from fabric_core.ops import SHARD_ALIGN

KIB, MIB = 1 << 10, 1 << 20
BIG = 1 << 30
PROPS = settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def desc(k: int, length: int = 4 * MIB, *, writable: bool = True, peer: int = 1) -> MemoryRegionDescriptor:
    return MemoryRegionDescriptor(
        ptr=0x7000_0000,
        length=length,
        writable=writable,
        nics=tuple(NicKey(address=DomainAddress(raw=bytes([peer, i])), rkey=100 + i) for i in range(k)),
    )


def region(k: int, length: int = 4 * MIB) -> MemoryRegion:
    return MemoryRegion(handle=1, ptr=0x1000, length=length, descriptor=desc(k, length, peer=0))


@dataclass(frozen=True)
class Seg:
    """One contiguous piece the request asks for: ``length`` bytes from src to dst of a target."""

    target: int
    src: int
    dst: int
    length: int


def wrs(plan: Plan) -> list[tuple[int, int, int, int, int]]:
    """(target, src_off, dst_off, length, nic) of every WR, as Python ints."""
    return [
        (int(t), int(s), int(d), int(ln), int(n))
        for t, s, d, ln, n in zip(plan.target, plan.src_off, plan.dst_off, plan.length, plan.nic, strict=True)
    ]


def check_plan(plan: Plan, segs: list[Seg], *, n: int, max_msg: int, imm: int | None) -> None:
    """The WRs move exactly the bytes of ``segs``, each once, within the limits; the counting
    rule holds."""
    arrays = (plan.nic, plan.target, plan.src_off, plan.dst_off, plan.length)
    sizes = {a.size for a in arrays}
    assert sizes == {plan.num_wrs}
    for a in arrays:
        assert a.dtype == np.int64 and a.ndim == 1
    assert plan.num_wrs >= 1
    assert (plan.length >= 0).all() and (plan.length <= max_msg).all()
    assert (plan.src_off >= 0).all() and (plan.dst_off >= 0).all()
    assert ((plan.nic >= 0) & (plan.nic < n)).all()
    assert ((plan.target >= 0) & (plan.target < len(plan.targets))).all()
    # Byte cover: walk the WRs sorted by (target, dst, length, src) against the segments.
    items = sorted(wrs(plan), key=lambda w: (w[0], w[2], w[3], w[1]))
    expected = sorted(segs, key=lambda s: (s.target, s.dst, s.length, s.src))
    i = 0
    for seg in expected:
        if seg.length == 0:
            assert i < len(items), f"{seg} has no WR"
            assert items[i][:4] == (seg.target, seg.src, seg.dst, 0), (seg, items[i])
            i += 1
            continue
        done = 0
        while done < seg.length:
            assert i < len(items), f"bytes of {seg} not covered"
            t, s, d, ln, _ = items[i]
            assert (t, s, d) == (seg.target, seg.src + done, seg.dst + done), (seg, items[i])
            assert 0 < ln <= seg.length - done
            done += ln
            i += 1
    assert i == len(items), "WRs beyond the requested bytes"
    # Counting rule.
    assert plan.imm == imm
    if imm is None:
        assert plan.imms_per_target == (0,) * len(plan.targets)
    else:
        per = Counter(int(t) for t in plan.target)
        assert plan.imms_per_target == tuple(per[j] for j in range(len(plan.targets)))
        assert sum(plan.imms_per_target) == plan.num_wrs


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pieces(length: int, max_msg: int) -> int:
    return max(1, ceil_div(length, max_msg))


def shard_layout(length: int, k: int) -> list[tuple[int, int]]:
    """The documented rule: at most k shards of round_up(ceil(len / k), 4096) bytes."""
    if length == 0:
        return [(0, 0)]
    size = ceil_div(ceil_div(length, k), SHARD_ALIGN) * SHARD_ALIGN
    return [(off, min(size, length - off)) for off in range(0, length, size)]


def nic_spans(plan: Plan, target: int = 0) -> dict[int, tuple[int, int]]:
    """Per NIC: the (start, end) of the dst bytes it carries for ``target`` (checked contiguous)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t, _, d, ln, nic in wrs(plan):
        if t == target:
            spans.setdefault(nic, []).append((d, d + ln))
    out = {}
    for nic, parts in spans.items():
        parts.sort()
        for (_, end), (start, _) in itertools.pairwise(parts):
            assert end == start, f"NIC {nic} carries a non-contiguous range"
        out[nic] = (parts[0][0], parts[-1][1])
    return out


NICS = [1, 2, 4]
ROUTINGS = ["sharded", "sharded_k", "pinned"]


def routing_for(name: str, n: int) -> Any:
    return {"sharded": Sharded(), "sharded_k": Sharded(max(1, n // 2)), "pinned": Pinned(n - 1)}[name]


# --------------------------------------------------------------------------- single writes


class TestWrite:
    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("route", ROUTINGS)
    @pytest.mark.parametrize("imm", [None, 0, 7, 0xFFFFFFFF])
    @pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 100_000, MIB])
    def test_cover_and_shards(self, n: int, route: str, imm: int | None, length: int) -> None:
        src, dst = region(n), desc(n)
        routing = routing_for(route, n)
        max_msg = 10_000
        so, do = 123, 4567
        plan = plan_request(WriteRequest(src, so, length, dst, do, imm, routing), n, max_msg, rotation=1)
        check_plan(plan, [Seg(0, so, do, length)], n=n, max_msg=max_msg, imm=imm)
        assert plan.targets == (dst,)
        if isinstance(routing, Pinned):
            assert set(plan.nic.tolist()) == {routing.nic}
            assert plan.num_wrs == pieces(length, max_msg)
            return
        k = n if routing.nics is None else routing.nics
        layout = shard_layout(length, k)
        assert len(layout) <= k
        assert plan.num_wrs == sum(pieces(ln, max_msg) for _, ln in layout)
        spans = nic_spans(plan)
        expected_spans = {(1 + j) % n: (do + off, do + off + ln) for j, (off, ln) in enumerate(layout)}
        assert spans == expected_spans

    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("routing", [Sharded(), Sharded(1), Pinned(0)])
    def test_zero_length_is_one_wr(self, n: int, routing: Any) -> None:
        plan = plan_request(WriteRequest(region(n), 10, 0, desc(n), 20, 5, routing), n, 64)
        assert plan.num_wrs == 1
        assert wrs(plan) == [(0, 10, 20, 0, 0)]
        assert plan.imms_per_target == (1,)

    def test_documented_example(self) -> None:
        # 10000 bytes over 4 NICs: shards of round_up(2500, 4096) = 4096 -> 3 shards.
        plan = plan_request(WriteRequest(region(4), 0, 10_000, desc(4), 0, 9), 4, BIG)
        assert wrs(plan) == [(0, 0, 0, 4096, 0), (0, 4096, 4096, 4096, 1), (0, 8192, 8192, 1808, 2)]
        assert plan.imms_per_target == (3,)
        # A large write gets k full shards.
        plan = plan_request(WriteRequest(region(4), 0, 4 * MIB, desc(4), 0, 9), 4, BIG)
        assert plan.nic.tolist() == [0, 1, 2, 3] and plan.length.tolist() == [MIB] * 4

    def test_max_msg_split_each_piece_counts(self) -> None:
        plan = plan_request(WriteRequest(region(1), 0, 10_000, desc(1), 0, 3), 1, 4096)
        assert plan.length.tolist() == [4096, 4096, 1808]
        assert plan.src_off.tolist() == [0, 4096, 8192]
        assert plan.imms_per_target == (3,)

    @pytest.mark.parametrize("n", [2, 4])
    def test_rotation_changes_nics_not_count(self, n: int) -> None:
        req = WriteRequest(region(n), 0, MIB, desc(n), 0, 1)
        plans = [plan_request(req, n, 100_000, rotation=r) for r in range(n + 1)]
        assert len({p.num_wrs for p in plans}) == 1
        assert len({p.imms_per_target for p in plans}) == 1
        first_nic = [int(p.nic[np.argmin(p.dst_off)]) for p in plans]
        assert first_nic == [r % n for r in range(n + 1)]
        for p in plans:
            assert sorted(p.length.tolist()) == sorted(plans[0].length.tolist())
        assert plans[0].nic.tolist() != plans[1].nic.tolist()
        assert plans[0].nic.tolist() == plans[n].nic.tolist()

    def test_pinned_ignores_rotation(self) -> None:
        req = WriteRequest(region(4), 0, MIB, desc(4), 0, 1, Pinned(2))
        for r in range(4):
            assert set(plan_request(req, 4, 4096, rotation=r).nic.tolist()) == {2}

    def test_sharded_fewer_nics(self) -> None:
        plan = plan_request(WriteRequest(region(4), 0, MIB, desc(4), 0, None, Sharded(2)), 4, BIG, rotation=3)
        assert sorted(plan.nic.tolist()) == [0, 3]
        assert plan.imms_per_target == (0,)

    def test_whole_region(self) -> None:
        plan = plan_request(WriteRequest(region(2, 8192), 0, 8192, desc(2, 8192), 0, 1), 2, BIG)
        assert plan.length.sum() == 8192


# --------------------------------------------------------------------------- paged writes


def paged_segs(
    sp: list[int], dp: list[int], ss: int, ds: int, plen: int, so: int = 0, do: int = 0
) -> list[Seg]:
    return [Seg(0, so + s * ss, do + d * ds, plen) for s, d in zip(sp, dp, strict=True)]


class TestPaged:
    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("route", ROUTINGS)
    @pytest.mark.parametrize("imm", [None, 11])
    @pytest.mark.parametrize("plen", [0, 1, 3000, 4096, 9000])
    def test_cover(self, n: int, route: str, imm: int | None, plen: int) -> None:
        sp, dp = [5, 0, 3, 3, 9, 1, 2], [0, 6, 2, 3, 1, 5, 4]
        ss, ds = 9000, 9500
        routing = routing_for(route, n)
        max_msg = 4096
        req = PagedWriteRequest(region(n), sp, ss, desc(n), dp, ds, plen, 17, 33, imm, routing)
        plan = plan_request(req, n, max_msg, rotation=2)
        check_plan(plan, paged_segs(sp, dp, ss, ds, plen, 17, 33), n=n, max_msg=max_msg, imm=imm)
        assert plan.num_wrs == len(sp) * pieces(plen, max_msg)
        if isinstance(routing, Pinned):
            assert set(plan.nic.tolist()) == {routing.nic}
            return
        k = n if routing.nics is None else routing.nics
        # Each NIC gets a contiguous range of the page list, in rotation order.
        page_nic = [int(plan.nic[np.flatnonzero(plan.dst_off == 33 + d * ds)[0]]) for d in dp]
        runs = [page_nic[0]]
        for nic in page_nic[1:]:
            if nic != runs[-1]:
                runs.append(nic)
        assert len(runs) == len(set(runs)) == min(k, len(sp))
        assert runs == [(2 + j) % n for j in range(len(runs))]

    def test_one_wr_per_page(self) -> None:
        plan = plan_request(
            PagedWriteRequest(region(1), [0, 1, 2], 4096, desc(1), [2, 0, 1], 4096, 4096, imm=1), 1, BIG
        )
        assert wrs(plan) == [(0, 0, 8192, 4096, 0), (0, 4096, 0, 4096, 0), (0, 8192, 4096, 4096, 0)]
        assert plan.imms_per_target == (3,)

    def test_sharded_page_ranges(self) -> None:
        plan = plan_request(
            PagedWriteRequest(region(4), list(range(8)), 4096, desc(4), list(range(8)), 4096, 4096, imm=1),
            4,
            BIG,
        )
        assert plan.nic.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]

    @pytest.mark.parametrize(
        "make",
        [
            lambda v: np.array(v, dtype=np.int32),
            lambda v: np.array(v, dtype=np.int64),
            lambda v: np.array(v, dtype=np.uint16),
            lambda v: list(v),
            lambda v: tuple(v),
            lambda v: torch.tensor(v, dtype=torch.int64),
            lambda v: torch.tensor(v, dtype=torch.int32),
            lambda v: range(len(v)) if list(v) == list(range(len(v))) else list(v),
        ],
        ids=["np_int32", "np_int64", "np_uint16", "list", "tuple", "torch_int64", "torch_int32", "range"],
    )
    def test_index_types(self, make: Any) -> None:
        sp, dp = [0, 1, 2, 3], [3, 2, 1, 0]
        req = PagedWriteRequest(region(2), make(sp), 4096, desc(2), make(dp), 4096, 4096, imm=4)
        plan = plan_request(req, 2, BIG)
        assert plan.src_off.tolist() == [0, 4096, 8192, 12288]
        assert plan.dst_off.tolist() == [12288, 8192, 4096, 0]
        assert plan.imms_per_target == (4,)

    def test_duplicate_src_pages_allowed(self) -> None:
        plan = plan_request(PagedWriteRequest(region(1), [1, 1], 4096, desc(1), [0, 1], 4096, 4096), 1, BIG)
        assert plan.src_off.tolist() == [4096, 4096]

    def test_rotation(self) -> None:
        req = PagedWriteRequest(region(2), [0, 1], 4096, desc(2), [0, 1], 4096, 4096, imm=1)
        a, b = plan_request(req, 2, BIG, rotation=0), plan_request(req, 2, BIG, rotation=1)
        assert a.nic.tolist() == [0, 1] and b.nic.tolist() == [1, 0]
        assert a.num_wrs == b.num_wrs and a.imms_per_target == b.imms_per_target


# --------------------------------------------------------------------------- scatter


class TestScatter:
    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("route", ["peers", "sharded", "sharded_k", "pinned"])
    @pytest.mark.parametrize("imm", [None, 0x77])
    def test_cover(self, n: int, route: str, imm: int | None) -> None:
        dsts = [desc(n, peer=p) for p in range(1, 6)]
        lengths = [0, 100, 5000, 70_000, 4096]
        targets = [ScatterTarget(dsts[j], ln, 1000 * j, 3 * j) for j, ln in enumerate(lengths)]
        routing = ShardPeers() if route == "peers" else routing_for(route, n)
        max_msg = 8192
        plan = plan_request(ScatterRequest(region(n), targets, imm, routing), n, max_msg, rotation=1)
        segs = [Seg(j, t.src_offset, t.dst_offset, t.length) for j, t in enumerate(targets)]
        check_plan(plan, segs, n=n, max_msg=max_msg, imm=imm)
        assert plan.targets == tuple(dsts)
        for j, t in enumerate(targets):
            spans = nic_spans(plan, j)
            if isinstance(routing, ShardPeers):
                assert spans == {(1 + j) % n: (t.dst_offset, t.dst_offset + t.length)}
            elif isinstance(routing, Pinned):
                assert set(spans) == {routing.nic}
            else:
                k = n if routing.nics is None else routing.nics
                layout = shard_layout(t.length, k)
                assert spans == {
                    (1 + j + i) % n: (t.dst_offset + off, t.dst_offset + off + ln)
                    for i, (off, ln) in enumerate(layout)
                }
        if isinstance(routing, (ShardPeers, Pinned)):
            wrs_per_target = tuple(pieces(ln, max_msg) for ln in lengths)
        else:
            k = n if routing.nics is None else routing.nics
            wrs_per_target = tuple(sum(pieces(x, max_msg) for _, x in shard_layout(ln, k)) for ln in lengths)
        assert plan.imms_per_target == (wrs_per_target if imm is not None else (0,) * len(lengths))

    def test_same_descriptor_twice_counts_per_target(self) -> None:
        d = desc(2)
        targets = [ScatterTarget(d, 10, 0, 0), ScatterTarget(d, 10, 0, 100)]
        plan = plan_request(ScatterRequest(region(2), targets, 1), 2, BIG)
        assert plan.imms_per_target == (1, 1)
        assert plan.targets == (d, d)

    def test_peer_group_membership(self) -> None:
        a, b = desc(1, peer=1), desc(1, peer=2)
        group = PeerGroup(1, (a.peer,), frozenset({a.peer.raw}))
        plan = plan_request(ScatterRequest(region(1), [ScatterTarget(a, 8)], 1, group=group), 1, BIG)
        assert plan.num_wrs == 1
        with pytest.raises(ConfigError, match=r"targets\[1\] is not a member of the peer group 1"):
            plan_request(
                ScatterRequest(region(1), [ScatterTarget(a, 8), ScatterTarget(b, 8)], 1, group=group), 1, BIG
            )


# --------------------------------------------------------------------------- imm-only and barrier


class TestImmAndBarrier:
    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("routing", [Sharded(1), Sharded(), Pinned(0), ShardPeers()])
    def test_imm_is_one_zero_length_wr(self, n: int, routing: Any) -> None:
        d = desc(n)
        plan = plan_request(ImmRequest(d, 0xABC, routing), n, 64, rotation=n - 1)
        assert plan.num_wrs == 1
        assert (plan.length.tolist(), plan.target.tolist()) == ([0], [0])
        assert plan.imm == 0xABC and plan.imms_per_target == (1,) and plan.targets == (d,)
        assert int(plan.nic[0]) == (0 if isinstance(routing, Pinned) else (n - 1) % n)

    @pytest.mark.parametrize("n", NICS)
    @pytest.mark.parametrize("routing", [ShardPeers(), Sharded(), Pinned(0)])
    @pytest.mark.parametrize("count", [1, 3, 7])
    def test_barrier_one_per_destination(self, n: int, routing: Any, count: int) -> None:
        dsts = [desc(n, peer=p) for p in range(count)]
        plan = plan_request(BarrierRequest(dsts, 5, routing), n, 64, rotation=1)
        assert plan.num_wrs == count
        assert plan.target.tolist() == list(range(count))
        assert plan.length.tolist() == [0] * count
        assert plan.imms_per_target == (1,) * count
        assert plan.targets == tuple(dsts)
        expected = [0] * count if isinstance(routing, Pinned) else [(1 + j) % n for j in range(count)]
        assert plan.nic.tolist() == expected

    def test_barrier_accepts_any_sequence(self) -> None:
        dsts = (desc(2), desc(2, peer=2))
        assert plan_request(BarrierRequest(dsts, 1), 2, 64).num_wrs == 2


# --------------------------------------------------------------------------- property tests


@PROPS
@given(
    n=st.sampled_from(NICS),
    data=st.data(),
    max_msg=st.integers(1, 70_000),
    imm=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
    rotation=st.integers(0, 10),
)
def test_property_write(n: int, data: st.DataObject, max_msg: int, imm: int | None, rotation: int) -> None:
    src_len = data.draw(st.integers(1, 300_000), label="src_len")
    dst_len = data.draw(st.integers(1, 300_000), label="dst_len")
    length = data.draw(st.integers(0, min(src_len, dst_len)), label="length")
    so = data.draw(st.integers(0, src_len - length), label="so")
    do = data.draw(st.integers(0, dst_len - length), label="do")
    routing = data.draw(
        st.one_of(st.just(Sharded()), st.integers(1, n).map(Sharded), st.integers(0, n - 1).map(Pinned)),
        label="routing",
    )
    req = WriteRequest(region(n, src_len), so, length, desc(n, dst_len), do, imm, routing)
    plan = plan_request(req, n, max_msg, rotation)
    check_plan(plan, [Seg(0, so, do, length)], n=n, max_msg=max_msg, imm=imm)
    other = plan_request(req, n, max_msg, rotation + 1)
    assert other.num_wrs == plan.num_wrs and other.imms_per_target == plan.imms_per_target
    if not isinstance(routing, Pinned):
        k = n if routing.nics is None else routing.nics
        layout = shard_layout(length, k)
        assert nic_spans(plan) == {
            (rotation + j) % n: (do + o, do + o + ln) for j, (o, ln) in enumerate(layout)
        }
    # One byte more than fits is refused.
    with pytest.raises(ConfigError, match="exceed the region"):
        plan_request(
            WriteRequest(region(n, src_len), so, length, desc(n, dst_len), dst_len - length + 1), n, max_msg
        )


@PROPS
@given(
    n=st.sampled_from(NICS),
    data=st.data(),
    max_msg=st.integers(1, 20_000),
    imm=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
)
def test_property_paged(n: int, data: st.DataObject, max_msg: int, imm: int | None) -> None:
    plen = data.draw(st.integers(0, 10_000), label="plen")
    ds = data.draw(st.integers(plen, plen + 5000), label="ds")
    ss = data.draw(st.integers(0, 20_000), label="ss")
    count = data.draw(st.integers(1, 20), label="count")
    dp = data.draw(st.lists(st.integers(0, 40), min_size=count, max_size=count, unique=True), label="dp")
    sp = data.draw(st.lists(st.integers(0, 40), min_size=count, max_size=count), label="sp")
    so, do = data.draw(st.integers(0, 100), label="so"), data.draw(st.integers(0, 100), label="do")
    src_len = so + max(sp) * ss + plen + data.draw(st.integers(0, 10), label="src_slack")
    dst_len = do + max(dp) * ds + plen + data.draw(st.integers(0, 10), label="dst_slack")
    routing = data.draw(
        st.one_of(st.just(Sharded()), st.integers(1, n).map(Sharded), st.integers(0, n - 1).map(Pinned)),
        label="routing",
    )
    req = PagedWriteRequest(
        region(n, max(src_len, 1)), np.array(sp), ss, desc(n, dst_len), dp, ds, plen, so, do, imm, routing
    )
    plan = plan_request(req, n, max_msg)
    check_plan(plan, paged_segs(sp, dp, ss, ds, plen, so, do), n=n, max_msg=max_msg, imm=imm)
    assert plan.num_wrs == count * pieces(plen, max_msg)


@PROPS
@given(
    n=st.sampled_from(NICS),
    lengths=st.lists(st.integers(0, 50_000), min_size=1, max_size=6),
    max_msg=st.integers(1, 30_000),
    imm=st.one_of(st.none(), st.integers(0, (1 << 32) - 1)),
    rotation=st.integers(0, 5),
    route=st.sampled_from(["peers", "sharded", "pinned"]),
)
def test_property_scatter(
    n: int, lengths: list[int], max_msg: int, imm: int | None, rotation: int, route: str
) -> None:
    routing = {"peers": ShardPeers(), "sharded": Sharded(), "pinned": Pinned(n - 1)}[route]
    targets = [ScatterTarget(desc(n, 60_000, peer=j), ln, j, 7 * j) for j, ln in enumerate(lengths)]
    plan = plan_request(ScatterRequest(region(n, 60_000), targets, imm, routing), n, max_msg, rotation)
    segs = [Seg(j, j, 7 * j, ln) for j, ln in enumerate(lengths)]
    check_plan(plan, segs, n=n, max_msg=max_msg, imm=imm)
    other = plan_request(ScatterRequest(region(n, 60_000), targets, imm, routing), n, max_msg, rotation + 1)
    assert other.num_wrs == plan.num_wrs and other.imms_per_target == plan.imms_per_target


# --------------------------------------------------------------------------- bad input


def write(**kw: Any) -> WriteRequest:
    args: dict[str, Any] = dict(
        src=region(2, 8192), src_offset=0, length=100, dst=desc(2, 8192), dst_offset=0
    )
    args.update(kw)
    return WriteRequest(**args)


def paged(**kw: Any) -> PagedWriteRequest:
    args: dict[str, Any] = dict(
        src=region(2, 16 * 4096),
        src_pages=[0, 1],
        src_stride=4096,
        dst=desc(2, 16 * 4096),
        dst_pages=[0, 1],
        dst_stride=4096,
        page_length=4096,
    )
    args.update(kw)
    return PagedWriteRequest(**args)


BAD = [
    # single writes
    (
        "src out of bounds",
        write(src_offset=8100),
        r"source: bytes \[8100, 8200\) exceed the region's 8192 bytes",
    ),
    (
        "dst out of bounds",
        write(dst_offset=8093),
        r"destination: bytes \[8093, 8193\) exceed the region's 8192",
    ),
    ("length too big", write(length=8193), r"source: bytes \[0, 8193\) exceed"),
    ("negative length", write(length=-1), r"length must be non-negative and below 2\*\*63, got -1"),
    ("negative src_offset", write(src_offset=-5), r"src_offset must be non-negative"),
    ("negative dst_offset", write(dst_offset=-5), r"dst_offset must be non-negative"),
    ("huge length", write(length=1 << 63), r"length must be non-negative and below 2\*\*63"),
    ("bool length", write(length=True), r"length must be an int, got bool"),
    ("float length", write(length=100.0), r"length must be an int, got float"),
    ("float offset", write(src_offset=0.0), r"src_offset must be an int, got float"),
    ("bool offset", write(dst_offset=False), r"dst_offset must be an int, got bool"),
    ("str length", write(length="100"), r"length must be an int, got str"),
    ("imm -1", write(imm=-1), r"imm -1 is out of range"),
    ("imm 2**32", write(imm=1 << 32), r"imm 4294967296 is out of range"),
    ("imm str", write(imm="7"), r"imm must be an int in \[0, 2\*\*32\), got str"),
    ("imm bool", write(imm=True), r"imm must be an int .*got bool"),
    ("imm float", write(imm=7.0), r"imm must be an int .*got float"),
    (
        "nic count mismatch",
        write(dst=desc(4, 8192)),
        r"dst descriptor has 4 NIC keys but this engine's group has 2",
    ),
    ("read-only dst", write(dst=desc(2, 8192, writable=False)), r"dst descriptor names read-only memory"),
    ("dst not a descriptor", write(dst="desc"), r"dst must be a MemoryRegionDescriptor, got str"),
    ("src not a region", write(src=desc(2)), r"src must be a MemoryRegion of this engine"),
    ("pinned out of range", write(routing=Pinned(2)), r"routing pins NIC 2 but the group has NICs 0\.\.1"),
    ("pinned negative", write(routing=Pinned(-1)), r"Pinned\.nic must be non-negative"),
    ("pinned bool", write(routing=Pinned(True)), r"Pinned\.nic must be an int, got bool"),
    ("sharded too many", write(routing=Sharded(3)), r"routing shards over 3 NICs but the group has 2"),
    ("sharded zero", write(routing=Sharded(0)), r"Sharded\.nics must be positive"),
    ("sharded float", write(routing=Sharded(1.0)), r"Sharded\.nics must be an int, got float"),
    (
        "shard peers on write",
        write(routing=ShardPeers()),
        r"ShardPeers routes scatters and barriers, not a write",
    ),
    (
        "routing not a routing",
        write(routing="sharded"),
        r"routing must be Sharded, Pinned or ShardPeers, got str",
    ),
    # paged writes
    ("index lengths", paged(dst_pages=[0, 1, 2]), r"src_pages has 2 entries but dst_pages has 3"),
    ("negative src index", paged(src_pages=[0, -1]), r"src_pages holds a negative index \(-1\)"),
    ("negative dst index", paged(dst_pages=np.array([-3, 1])), r"dst_pages holds a negative index \(-3\)"),
    ("duplicate dst", paged(dst_pages=[1, 1]), r"dst_pages names a page twice"),
    ("dst stride < page", paged(dst_stride=4095), r"dst_stride 4095 is below page_length 4096"),
    (
        "2-D src",
        paged(src_pages=np.zeros((2, 1), np.int64)),
        r"src_pages must be one-dimensional, got shape \(2, 1\)",
    ),
    (
        "2-D dst torch",
        paged(dst_pages=torch.zeros(1, 2, dtype=torch.int64)),
        r"dst_pages must be one-dimensional",
    ),
    ("float src", paged(src_pages=np.array([0.0, 1.0])), r"src_pages must hold integers, got dtype float64"),
    ("float dst list", paged(dst_pages=[0.5, 1.5]), r"dst_pages must hold integers, got dtype float64"),
    (
        "float torch",
        paged(src_pages=torch.tensor([0.0, 1.0])),
        r"src_pages must hold integers, got dtype float32",
    ),
    ("bool index", paged(src_pages=[True, False]), r"src_pages must hold integers, got dtype bool"),
    ("scalar index", paged(src_pages=3, dst_pages=3), r"src_pages must be one-dimensional, got shape \(\)"),
    (
        "huge uint64",
        paged(src_pages=np.array([1 << 63, 0], np.uint64)),
        r"src_pages holds an index beyond 2\*\*63",
    ),
    ("empty pages", paged(src_pages=[], dst_pages=[]), r"a paged write needs at least one page"),
    (
        "empty np pages",
        paged(src_pages=np.array([], np.int64), dst_pages=np.array([], np.int64)),
        r"at least one",
    ),
    ("src page oob", paged(src_pages=[0, 16]), r"source page 16: bytes \[65536, 69632\) exceed"),
    ("dst page oob", paged(dst_pages=[0, 16]), r"destination page 16: bytes \[65536, 69632\) exceed"),
    (
        "dst offset oob",
        paged(dst_pages=[0, 15], dst_offset=1),
        r"destination page 15: bytes \[61441, 65537\)",
    ),
    ("negative stride", paged(src_stride=-4096), r"src_stride must be non-negative"),
    ("float page_length", paged(page_length=4096.0), r"page_length must be an int, got float"),
    ("paged imm", paged(imm=-1), r"imm -1 is out of range"),
    ("paged nic mismatch", paged(dst=desc(1, 16 * 4096)), r"dst descriptor has 1 NIC keys"),
    ("paged read-only", paged(dst=desc(2, 16 * 4096, writable=False)), r"read-only"),
    (
        "paged shard peers",
        paged(routing=ShardPeers()),
        r"ShardPeers routes scatters and barriers, not a paged write",
    ),
    ("paged pinned oob", paged(routing=Pinned(5)), r"routing pins NIC 5"),
    # scatter
    ("scatter no targets", ScatterRequest(region(2), []), r"a scatter needs at least one target"),
    ("scatter bad target", ScatterRequest(region(2), [desc(2)]), r"targets\[0\] must be a ScatterTarget"),
    (
        "scatter dst oob",
        ScatterRequest(region(2), [ScatterTarget(desc(2), 1), ScatterTarget(desc(2, 100), 50, 0, 51)]),
        r"targets\[1\] destination: bytes \[51, 101\) exceed the region's 100 bytes",
    ),
    (
        "scatter src oob",
        ScatterRequest(region(2, 100), [ScatterTarget(desc(2), 50, 60)]),
        r"targets\[0\] source: bytes \[60, 110\)",
    ),
    (
        "scatter neg length",
        ScatterRequest(region(2), [ScatterTarget(desc(2), -1)]),
        r"targets\[0\]\.length must be",
    ),
    (
        "scatter float off",
        ScatterRequest(region(2), [ScatterTarget(desc(2), 1, 0, 1.5)]),  # type: ignore[arg-type]
        r"targets\[0\]\.dst_offset must be an int, got float",
    ),
    (
        "scatter nic mismatch",
        ScatterRequest(region(2), [ScatterTarget(desc(2), 1), ScatterTarget(desc(1), 1)]),
        r"targets\[1\]\.dst descriptor has 1 NIC keys",
    ),
    (
        "scatter read-only",
        ScatterRequest(region(2), [ScatterTarget(desc(2, writable=False), 1)]),
        r"targets\[0\]\.dst descriptor names read-only memory",
    ),
    ("scatter imm", ScatterRequest(region(2), [ScatterTarget(desc(2), 1)], imm=1 << 32), r"out of range"),
    (
        "scatter sharded too many",
        ScatterRequest(region(2), [ScatterTarget(desc(2), 1)], routing=Sharded(3)),
        r"routing shards over 3 NICs",
    ),
    # imm and barrier
    ("barrier no dsts", BarrierRequest([], 1), r"a barrier needs at least one destination"),
    ("barrier imm None", BarrierRequest([desc(2)], None), r"imm must be an int"),  # type: ignore[arg-type]
    ("barrier imm -1", BarrierRequest([desc(2)], -1), r"imm -1 is out of range"),
    (
        "barrier read-only",
        BarrierRequest([desc(2), desc(2, writable=False)], 1),
        r"dsts\[1\] descriptor names read-only",
    ),
    ("barrier nic mismatch", BarrierRequest([desc(4)], 1), r"dsts\[0\] descriptor has 4 NIC keys"),
    ("barrier pinned oob", BarrierRequest([desc(2)], 1, Pinned(2)), r"routing pins NIC 2"),
    ("imm 2**32", ImmRequest(desc(2), 1 << 32), r"imm 4294967296 is out of range"),
    ("imm str", ImmRequest(desc(2), "7"), r"imm must be an int .*got str"),  # type: ignore[arg-type]
    ("imm None", ImmRequest(desc(2), None), r"imm must be an int .*got NoneType"),  # type: ignore[arg-type]
    ("imm read-only", ImmRequest(desc(2, writable=False), 1), r"dsts\[0\] descriptor names read-only"),
    ("imm nic mismatch", ImmRequest(desc(1), 1), r"descriptor has 1 NIC keys but this engine's group has 2"),
    ("imm sharded too many", ImmRequest(desc(2), 1, Sharded(3)), r"routing shards over 3 NICs"),
    ("not a request", "write", r"not a fabric request: str"),
]


@pytest.mark.parametrize(
    ("request_", "pattern"), [(r, p) for _, r, p in BAD], ids=[name for name, _, _ in BAD]
)
def test_bad_input(request_: Any, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        plan_request(request_, 2, BIG)
    assert isinstance(info.value, ValueError)


def test_zero_length_write_at_region_end_is_fine() -> None:
    plan = plan_request(write(src_offset=8192, dst_offset=8192, length=0), 2, BIG)
    assert wrs(plan) == [(0, 8192, 8192, 0, 0)]
    with pytest.raises(ConfigError, match=r"source: bytes \[8193, 8193\)"):
        plan_request(write(src_offset=8193, length=0), 2, BIG)


def test_one_page_may_have_any_dst_stride() -> None:
    # dst_stride < page_length only matters with two pages or more (no overlap with one).
    plan = plan_request(paged(src_pages=[0], dst_pages=[0], dst_stride=0), 2, BIG)
    assert wrs(plan) == [(0, 0, 0, 4096, 0)]


def test_numpy_ints_are_accepted_as_lengths() -> None:
    plan = plan_request(write(length=np.int64(100), src_offset=np.int32(4), dst_offset=np.uint16(8)), 2, BIG)
    assert wrs(plan) == [(0, 4, 8, 100, 0)]


HUGE = (1 << 64) - 1  # descriptor lengths are U64: a region may claim up to 2**64 - 1 bytes


@pytest.mark.parametrize("kind", ["write", "paged"])
def test_offsets_beyond_int64_are_refused_not_wrapped(kind: str) -> None:
    src = MemoryRegion(handle=1, ptr=0, length=HUGE, descriptor=desc(2, HUGE))
    req: Any
    if kind == "write":
        req = WriteRequest(src, (1 << 63) - 1, 1 << 62, desc(2, HUGE), (1 << 63) - 1, 1, Sharded())
    else:
        req = PagedWriteRequest(src, [1 << 33], 1 << 30, desc(2, HUGE), [1 << 33], 1 << 30, 4096)
    try:
        plan = plan_request(req, 2, 1 << 62)
    except ConfigError:
        return
    assert (plan.src_off >= 0).all() and (plan.dst_off >= 0).all()
