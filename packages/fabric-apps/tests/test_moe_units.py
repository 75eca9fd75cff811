"""Units of the MoE app without a fabric: config, imm layout, endpoint bytes, the combine's
arithmetic and the single-process reference."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import numpy as np
import pytest
import torch
from moeworld import assert_same_dispatch, assert_same_output, bits, expert_fn, random_inputs

from fabric_apps.moe import (
    IMM_TAG,
    MAX_LAYER,
    MoeConfig,
    MoeEndpoint,
    Phase,
    apply_experts,
    decode_imm,
    moe_imm,
    reference_combine,
    reference_dispatch,
    reference_moe,
    weighted_sum,
)
from fabric_apps.moe._routing import local_index_table
from fabric_core import ConfigError
from fabric_core.models import DomainAddress, MemoryRegionDescriptor, NicKey


def _config(**kw: Any) -> MoeConfig:
    base: dict[str, Any] = dict(world_size=4, rank=0, num_experts=8, hidden=16, top_k=2, max_tokens=4)
    base.update(kw)
    return MoeConfig(**base)


# --- config -------------------------------------------------------------------------------------
def test_contiguous_placement_and_sizes() -> None:
    c = MoeConfig(world_size=8, rank=3, num_experts=256, hidden=7168, top_k=8, max_tokens=128)
    assert c.experts_per_rank == 32 and c.local_experts() == tuple(range(96, 128))
    assert c.expert_rank(0) == 0 and c.expert_rank(255) == 7 and c.num_local_experts(5) == 32
    assert torch.equal(c.rank_table(), torch.arange(256) // 32)
    assert c.token_bytes == 14336 and c.meta_bytes == 48 and c.record_bytes == 14384
    assert c.max_pairs == 8 * 128 * 8
    sizes = c.buffer_bytes()
    assert sizes["recv_tokens"] == 8 * 128 * 14384 and sizes["recv_combine"] == 128 * 8 * 14336
    assert c.for_rank(0).fingerprint() == c.fingerprint()
    assert dataclasses.replace(c, hidden=7169).fingerprint() != c.fingerprint()
    assert dataclasses.replace(c, device="meta").fingerprint() == c.fingerprint()


def test_explicit_placement() -> None:
    c = _config(placement=(3, 3, 0, 1, 0, 1, 2, 2))
    assert c.local_experts(0) == (2, 4) and c.local_experts(3) == (0, 1) and c.experts_per_rank == 2
    lonely = _config(placement=(0,) * 8, top_k=3)
    assert lonely.num_local_experts(1) == 0 and lonely.for_rank(1).max_pairs == 0
    assert lonely.for_rank(0).max_pairs == 4 * 4 * 3


def test_the_owner_table_is_the_placement_read_only_and_shared() -> None:
    c = _config(placement=(3, 3, 0, 1, 0, 1, 2, 2))
    table = c.owner_array()
    assert table.dtype == np.int64 and table.tolist() == [3, 3, 0, 1, 0, 1, 2, 2]
    assert table is c.owner_array() and torch.equal(torch.from_numpy(table.copy()), c.rank_table())
    with pytest.raises(ValueError):
        table[0] = 1  # the routing of every step reads it: nobody may change it
    assert c.for_rank(2).owner_array().tolist() == table.tolist()
    assert local_index_table(c, 1).tolist() == [-1, -1, -1, 0, -1, 1, -1, -1]
    assert local_index_table(_config(placement=(0,) * 8, top_k=3), 1).tolist() == [-1] * 8


@pytest.mark.parametrize(
    "bad",
    [
        dict(world_size=0),
        dict(world_size=1025, num_experts=1025),
        dict(rank=4),
        dict(rank=-1),
        dict(num_experts=6),  # contiguous placement needs E % W == 0
        dict(top_k=9),
        dict(hidden=0),
        dict(max_tokens=0),
        dict(dtype=torch.int32),
        dict(placement=(0, 1, 2)),
        dict(placement=(0, 1, 2, 3, 0, 1, 2, 4)),
        dict(rank=True),
    ],
)
def test_bad_config_raises_config_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        _config(**bad)


# --- imms ---------------------------------------------------------------------------------------
def test_imm_layout_round_trips_and_never_collides() -> None:
    seen = set()
    for layer, step, phase, src in itertools.product(
        (0, 1, 2, MAX_LAYER), (0, 1), (Phase.COUNTS, Phase.DISPATCH, Phase.COMBINE), (0, 1, 513, 1023)
    ):
        imm = moe_imm(layer, step, phase, src)
        assert imm >> 24 == IMM_TAG and 0 <= imm < 1 << 32
        assert decode_imm(imm) == (layer, step, phase, src)
        seen.add(imm)
    assert len(seen) == 4 * 2 * 3 * 4
    # steps of one parity share imms: the protocol keeps ranks within one phase of each other
    assert (
        moe_imm(3, 0, Phase.COMBINE, 2) == moe_imm(3, 2, Phase.COMBINE, 2) != moe_imm(3, 1, Phase.COMBINE, 2)
    )
    assert moe_imm(5, 1, Phase.COUNTS, 7) == 0x4D00_0000 | 5 << 13 | 1 << 12 | 0 << 10 | 7
    assert not 0x4B56_0000 <= moe_imm(MAX_LAYER, 1, Phase.COMBINE, 1023) < 0x4B57_0000  # kvcache's range


@pytest.mark.parametrize(
    "args",
    [
        (MAX_LAYER + 1, 0, Phase.COUNTS, 0),
        (0, 0, Phase.COUNTS, 1024),
        (-1, 0, Phase.COUNTS, 0),
        (0, -1, 0, 0),
    ],
)
def test_imm_out_of_range_raises(args: tuple[int, int, Phase, int]) -> None:
    with pytest.raises(ConfigError):
        moe_imm(*args)


@pytest.mark.parametrize("imm", [0, 0x4B56_0001, 0x4D00_0C00, 1 << 32, -1])
def test_foreign_imm_is_not_decoded(imm: int) -> None:
    with pytest.raises(ConfigError):
        decode_imm(imm)


# --- endpoint -----------------------------------------------------------------------------------
def _endpoint() -> MoeEndpoint:
    addr = DomainAddress(raw=b"\x01\x02\x03")

    def desc(ptr: int) -> MemoryRegionDescriptor:
        return MemoryRegionDescriptor(ptr=ptr, length=4096, nics=(NicKey(address=addr, rkey=7),))

    return MoeEndpoint(2, 9, "abcd", 1, 1 << 20, addr, desc(4096), desc(8192), desc(12288))


def test_endpoint_round_trips_through_bytes() -> None:
    ep = _endpoint()
    assert MoeEndpoint.from_bytes(ep.to_bytes()) == ep


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"moe_endpoint": 2}',
        b'{"moe_endpoint": 1, "rank": 0}',
        b'{"moe_endpoint": 1, "rank": "0", "layer": 0, "num_nics": 1, "max_msg_size": 1}',
    ],
)
def test_malformed_endpoint_raises_config_error(data: bytes) -> None:
    with pytest.raises(ConfigError):
        MoeEndpoint.from_bytes(data)


def test_endpoint_with_corrupt_descriptor_raises_config_error() -> None:
    doc = json.loads(_endpoint().to_bytes())
    doc["counts"] = doc["counts"][:20] + ("0" if doc["counts"][20] != "0" else "1") + doc["counts"][21:]
    with pytest.raises(ConfigError, match="corrupted"):
        MoeEndpoint.from_bytes(json.dumps(doc).encode())


# --- the combine's arithmetic -------------------------------------------------------------------
def test_weighted_sum_is_the_slot_by_slot_definition() -> None:
    g = torch.Generator().manual_seed(0)
    t, k, h = 9, 4, 33
    y = torch.randn(t, k, h, generator=g).to(torch.bfloat16)
    w = torch.rand(t, k, generator=g) * 3 - 1
    idx = torch.randint(0, 8, (t, k), generator=g)
    idx[0, :] = -1  # a token routed nowhere sums to zero
    idx[1, 2] = -1
    y[1, 2] = float("nan")  # whatever a skipped slot holds is ignored
    got = weighted_sum(y, w, idx, torch.bfloat16)
    for i in range(t):
        acc = torch.zeros(h, dtype=torch.float32)
        for j in range(k):
            if idx[i, j] >= 0:
                acc = acc + y[i, j].float() * w[i, j]
        assert torch.equal(bits(got[i]), bits(acc.to(torch.bfloat16))), i
    assert torch.equal(got[0], torch.zeros(h, dtype=torch.bfloat16)) and not got.isnan().any()


def test_weighted_sum_in_blocks_with_poisoned_skipped_slots_keeps_every_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token blocks (the scratch bound, made tiny here), skipped slots holding inf, nan and
    a nan weight, and signed zeros: the same bits as the slot-by-slot definition; a float32
    input is left as it was."""
    import fabric_apps.moe._routing as routing

    g = torch.Generator().manual_seed(1)
    t, k, h = 11, 3, 5
    y = torch.randn(t, k, h, generator=g)
    y[2, 1] = -0.0  # a valid -0 product
    w = torch.randn(t, k, generator=g)
    idx = torch.randint(0, 8, (t, k), generator=g)
    idx[3, 0], idx[7, 2], idx[10, :] = -1, -1, -1
    y[3, 0], y[7, 2] = float("inf"), float("nan")
    w[7, 2] = float("nan")
    before = y.clone()
    want = torch.zeros(t, h)
    for i in range(t):
        acc = torch.zeros(h)
        for j in range(k):
            if idx[i, j] >= 0:
                acc = acc + y[i, j] * w[i, j]
        want[i] = acc
    for block in (1, 2 * k * h, 1 << 23):  # one token per block, two, all
        monkeypatch.setattr(routing, "_SUM_BLOCK", block)
        got = weighted_sum(y, w, idx, torch.float32)
        assert torch.equal(bits(got), bits(want)), block
        assert torch.equal(bits(y), bits(before))  # not written through
    assert bool((bits(got[10]) == 0).all())  # +0.0, not -0.0


