"""Splitting, routing and chaining arithmetic of the verbs backend, against the arithmetic
every backend shares (``fabric_core.plan_request``; fabric-efa's fast path plans the same).

The verbs engine plans with ``max_wr_bytes(port max_msg_sz, cap)`` as its max message size;
the Domain then posts each send queue's work requests as chains with selective signalling
(``build_chains`` is that policy, in the compiled module). The properties:
- no work request above the port's max_msg_sz nor 2**31 bytes (an SGE length is 32 bits: no
  silent truncation of a shard above 4 GiB), and the bytes of every request exactly covered;
- the imm on every work request of a request that has one, counted per target as the plan
  says, and on none otherwise;
- each work request on the NIC the routing names (Pinned(i) is NIC i, not NIC 0);
- every work request posted once, in order within its send queue, in chains of at most
  chain_max on one queue, the last of each chain signalled, never signal_every unsignalled in
  a row.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from fabric_core.models import DomainAddress, MemoryRegion, MemoryRegionDescriptor, NicKey
from fabric_core.ops import (
    BarrierRequest,
    ImmRequest,
    PagedWriteRequest,
    Pinned,
    Plan,
    Request,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
    plan_request,
)
from fabric_verbs import _verbs

GiB = 1 << 30
SGE = 1 << 31
# max_msg_sz as ports report it: ConnectX (1 GiB), Soft-RoCE (8 MiB), larger than an SGE can
# carry (a driver reporting 4 GiB or more), unreported (0), and small ones that cut a lot
PORT_LIMITS = [GiB, 8 << 20, 1 << 32, 1 << 33, 0, 4096, 65536, 1_000_000]
REGION = 1 << 40  # descriptors are only checked, never touched: sizes above 4 GiB are free


def _descriptor(nics: int, peer: int, length: int = REGION) -> MemoryRegionDescriptor:
    return MemoryRegionDescriptor(
        ptr=1 << 44,
        length=length,
        nics=tuple(
            NicKey(address=DomainAddress(raw=bytes([peer, n]) * 20), rkey=77 + n) for n in range(nics)
        ),
    )


def _source(nics: int) -> MemoryRegion:
    desc = _descriptor(nics, 0)
    return MemoryRegion(handle=1, ptr=desc.ptr, length=desc.length, descriptor=desc)


def test_max_wr_bytes_is_the_least_of_port_sge_and_cap() -> None:
    assert _verbs.MAX_SGE_BYTES == SGE
    assert _verbs.max_wr_bytes(GiB, 0) == GiB  # ConnectX-7
    assert _verbs.max_wr_bytes(1 << 32, 0) == SGE  # a 4 GiB port limit still fits no SGE
    assert _verbs.max_wr_bytes(0, 0) == SGE  # unreported: the SGE limit
    assert _verbs.max_wr_bytes(GiB, 10_000) == 10_000
    assert _verbs.max_wr_bytes(8 << 20, GiB) == 8 << 20


@given(st.integers(0, 1 << 63), st.integers(0, 1 << 63))
def test_max_wr_bytes_never_exceeds_any_limit(port: int, cap: int) -> None:
    m = _verbs.max_wr_bytes(port, cap)
    assert 0 < m <= SGE or (cap == 0 and port == 0 and m == SGE)
    assert m == min(x for x in (port, SGE, cap) if x > 0)


def routings(nics: int) -> st.SearchStrategy[Sharded | Pinned]:
    return st.one_of(
        st.builds(Sharded, st.one_of(st.none(), st.integers(1, nics))),
        st.builds(Pinned, st.integers(0, nics - 1)),
    )


imms = st.one_of(st.none(), st.integers(0, (1 << 32) - 1))
lengths = st.one_of(
    st.integers(0, 1 << 20),
    st.integers(0, 20 * GiB),
    st.sampled_from([0, 1, 4095, 4096, SGE - 1, SGE, SGE + 1, 1 << 32, (1 << 32) + 1, 10 * GiB + 3]),
)


@st.composite
def requests(draw: st.DrawFn, nics: int) -> Request:
    src = _source(nics)
    kind = draw(st.sampled_from(["write", "paged", "scatter", "imm", "barrier"]))
    imm = draw(imms)
    routing = draw(routings(nics))
    if kind == "write":
        length = draw(lengths)
        return WriteRequest(
            src, draw(st.integers(0, 1 << 20)), length, _descriptor(nics, 1), 4096, imm, routing
        )
    if kind == "paged":
        pages = draw(st.integers(1, 12))
        page = draw(st.one_of(st.integers(0, 1 << 16), st.sampled_from([GiB, 3 * GiB, 5 * GiB])))
        stride = page + draw(st.integers(0, 4096))
        src_pages = draw(st.permutations(range(pages)))
        dst_pages = draw(st.permutations(range(2 * pages)))[:pages]
        return PagedWriteRequest(
            src,
            np.array(src_pages),
            stride,
            _descriptor(nics, 1),
            np.array(dst_pages),
            stride,
            page,
            0,
            0,
            imm,
            routing,
        )
    if kind == "scatter":
        count = draw(st.integers(1, 5))
        targets = tuple(
            ScatterTarget(
                _descriptor(nics, 1 + i),
                length=draw(lengths),
                src_offset=draw(st.integers(0, 4096)),
                dst_offset=draw(st.integers(0, 4096)),
            )
            for i in range(count)
        )
        scatter_routing = draw(st.one_of(st.just(ShardPeers()), st.just(routing)))
        return ScatterRequest(src, targets, imm, scatter_routing, None)
    peers = draw(st.integers(1, 5))
    if kind == "imm":
        return ImmRequest(_descriptor(nics, 1), imm if imm is not None else 1, routing)
    return BarrierRequest(
        tuple(_descriptor(nics, 1 + i) for i in range(peers)),
        imm if imm is not None else 1,
        draw(st.one_of(st.just(ShardPeers()), st.just(routing))),
    )


def _wanted(request: Request) -> dict[int, list[tuple[int, int, int]]]:
    """Per target: the (dst offset, src offset, length) spans the request asks for."""
    if isinstance(request, WriteRequest):
        return {0: [(request.dst_offset, request.src_offset, request.length)]}
    if isinstance(request, PagedWriteRequest):
        return {
            0: [
                (
                    request.dst_offset + int(d) * request.dst_stride,
                    request.src_offset + int(s) * request.src_stride,
                    request.page_length,
                )
                for s, d in zip(request.src_pages, request.dst_pages, strict=True)
            ]
        }
    if isinstance(request, ScatterRequest):
        return {i: [(t.dst_offset, t.src_offset, t.length)] for i, t in enumerate(request.targets)}
    return {}


def _check_plan(request: Request, plan: Plan, nics: int, port: int, max_msg: int) -> None:
    lengths = plan.length
    assert lengths.max(initial=0) <= max_msg <= SGE
    if port:
        assert lengths.max(initial=0) <= port
    assert ((plan.nic >= 0) & (plan.nic < nics)).all()
    routing = getattr(request, "routing", None)
    if isinstance(routing, Pinned):
        assert (plan.nic == routing.nic).all(), "a pinned request posted on another NIC"
    if isinstance(routing, Sharded) and not isinstance(request, (ScatterRequest, BarrierRequest)):
        assert len(set(plan.nic.tolist())) <= (routing.nics or nics)
    # the imm: on every WR of the request when it has one, counted per target as planned
    counts = np.bincount(plan.target, minlength=len(plan.targets))
    imm = getattr(request, "imm", None)
    assert plan.imm == imm
    assert plan.imms_per_target == (
        tuple(int(c) for c in counts) if imm is not None else (0,) * len(plan.targets)
    )
    # every byte asked for exactly once (pieces tile each span, in place)
    for target, spans in _wanted(request).items():
        rows = np.flatnonzero(plan.target == target)
        got = sorted(
            zip(
                plan.dst_off[rows].tolist(),
                plan.src_off[rows].tolist(),
                plan.length[rows].tolist(),
                strict=True,
            )
        )
        for dst, src, length in sorted(spans):
            end = dst + length
            while True:
                assert got, f"bytes [{dst}, {end}) of target {target} not covered"
                d, s, n = got.pop(0)
                assert (d, s) == (dst, src), "a piece out of place"
                dst, src = dst + n, src + n
                if dst >= end and (length == 0 or n > 0):
                    break
            assert dst == end
        assert not got, "bytes written that were not asked for"


def _check_chains(plan: Plan, max_msg: int, chain_max: int, signal_every: int) -> None:
    index, chain, signaled = _verbs.build_chains(
        plan.nic, plan.target, plan.length, max_msg, chain_max, signal_every
    )
    assert sorted(index.tolist()) == list(range(plan.num_wrs)), "every WR posted exactly once"
    by_chain: dict[int, list[int]] = defaultdict(list)
    for i, c in zip(index.tolist(), chain.tolist(), strict=True):
        by_chain[c].append(i)
    for members in by_chain.values():
        queues = {(int(plan.nic[i]), int(plan.target[i])) for i in members}
        assert len(queues) == 1, "a chain spans two send queues"
        assert len(members) <= chain_max
    last_of_chain = {members[-1] for members in by_chain.values()}
    per_queue: dict[tuple[int, int], list[tuple[int, bool]]] = defaultdict(list)
    for i, s in zip(index.tolist(), signaled.tolist(), strict=True):
        assert s or i not in last_of_chain, "a chain ends unsignalled"
        per_queue[(int(plan.nic[i]), int(plan.target[i]))].append((i, bool(s)))
    for posts in per_queue.values():
        order = [i for i, _ in posts]
        assert order == sorted(order), "a send queue's WRs reordered"
        run = 0
        for _, s in posts:
            run = 0 if s else run + 1
            assert run < signal_every
        assert posts[-1][1], "a send queue left with an unsignalled tail"


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 4).flatmap(lambda n: st.tuples(st.just(n), requests(n))),
    st.sampled_from(PORT_LIMITS),
    st.one_of(st.just(0), st.just(0), st.integers(64, 1 << 34)),
    st.integers(0, 7),
    st.integers(1, 64),
    st.integers(1, 40),
)
def test_plans_split_at_the_port_and_sge_limits_and_chains_post_them_all(
    case: tuple[int, Request], port: int, cap: int, rotation: int, chain_max: int, signal_every: int
) -> None:
    nics, request = case
    max_msg = _verbs.max_wr_bytes(port, cap)
    spans = [n for target in _wanted(request).values() for _, _, n in target]
    assume(sum(-(-n // max_msg) for n in spans) <= 4096)  # a plan this test can walk quickly
    plan = plan_request(request, nics, max_msg, rotation)
    event(type(request).__name__)
    if plan.length.max(initial=0) > GiB:
        event("a work request above 1 GiB")
    if int(plan.length.sum()) > 1 << 32:
        event("a request above 4 GiB")
    _check_plan(request, plan, nics, port, max_msg)
    _check_chains(plan, max_msg, chain_max, signal_every)


def test_a_10_gib_write_pinned_to_nic_2_is_five_2_gib_wrs_on_nic_2() -> None:
    """The reference system truncated this shard to a u32 and posted it on NIC 0."""
    nics = 4
    req = WriteRequest(_source(nics), 0, 10 * GiB, _descriptor(nics, 1), 0, 5, Pinned(2))
    plan = plan_request(req, nics, _verbs.max_wr_bytes(1 << 32, 0))
    assert plan.nic.tolist() == [2] * 5
    assert plan.length.tolist() == [SGE] * 5
    assert plan.dst_off.tolist() == [i * SGE for i in range(5)]
    assert plan.imms_per_target == (5,)


def test_a_work_request_above_the_limit_is_refused_not_truncated() -> None:
    nic = np.zeros(2, np.int64)
    length = np.array([SGE, SGE + 1], np.int64)
    with pytest.raises(ValueError, match="would be truncated"):
        _verbs.build_chains(nic, nic, length, 1 << 40, 16, 16)
    with pytest.raises(ValueError, match="exceeds the limit of 4096"):
        _verbs.build_chains(nic, nic, np.array([4096, 4097], np.int64), 4096, 16, 16)


def test_chains_follow_the_send_queues() -> None:
    # 40 WRs alternating between two queues, chains of 16, one signal in 8
    nic = np.array([0, 1] * 20, np.int64)
    target = np.zeros(40, np.int64)
    index, chain, signaled = _verbs.build_chains(nic, target, np.full(40, 100, np.int64), 1 << 20, 16, 8)
    got: dict[int, list[Any]] = defaultdict(list)
    for i, c, s in zip(index.tolist(), chain.tolist(), signaled.tolist(), strict=True):
        got[c].append((int(nic[i]), s))
    sizes = sorted(len(v) for v in got.values())
    assert sizes == [4, 4, 16, 16]  # 20 per queue: a full chain of 16 and a tail of 4
    assert int(signaled.sum()) == 2 * (2 + 1)  # per queue: 2 in the full chain (8th, 16th), the tail's last
