"""The compiled submit path plans exactly as ``fabric_core.plan_request`` does.

``plan_request`` is the specification. For random requests, valid and not, the compiled
planner either defers (None: the Python path then plans or raises) or returns the very
work requests ``plan_request`` makes; it never accepts a request that ``plan_request``
rejects, and it accepts every plain valid one (else the fast path would never run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fabric_core import open_engine
from fabric_core.errors import ConfigError, EngineClosed
from fabric_core.models import MemoryRegion, MemoryRegionDescriptor
from fabric_core.ops import (
    ImmRequest,
    PagedWriteRequest,
    PeerGroup,
    Pinned,
    Request,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
    plan_request,
)
from fabric_core.transfer import FRESH_FIELDS, Transfer, new_transfer

os.environ.setdefault("FI_TCP_IFACE", "lo")

MAX_MSG = 10_000  # small, so that pieces are cut
REGION = 1 << 20


@dataclass
class Setup:
    engine: Any  # fabric_efa.engine.EfaEngine (imported by no test module: see test_backend)
    nics: int
    src: MemoryRegion
    dst: MemoryRegionDescriptor
    foreign: MemoryRegion  # another engine's region
    read_only: MemoryRegionDescriptor
    other_nics: MemoryRegionDescriptor  # a descriptor with another NIC count
    with_dst: PeerGroup  # a peer group holding dst's engine
    without_dst: PeerGroup  # one that does not


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"nics{n}")
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    n = request.param
    engines = [
        open_engine("efa", efa_provider="shm", nics=n, max_msg_size=MAX_MSG),
        open_engine("efa", efa_provider="shm", nics=n, max_msg_size=MAX_MSG),
        open_engine("efa", efa_provider="shm", nics=1 if n > 1 else 2),
    ]
    a, b, c = engines
    buffers = [np.zeros(REGION, np.uint8) for _ in range(4)]
    yield Setup(
        engine=a,
        nics=n,
        src=a.register(buffers[0]),
        dst=b.register(buffers[1]).descriptor,
        foreign=b.register(buffers[2]),
        read_only=b.register(buffers[3], writable=False).descriptor,
        other_nics=c.register(np.zeros(64, np.uint8)).descriptor,
        with_dst=a.peer_group([b.address, a.address]),
        without_dst=a.peer_group([a.address]),
    )
    for e in engines:
        e.close()


def _pick_src(s: Setup, which: int) -> Any:
    return [s.src, s.foreign, "region"][which]


def _pick_dst(s: Setup, which: int) -> Any:
    return [s.dst, s.read_only, s.other_nics, None][which]


def _compare(s: Setup, request: Request, kind: str, args: tuple[object, ...], rotation: int) -> bool:
    """Asserts the compiled plan agrees with plan_request; returns whether it accepted."""
    fast = s.engine._core.plan_only(kind, args, rotation)
    try:
        plan = plan_request(request, s.nics, MAX_MSG, rotation)
    except ConfigError:
        assert fast is None, f"the fast path accepted what plan_request rejects: {request}"
        event("rejected by both")
        return False
    event("deferred to plan_request" if fast is None else "planned in C++")
    if fast is None:
        return False
    nic, target, src, dst, length = fast
    base = s.src.ptr if kind != "imm" else 0
    np.testing.assert_array_equal(nic, plan.nic)
    np.testing.assert_array_equal(target, plan.target)
    np.testing.assert_array_equal(src - base, plan.src_off)
    np.testing.assert_array_equal(dst, plan.dst_off)
    np.testing.assert_array_equal(length, plan.length)
    targets = len(plan.targets)
    want = np.bincount(target, minlength=targets) if request.imm is not None else [0] * targets  # type: ignore[union-attr]
    assert plan.imms_per_target == tuple(int(c) for c in want)
    return True


# Each example is a plain request with at most one field spoiled: a value the fast path must
# leave to plan_request (valid there or not).
SPOILED = {
    "src": st.sampled_from([1, 2]),  # indices into _pick_src
    "dst": st.sampled_from([1, 2, 3]),  # indices into _pick_dst
    "int": st.one_of(
        st.integers(-5, -1),
        st.sampled_from([REGION, REGION + 1, 1 << 63, True, 1.0]),
        st.builds(np.int64, st.integers(0, 50_000)),
    ),
    "imm": st.sampled_from([1 << 32, -1, False, np.uint32(3), 2.0]),
    "routing": st.sampled_from([Sharded(0), Sharded(9), Pinned(9), Pinned(-1), ShardPeers(), "nic0"]),
}
imms = st.one_of(st.none(), st.integers(0, (1 << 32) - 1))


def routings(nics: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(Sharded()),
        st.builds(Sharded, st.integers(1, nics)),
        st.builds(Pinned, st.integers(0, nics - 1)),
    )


def _spoil(data: st.DataObject, fields: dict[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """``fields`` with one of them (or none) replaced by a spoiled value of its kind."""
    if data.draw(st.booleans(), label="spoil"):
        which = data.draw(st.sampled_from(list(fields)), label="spoiled field")
        fields = {**fields, which: data.draw(SPOILED[kinds[which]], label=which)}
    return fields


SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(data=st.data(), rotation=st.integers(0, 7))
def test_write_plans_agree(setup: Setup, data: st.DataObject, rotation: int) -> None:
    small = st.integers(0, 50_000)
    f = _spoil(
        data,
        {
            "src": 0,
            "src_off": data.draw(small),
            "length": data.draw(st.integers(0, 40_000)),
            "dst": 0,
            "dst_off": data.draw(small),
            "imm": data.draw(imms),
            "routing": data.draw(routings(setup.nics)),
        },
        {"src": "src", "src_off": "int", "length": "int", "dst": "dst", "dst_off": "int", "imm": "imm"}
        | {"routing": "routing"},
    )
    args = (
        _pick_src(setup, f["src"]),
        f["src_off"],
        f["length"],
        _pick_dst(setup, f["dst"]),
        f["dst_off"],
        f["imm"],
        f["routing"],
    )
    request = WriteRequest(*args)
    plain = all(type(f[k]) is int for k in ("src_off", "length", "dst_off", "src", "dst"))
    plain = plain and f["src"] == f["dst"] == 0 and (f["imm"] is None or type(f["imm"]) is int)
    if not _compare(setup, request, "write", args, rotation) and plain:
        # plain input the fast path declined: plan_request must reject it too
        with pytest.raises(ConfigError):
            plan_request(request, setup.nics, MAX_MSG, rotation)


@SETTINGS
@given(data=st.data(), rotation=st.integers(0, 7))
def test_paged_plans_agree(setup: Setup, data: st.DataObject, rotation: int) -> None:
    count = data.draw(st.integers(1, 40))
    src_pages = data.draw(st.lists(st.integers(0, 40), min_size=count, max_size=count))
    dst_pages = data.draw(
        st.one_of(
            st.permutations(range(count)),
            st.lists(st.integers(0, 40), min_size=count, max_size=count),  # may repeat a page
            st.just([-1] * count),
        )
    )
    f = _spoil(
        data,
        {
            "src": 0,
            "src_stride": data.draw(st.sampled_from([4096, 4096, 0, 512, 16_000])),
            "dst": 0,
            "dst_stride": data.draw(st.sampled_from([4096, 4096, 512, 1500, 16_000])),
            "page_length": data.draw(st.sampled_from([4096, 4096, 0, 1, 512, 12_000])),
            "src_off": data.draw(st.sampled_from([0, 0, 3, 70_000])),
            "dst_off": data.draw(st.sampled_from([0, 5])),
            "imm": data.draw(imms),
            "routing": data.draw(routings(setup.nics)),
        },
        {"src": "src", "dst": "dst", "imm": "imm", "routing": "routing"}
        | {k: "int" for k in ("src_stride", "dst_stride", "page_length", "src_off", "dst_off")},
    )
    sp, dp = np.array(src_pages, np.int64), np.array(dst_pages, np.int64)
    args = (
        _pick_src(setup, f["src"]),
        sp,
        f["src_stride"],
        _pick_dst(setup, f["dst"]),
        dp,
        f["dst_stride"],
        f["page_length"],
        f["src_off"],
        f["dst_off"],
        f["imm"],
        f["routing"],
    )
    _compare(setup, PagedWriteRequest(*args), "paged", args, rotation)


@SETTINGS
@given(data=st.data(), rotation=st.integers(0, 7))
def test_imm_plans_agree(setup: Setup, data: st.DataObject, rotation: int) -> None:
    routing = data.draw(st.one_of(routings(setup.nics), st.just(ShardPeers())))
    f = _spoil(
        data,
        {"dst": 0, "imm": data.draw(st.integers(0, (1 << 32) - 1)), "routing": routing},
        {"dst": "dst", "imm": "imm", "routing": "routing"},
    )
    args = (_pick_dst(setup, f["dst"]), f["imm"], f["routing"])
    _compare(setup, ImmRequest(*args), "imm", args, rotation)


@SETTINGS
@given(data=st.data(), rotation=st.integers(0, 7))
def test_scatter_plans_agree(setup: Setup, data: st.DataObject, rotation: int) -> None:
    count = data.draw(st.integers(1, 4))
    targets = [
        ScatterTarget(
            _pick_dst(setup, data.draw(st.sampled_from([0] * 12 + [1, 2]))),
            data.draw(st.integers(0, 30_000)),
            data.draw(st.sampled_from([0, 100, 70_000])),
            data.draw(st.sampled_from([0, 5, 40_000])),
        )
        for _ in range(count)
    ]
    if data.draw(st.integers(0, 3), label="spoil a target") == 0:
        j = data.draw(st.integers(0, count - 1))
        bad = data.draw(SPOILED["int"])
        field = data.draw(st.sampled_from(["length", "src_offset", "dst_offset"]))
        t = targets[j]
        targets[j] = ScatterTarget(**{"dst": t.dst, "length": t.length, "src_offset": t.src_offset,
                                      "dst_offset": t.dst_offset, field: bad})  # fmt: skip
    routing = data.draw(st.one_of(routings(setup.nics), st.just(ShardPeers())))
    f = _spoil(
        data,
        {"src": 0, "imm": data.draw(imms), "routing": routing},
        {"src": "src", "imm": "imm", "routing": "routing"},
    )
    group = data.draw(st.sampled_from([None, None, setup.with_dst, setup.with_dst, setup.without_dst]))
    shape = data.draw(st.sampled_from([tuple, list]))
    members = None if group is None else group._members
    args = (_pick_src(setup, f["src"]), shape(targets), f["imm"], f["routing"], members)
    request = ScatterRequest(args[0], tuple(targets), f["imm"], f["routing"], group)
    _compare(setup, request, "scatter", args, rotation)


def test_plain_requests_take_the_fast_path(setup: Setup) -> None:
    """The common requests are planned in C++: the engine counts them as fast submissions."""
    e = setup.engine
    before = e._core.fast_submitted()
    transfers = [
        e.submit_write(setup.src, 0, 4096, setup.dst, 0, imm=1),
        e.submit(WriteRequest(setup.src, 0, 100, setup.dst, 64)),
        e.submit_paged_write(setup.src, [0, 1], 4096, setup.dst, [3, 2], 4096, 4096, imm=1),
        e.submit_imm(setup.dst, 1),
        e.submit_scatter(
            setup.src, [ScatterTarget(setup.dst, 64), ScatterTarget(setup.dst, 8, 64, 64)], imm=1
        ),
        e.submit_scatter(
            setup.src, [ScatterTarget(setup.dst, 30_000)], routing=Sharded(), group=setup.with_dst
        ),
    ]
    for t in transfers:
        t.wait(10)
    assert e._core.fast_submitted() - before == len(transfers)
    assert transfers[0].imms_at_target == min(setup.nics, 1)  # 4 KiB: one shard
    assert transfers[2].imms_at_target == 2
    assert transfers[4].imms_per_target == (1, 1) and transfers[5].imms_per_target == (0,)


def test_rejected_requests_raise_the_python_errors(setup: Setup) -> None:
    e = setup.engine
    with pytest.raises(ConfigError, match="exceed the region"):
        e.submit_write(setup.src, REGION, 1, setup.dst)
    with pytest.raises(ConfigError, match="not registered with this engine"):
        e.submit_write(setup.foreign, 0, 1, setup.dst)
    with pytest.raises(ConfigError, match="read-only"):
        e.submit_imm(setup.read_only, 1)
    with pytest.raises(ConfigError, match="names a page twice"):
        e.submit_paged_write(setup.src, [0, 1], 16, setup.dst, [4, 4], 16, 16)
    with pytest.raises(ConfigError, match="must be one-dimensional"):
        e.submit_paged_write(setup.src, [[0]], 16, setup.dst, [4], 16, 16)
    with pytest.raises(ConfigError, match="not a member of the peer group"):
        e.submit_scatter(setup.src, [ScatterTarget(setup.dst, 8)], group=setup.without_dst)
    with pytest.raises(ConfigError, match="at least one target"):
        e.submit_scatter(setup.src, [])


def test_deregistered_region_leaves_the_fast_path() -> None:
    e = open_engine("efa", efa_provider="shm")
    try:
        mr = e.register(np.zeros(64, np.uint8))
        desc = mr.descriptor
        e.submit_write(mr, 0, 8, desc, 8).wait(10)
        e.deregister(mr)
        with pytest.raises(ConfigError, match="not registered"):
            e.submit_write(mr, 0, 8, desc, 8)
    finally:
        e.close()
    with pytest.raises(EngineClosed):
        e.submit_write(mr, 0, 8, desc, 8)


def test_fast_path_transfers_are_made_as_the_constructor_makes_them(setup: Setup) -> None:
    """The transfers the C++ fast path makes (copies of a prototype, fabric/pyfast.hpp) have
    every field a ``new_transfer`` with the engine's hooks has: the shared ones the very same
    objects, the fresh ones new objects of their own, ids from the one sequence."""
    e = setup.engine
    made = [
        e.submit_write(setup.src, 0, 64, setup.dst, 0, imm=1),
        e.submit_paged_write(setup.src, [0, 1], 64, setup.dst, [3, 2], 64, 64, imm=1),
        e.submit_imm(setup.dst, 1),
        e.submit_scatter(setup.src, [ScatterTarget(setup.dst, 64)], imm=1),
    ]
    between = Transfer((0,))  # the Python constructor, between fast-path transfers
    made.append(e.submit_write(setup.src, 0, 64, setup.dst, 0))
    reference = new_transfer((0,), e._dispatch, e._timeout, e._drain_hook, e._cancel_hook)
    for t in made:
        t.wait(10)
        assert type(t) is Transfer and t.done() and t.exception() is None
        assert t.id not in e._inflight  # completed through the in-flight table
        for name in Transfer.__slots__:
            if name in ("id", "imms_per_target", "_done", "_event"):
                continue
            mine, theirs = getattr(t, name), getattr(reference, name)
            if name in FRESH_FIELDS:
                assert type(mine) is type(theirs) and mine is not theirs, name
            else:
                assert mine is theirs or mine == theirs, name
    ids = [t.id for t in made]
    assert ids[:4] == sorted(ids[:4]) and ids[3] < between.id < ids[4]
    assert len({id(t._lock) for t in made}) == len(made)
    assert [t.imms_per_target for t in made] == [(min(setup.nics, 1),), (2,), (1,), (1,), (0,)]


def test_the_transfer_maker_refuses_types_it_cannot_copy(setup: Setup) -> None:
    """configure_transfers checks the prototype's type: a plain __slots__ class whose every
    slot is fresh, imms_per_target or set in the prototype. A refused one changes nothing."""
    e = setup.engine
    core, inflight = e._core, e._inflight

    class WithDict:
        def __init__(self) -> None:
            self.id = 0

    class Slots:
        __slots__ = ("id", "imms_per_target", "other")

    unset = Slots()
    unset.id, unset.imms_per_target = 0, (0,)
    with pytest.raises(ValueError, match="__slots__ class"):
        core.configure_transfers(WithDict(), {"id": int}, inflight)
    with pytest.raises(AttributeError):
        core.configure_transfers(unset, {"id": int}, inflight)  # ``other`` not set
    unset.other = None
    with pytest.raises(ValueError, match="every fresh field one"):
        core.configure_transfers(unset, {"id": int, "missing": list}, inflight)
    e.submit_imm(setup.dst, 1).wait(10)  # the engine's own maker is still in place


def test_the_fastcall_entry_points_check_their_arguments(setup: Setup) -> None:
    """fast_write and fast_imm are plain CPython methods (pyengine.hpp, FastCalls): positional
    arguments only, the count and the timeout's type checked, nothing submitted on an error."""
    e = setup.engine
    core = e._core
    before = core.fast_submitted()
    with pytest.raises(TypeError, match=r"fast_write\(\) takes 8 positional arguments \(7 given\)"):
        core.fast_write(setup.src, 0, 8, setup.dst, 0, None, Sharded())
    with pytest.raises(TypeError, match=r"fast_imm\(\) takes 4 positional arguments \(5 given\)"):
        core.fast_imm(setup.dst, 1, ShardPeers(), -1.0, None)
    with pytest.raises(TypeError):
        core.fast_imm(setup.dst, 1, ShardPeers(), "soon")
    with pytest.raises(TypeError):
        core.fast_imm(dst=setup.dst, imm=1, routing=ShardPeers(), timeout_s=-1.0)
    assert core.fast_submitted() == before
    assert core.fast_imm(setup.dst, -1, ShardPeers(), -1.0) is None  # invalid: the Python path's
    t = core.fast_imm(setup.dst, 1, ShardPeers(), -1.0)
    assert type(t) is Transfer and t.imms_per_target == (1,)
    t.wait(10)
    assert core.fast_submitted() == before + 1