def test_weighted_sum_order_matters_so_the_definition_is_needed() -> None:
    """Summing the same products in another order changes bits: the sum runs in ascending k,
    which is what makes a bitwise reference possible."""
    y = torch.tensor([[[1.0], [2.0**-24], [2.0**-24]]], dtype=torch.float32)
    w = torch.ones(1, 3)
    idx = torch.zeros(1, 3, dtype=torch.int64)
    forward = weighted_sum(y, w, idx, torch.float32)
    backward = weighted_sum(y.flip(1), w, idx, torch.float32)
    assert forward.item() == 1.0  # ascending k: 1 first, each 2**-24 then rounds away
    assert backward.item() == 1.0 + 2.0**-23  # the small terms first: they add up


# --- the reference ------------------------------------------------------------------------------
def test_reference_dispatch_on_a_hand_example() -> None:
    c = MoeConfig(world_size=2, rank=0, num_experts=4, hidden=2, top_k=2, max_tokens=3)
    xs = [torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0]])]
    xs = [x.to(torch.bfloat16) for x in xs]
    idxs = [torch.tensor([[0, 1], [3, 0]]), torch.tensor([[2, -1]])]
    r0, r1 = reference_dispatch(c, xs, idxs)
    # rank 0 owns experts 0, 1: token 0 of rank 0 twice (experts 0 and 1), token 1 once (expert 0)
    assert r0.experts == (0, 1) and r0.expert_counts.tolist() == [2, 1]
    assert r0.src_rank.tolist() == [0, 0, 0] and r0.src_token.tolist() == [0, 1, 0]
    assert r0.src_k.tolist() == [0, 1, 1] and r0.tokens_per_source.tolist() == [2, 0]
    assert r0.tokens.float().tolist() == [[1, 2], [3, 4], [1, 2]]
    # rank 1 owns experts 2, 3: rank 0's token 1 (expert 3, k=0), rank 1's token 0 (expert 2)
    assert r1.expert_counts.tolist() == [1, 1] and r1.src_rank.tolist() == [1, 0]
    assert r1.src_token.tolist() == [0, 1] and r1.src_k.tolist() == [0, 0]
    assert r1.tokens_per_source.tolist() == [1, 1]
    assert r1.expert_offsets.tolist() == [0, 1, 2] and r1.expert_block(1).float().tolist() == [[3, 4]]


