"""Weight-update metadata and plan without a fabric: sharding geometry against torch, the
plan against a single-process torch reshard, exactly-once coverage (also as a hypothesis
property), balance, routing, determinism and the wire form."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightsworld import (
    apply_plan,
    coverage,
    expected_image,
    full_tensors,
    mixed_fleets,
    param_mask,
    random_bytes,
    random_fleets,
    shard,
    source_buffer,
)

from fabric_apps.weights import (
    DEFAULT_IMM_BASE,
    ExpertPlacement,
    FleetSpec,
    FsdpShard,
    ImmScheme,
    ParamSpec,
    PlanOptions,
    Replicated,
    TensorParallel,
    TransferPlan,
    make_plan,
    tp_column,
    tp_row,
)
from fabric_core import ConfigError

SHARDINGS: list[tuple[str, Any, tuple[int, ...]]] = [
    ("replicated", Replicated(), (5, 3)),
    ("fsdp-even", FsdpShard(), (4, 6)),
    ("fsdp-odd-padded", FsdpShard(), (7, 3)),
    ("fsdp-more-ranks-than-rows", FsdpShard(), (2,)),
    ("hsdp", FsdpShard(replicas=2), (5, 5)),
    ("tp-row", tp_row(), (7, 4)),
    ("tp-column", tp_column(), (4, 7)),
    ("tp-dim2", TensorParallel(2), (2, 3, 5)),
    ("tp-replicas", TensorParallel(1, replicas=2), (3, 8)),
    ("tp-fused", tp_row(sections=(3, 1, 5)), (9, 4)),  # q, k, v: each cut on its own
    ("tp-fused-dim1-replicas", TensorParallel(1, replicas=2, sections=(2, 6)), (3, 8)),
    ("experts", ExpertPlacement(((0, 3), (1,), (2, 0), (3,))), (4, 2, 3)),
]


def _check(plan: TransferPlan, seed: int = 0) -> None:
    """The plan applied with plain copies equals the torch reshard, and every destination byte
    of parameter data is written exactly once, nothing else at all."""
    src, dst = plan.source, plan.destination
    fulls = full_tensors(src, seed)
    srcs = [source_buffer(src, r, fulls) for r in range(src.world_size)]
    before = [random_bytes(dst.layout(d).nbytes, 77 + d) for d in range(dst.world_size)]
    out = [b.clone() for b in before]
    apply_plan(plan, srcs, out)
    for d, hits in enumerate(coverage(plan)):
        mask = param_mask(dst, d)
        assert (hits[mask] == 1).all(), (
            f"destination {d}: a parameter byte is written {hits[mask].max()} times"
        )
        assert (hits[~mask] == 0).all(), f"destination {d}: a gap or padding byte is written"
        want = expected_image(dst, d, fulls, before[d])
        assert torch.equal(out[d], want), f"destination {d} differs from the torch reference"


# --- metadata --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "sharding", "shape"), SHARDINGS, ids=[s[0] for s in SHARDINGS])
def test_runs_say_where_every_local_element_comes_from(
    name: str, sharding: Any, shape: tuple[int, ...]
) -> None:
    world = 4
    p = ParamSpec("w", shape, "int64", sharding)
    FleetSpec(world, (p,))  # validates the sharding
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    for rank in range(world):
        local = shard(full, p, world, rank)
        assert tuple(local.shape) == sharding.local_shape(shape, world, rank)
        flat = local.reshape(-1)
        runs = sharding.runs(shape, world, rank)
        seen = np.zeros(flat.numel(), bool)
        for g, n, off in zip(runs.start.tolist(), runs.length.tolist(), runs.local.tolist(), strict=True):
            assert torch.equal(flat[off : off + n], torch.arange(g, g + n)), f"rank {rank} run at {g}"
            seen[off : off + n] = True
        real = int(seen.sum())
        assert real == runs.elements
        if not isinstance(sharding, FsdpShard):
            assert seen.all()  # only FSDP pieces carry padding
        else:
            assert (flat[real:] == 0).all() and seen[:real].all()


def test_layout_packs_aligned_pieces_and_views_share_the_buffer() -> None:
    spec = FleetSpec(
        2,
        (
            ParamSpec("a", (3, 5), "float32", tp_row()),
            ParamSpec("b", (7,), "bfloat16", FsdpShard()),
            ParamSpec("c", (), "float16"),
        ),
        align=64,
    )
    lay = spec.layout(1)
    assert [(e.name, e.offset, e.nbytes, e.shape) for e in lay.entries] == [
        ("a", 0, 1 * 5 * 4, (1, 5)),
        ("b", 64, 4 * 2, (4,)),
        ("c", 128, 2, ()),
    ]
    assert lay.nbytes == 192 and spec.layout(0)["a"].nbytes == 2 * 5 * 4
    buf = lay.allocate()
    views = lay.views(buf)
    views["b"].fill_(1.5)
    assert views["b"].dtype == torch.bfloat16 and buf[64:72].view(torch.bfloat16).eq(1.5).all()
    assert buf[:64].eq(0).all() and buf[72:].eq(0).all()
    with pytest.raises(ConfigError, match="needs 192"):
        lay.views(torch.zeros(100, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: FleetSpec(0, ()), "world_size"),
        (lambda: FleetSpec(2, (), align=48), "power of two"),
        (lambda: FleetSpec(2, (ParamSpec("a", (2,), "float32"), ParamSpec("a", (3,), "float32"))), "twice"),
        (lambda: ParamSpec("a", (2, -1), "float32"), "shape entry"),
        (lambda: ParamSpec("a", (2,), "float13"), "dtype"),  # type: ignore[arg-type]
        (lambda: ParamSpec("", (2,), "float32"), "name"),
        (lambda: FleetSpec(2, (ParamSpec("a", (4,), "float32", tp_column()),)), "at least 2 dimensions"),
        (lambda: FleetSpec(3, (ParamSpec("a", (4,), "float32", FsdpShard(replicas=2)),)), "divisible"),
        (lambda: FleetSpec(2, (ParamSpec("a", (4, 2), "float32", tp_row(sections=(3, 2))),)), "add up to 5"),
        (lambda: TensorParallel(0, sections=(3, 0)), "sections entry"),
        (lambda: TensorParallel(0, sections="32"), "sequence of ints"),  # type: ignore[arg-type]
        (
            lambda: FleetSpec(2, (ParamSpec("e", (3, 2), "float32", ExpertPlacement(((0,),))),)),
            "lists 1 ranks",
        ),
        (lambda: FleetSpec(1, (ParamSpec("e", (3, 2), "float32", ExpertPlacement(((0, 0),))),)), "twice"),
        (lambda: FleetSpec(1, (ParamSpec("e", (3, 2), "float32", ExpertPlacement(((3,),))),)), "expert 3"),
        (lambda: FleetSpec(1, (ParamSpec("e", (), "float32", ExpertPlacement(((0,),))),)), "scalar"),
    ],
)
def test_bad_metadata_raises_config_error(build: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()


def test_fleet_spec_round_trips_through_json() -> None:
    src, dst = mixed_fleets(4, 3)
    for spec in (src, dst):
        again = FleetSpec.from_json(spec.to_json())
        assert again == spec and again.digest() == spec.digest()
        assert again.layout(2) == spec.layout(2)
    with pytest.raises(ConfigError):
        FleetSpec.from_json('{"world_size": 2}')
    with pytest.raises(ConfigError, match="unknown sharding"):
        FleetSpec.from_json(
            json.dumps(
                {
                    "world_size": 1,
                    "align": 8,
                    "params": [{"name": "a", "shape": [1], "dtype": "float32", "sharding": {"kind": "x"}}],
                }
            )
        )


# --- the plan -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("src_world", "dst_world"), [(1, 1), (2, 2), (2, 3), (4, 2), (3, 5), (4, 4)])
@pytest.mark.parametrize("nics", [1, 2, 3])
def test_plan_reproduces_the_torch_reshard_exactly_once(src_world: int, dst_world: int, nics: int) -> None:
    src, dst = mixed_fleets(src_world, dst_world)
    options = PlanOptions(
        num_nics=nics, split_bytes=64, nic_split_bytes=96, staging_bytes=256, stage_chunk_bytes=48
    )
    plan = make_plan(src, dst, options)
    _check(plan, seed=src_world * 10 + dst_world)
    # every cast row fits a staging chunk, every row a work request
    cast = plan.columns["cast"] >= 0
    assert plan.casts == (("float32", "bfloat16"), ("float32", "float8_e4m3fn"))
    assert int(plan.columns["length"][cast].max()) <= 48
    assert int(plan.columns["length"].max()) <= options.max_write_bytes
    assert set(plan.columns["nic"].tolist()) <= set(range(nics))


def test_plan_is_deterministic() -> None:
    src, dst = mixed_fleets(4, 3)
    options = PlanOptions(num_nics=2, split_bytes=64, nic_split_bytes=64)
    a = make_plan(src, dst, options)
    b = make_plan(FleetSpec.from_json(src.to_json()), FleetSpec.from_json(dst.to_json()), options)
    assert a == b and a.digest() == b.digest() and a.to_bytes() == b.to_bytes()
    assert a.explain() == b.explain()
    other = make_plan(src, dst, PlanOptions(num_nics=2, split_bytes=64, nic_split_bytes=65))
    assert other.digest() != a.digest()


def test_plan_round_trips_through_bytes_and_json() -> None:
    src, dst = mixed_fleets(2, 3)
    plan = make_plan(src, dst, PlanOptions(num_nics=2, staging_bytes=1024, imm_base=0x3A00_0000))
    for again in (TransferPlan.from_bytes(plan.to_bytes()), TransferPlan.from_json(plan.to_json())):
        assert again == plan and again.digest() == plan.digest()
        assert again.options.imm_base == 0x3A00_0000
        assert [again.expected_imms(d) for d in range(3)] == [plan.expected_imms(d) for d in range(3)]
        assert list(again.entries()) == list(plan.entries())
    raw = bytearray(plan.to_bytes())
    raw[-10] ^= 0xFF
    with pytest.raises(ConfigError, match="checksum"):
        TransferPlan.from_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="magic"):
        TransferPlan.from_bytes(b"NOPE" + bytes(raw[4:]))
    with pytest.raises(ConfigError):
        TransferPlan.from_bytes(plan.to_bytes()[:20])
    doc = json.loads(plan.to_json())
    doc["columns"]["dst_offset"][0] = 1 << 40
    with pytest.raises(ConfigError, match="beyond"):
        TransferPlan.from_json(json.dumps(doc))


def test_adjacent_copies_coalesce_into_one_write() -> None:
    params = tuple(ParamSpec(f"p{i}", (4, 8), "float32", tp_row()) for i in range(5))
    spec = FleetSpec(2, params, align=8)
    plan = make_plan(spec, spec)
    # equal sharding on both sides: each rank's whole buffer is one write to its peer
    assert len(plan) == 2
    assert [(e.src_rank, e.dst_rank, e.length) for e in plan.entries()] == [(0, 0, 5 * 64), (1, 1, 5 * 64)]
    assert plan.expected_imms(0) == {0: 1} and plan.expected_imms(1) == {1: 1}
    # a column split at the destination cuts every row of the source's slices: one copy per
    # row unpacked, one packed write per (source, destination, parameter) packed
    cols = FleetSpec(2, tuple(ParamSpec(p.name, p.shape, p.dtype, tp_column()) for p in params))
    unpacked = make_plan(spec, cols, PlanOptions(pack_bytes=0))
    assert len(unpacked) == 2 * 2 * 2 * 5  # 2 sources x 2 destinations x 2 rows each x 5 parameters
    assert unpacked.packed_bytes == 0
    _check(unpacked)
    packed = make_plan(spec, cols)
    assert len(packed) == 2 * 2 * 5
    entries = list(packed.entries())
    # each gathers the source's 2 rows (32 B apart: one row of 8 floats) into 2 x 16 B
    assert {(e.count, e.src_stride, e.length, e.src_length) for e in entries} == {(2, 32, 32, 32)}
    assert all(e.staged for e in entries) and packed.packed_bytes == packed.total_bytes
    assert packed.expected_imms(0) == {0: 5, 1: 5}
    _check(packed)


def test_replicated_bytes_are_spread_over_every_replica() -> None:
    src = FleetSpec(4, (ParamSpec("big", (64, 64), "float32"), ParamSpec("small", (4,), "float32")))
    dst = FleetSpec(1, (ParamSpec("big", (64, 64), "float32"), ParamSpec("small", (4,), "float32")))
    plan = make_plan(src, dst, PlanOptions(split_bytes=4096))
    b = plan.balance()
    # 16 KiB in four equal pieces, one per replica; the tiny tensor goes whole to one of them
    assert sorted(b.bytes_per_source) == [4096, 4096, 4096, 4096 + 16]
    assert b.source_imbalance == pytest.approx((4096 + 16) / ((4 * 4096 + 16) / 4))
    assert sum(plan.expected_imms(0).values()) == 5 and set(plan.expected_imms(0)) == {0, 1, 2, 3}
    _check(plan)
    # below split_bytes a replicated run is not cut: each destination reads one replica,
    # destinations spread over the replicas
    wide = make_plan(src, FleetSpec(4, dst.params), PlanOptions(split_bytes=1 << 20))
    assert wide.balance().bytes_per_source == (16384 + 16,) * 4
    assert wide.balance().source_imbalance == 1.0
    # HSDP: each half lives on two ranks (groups {0, 1} and {2, 3}); whole, the two
    # destinations read different replica groups; cut, all four ranks share the load
    hsdp = FleetSpec(4, (ParamSpec("w", (32, 32), "float32", FsdpShard(replicas=2)),))
    tp = FleetSpec(2, (ParamSpec("w", (32, 32), "float32", tp_row()),))
    whole = make_plan(hsdp, tp)
    assert whole.balance().bytes_per_source == (2048, 0, 0, 2048)
    cut = make_plan(hsdp, tp, PlanOptions(split_bytes=1024))
    assert cut.balance().bytes_per_source == (1024,) * 4 and cut.balance().source_imbalance == 1.0
    _check(whole)
    _check(cut)


def test_large_writes_are_spread_over_every_nic() -> None:
    spec = FleetSpec(1, (ParamSpec("w", (256, 64), "float32"),))
    plan = make_plan(spec, spec, PlanOptions(num_nics=4, nic_split_bytes=4096))
    b = plan.balance()
    assert len(plan) == 4 and b.bytes_per_source_nic == ((16384,) * 4,)
    assert b.source_nic_imbalance == 1.0 and b.destination_nic_imbalance == 1.0
    assert plan.expected_imms(0) == {0: 4}
    # max_write_bytes cuts further; pieces stay whole work requests
    small = make_plan(spec, spec, PlanOptions(num_nics=4, nic_split_bytes=4096, max_write_bytes=5000))
    assert int(small.columns["length"].max()) <= 5000 and small.expected_imms(0) == {0: len(small)}
    assert small.balance().source_nic_imbalance < 1.1
    _check(small)


def test_casts_are_cut_into_whole_elements_of_the_staging_chunk() -> None:
    src = FleetSpec(2, (ParamSpec("w", (10, 9), "float32", FsdpShard()),))
    dst = FleetSpec(1, (ParamSpec("w", (10, 9), "bfloat16"),))
    plan = make_plan(src, dst, PlanOptions(staging_bytes=64, stage_chunk_bytes=10))
    lengths = plan.columns["length"].tolist()
    assert max(lengths) <= 10 and all(n % 2 == 0 for n in lengths)
    assert plan.staged_bytes == plan.total_bytes == 90 * 2
    assert all(e.src_length == 2 * e.length for e in plan.entries())
    _check(plan)


@pytest.mark.parametrize(
    ("dst_param", "match"),
    [
        (ParamSpec("missing", (4,), "float32"), "not among the source"),
        (ParamSpec("w", (4, 2), "float32"), "shape"),
        (ParamSpec("n", (3,), "float32"), "cannot cast int32"),
        (ParamSpec("e", (4, 2), "float32", ExpertPlacement(((3,),))), "no source rank holds"),
    ],
)
def test_plans_that_cannot_be_made_raise_config_error(dst_param: ParamSpec, match: str) -> None:
    src = FleetSpec(
        2,
        (
            ParamSpec("w", (8,), "float32"),
            ParamSpec("n", (3,), "int32"),
            ParamSpec("e", (4, 2), "float32", ExpertPlacement(((0, 1), (2,)))),
        ),
    )
    with pytest.raises(ConfigError, match=match):
        make_plan(src, FleetSpec(1, (dst_param,)))


def test_explain_names_ranks_parameters_casts_and_balance() -> None:
    src, dst = mixed_fleets(4, 2)
    plan = make_plan(src, dst, PlanOptions(num_nics=2))
    text = plan.explain()
    assert f"weights plan {plan.digest()[:12]}: 4 source ranks -> 2 destination ranks, 2 NICs" in text
    assert "float32->bfloat16" in text and "float32->float8_e4m3fn" in text
    assert "balance (max/mean)" in text and f"{plan.balance().source_imbalance:.3f}" in text
    assert "experts" in text and "tp(dim=0) -> tp(dim=1)" in text
    assert f"in {len(plan)} writes" in text
    short = plan.explain(max_rows=1)
    assert "3 more source ranks" in short and f"{len(dst.params) - 1} more parameters" in short
    assert repr(plan).startswith("<TransferPlan 4->2 ranks")


def test_imm_values_are_distinct_per_step_and_source() -> None:
    scheme = ImmScheme(DEFAULT_IMM_BASE, 256)
    assert (scheme.source_bits, scheme.step_bits, scheme.period) == (8, 16, 65536)
    values = {scheme.imm(step, src) for step in range(40) for src in range(256)}
    assert len(values) == 40 * 256
    assert all(0x5700_0000 <= v < 0x5800_0000 for v in values)
    assert scheme.decode(scheme.imm(70000, 13)) == (70000 % 65536, 13)
    assert scheme.imm(5, 3) == scheme.imm(5 + 65536, 3)  # values come back after a period
    assert scheme.decode(0x4B56_0001) is None  # the KV cache's range is not ours
    assert ImmScheme(DEFAULT_IMM_BASE, 1).imm(3, 0) == 0x5700_0000 + (3 << 1)
    for bad in (
        lambda: ImmScheme(0x5700_0001),
        lambda: ImmScheme(1 << 32),
        lambda: ImmScheme(0, 1 << 21),
        lambda: scheme.imm(-1, 0),
        lambda: scheme.imm(0, 256),
    ):
        with pytest.raises(ConfigError):
            bad()


# --- the property ---------------------------------------------------------------------------------------
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_fleets(), st.integers(0, 3))
def test_property_every_destination_byte_is_written_exactly_once(
    fleets: tuple[FleetSpec, FleetSpec, PlanOptions], seed: int
) -> None:
    src, dst, options = fleets
    plan = make_plan(src, dst, options)
    _check(plan, seed)
    total = sum(sum(plan.expected_imms(d).values()) for d in range(dst.world_size))
    assert total == len(plan)  # one imm per write
    assert int(plan.columns["length"].max(initial=0)) <= options.max_write_bytes
    assert TransferPlan.from_bytes(plan.to_bytes()) == plan