@pytest.mark.parametrize("kind", ["uniform", "masked", "skewed"])
def test_reference_combine_equals_reference_moe(kind: str) -> None:
    """The data path (dispatch, experts per block, combine) and the direct token-by-token
    definition give the same bits."""
    c = MoeConfig(world_size=4, rank=0, num_experts=16, hidden=24, top_k=4, max_tokens=6)
    ins = random_inputs(c, 3, kind=kind)
    results = reference_dispatch(c, ins.xs, ins.idxs)
    outputs = [apply_experts(res, expert_fn) for res in results]
    combined = reference_combine(c, results, outputs, ins.idxs, ins.ws)
    direct = reference_moe(c, ins.xs, ins.idxs, ins.ws, expert_fn)
    for r in range(4):
        assert_same_output(combined[r], direct[r], r)
        assert_same_dispatch(results[r], reference_dispatch(c, ins.xs, ins.idxs)[r], r)


def test_reference_refuses_inputs_that_do_not_fit() -> None:
    c = _config()
    ins = random_inputs(c, 0, [1, 1, 1, 1])
    with pytest.raises(ConfigError):
        reference_dispatch(c, ins.xs[:3], ins.idxs[:3])
    bad = [i.clone() for i in ins.idxs]
    bad[2][0, 0] = 8
    with pytest.raises(ConfigError):
        reference_moe(c, ins.xs, bad, ins.ws, expert_fn)
