"""KV-cache building blocks without a fabric: layouts, the page allocator, the imm pool, the wire."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvworld import make_caches

from fabric_apps.kvcache import (
    ImmPool,
    ImmsExhausted,
    KvLayout,
    PageAllocator,
    PageLeak,
    PagesExhausted,
    PageStateError,
    deepseek_v3,
    llama31_70b,
    write_units,
)
from fabric_apps.kvcache import protocol as wire
from fabric_core import ConfigError

SMALL = {
    "num_layers": 2,
    "num_blocks": 6,
    "block_size": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
}


# --- layouts -----------------------------------------------------------------------------------
def test_presets_have_the_published_geometry() -> None:
    llama = llama31_70b(num_blocks=2)
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.block_size) == (80, 8, 128, 16)
    assert llama.page_bytes == 16 * 8 * 128 * 2 == 32768 and llama.page_stride == 32768
    assert [(s.name, s.tensor, s.offset, s.stride) for s in llama.segments] == [
        ("k", 0, 0, 32768),
        ("v", 0, 2 * 32768, 32768),
    ]
    ds = deepseek_v3(num_blocks=2)
    assert (ds.num_layers, ds.head_dim, ds.block_size, ds.kv_split) == (61, 576, 64, "latent")
    assert ds.page_bytes == 64 * 576 * 2 == 73728
    assert [(s.name, s.offset, s.stride) for s in ds.segments] == [("latent", 0, 73728)]
    assert llama31_70b(4, kv_split="separate").segments[1].tensor == 1


def test_presets_accept_real_torch_caches() -> None:
    llama = llama31_70b(num_blocks=2)
    kv = [torch.zeros(2, 2, 16, 8, 128, dtype=torch.bfloat16) for _ in range(80)]
    assert len(llama.check(kv)) == 80
    ds = deepseek_v3(num_blocks=2)
    sglang_mla = [torch.zeros(2 * 64, 1, 576, dtype=torch.bfloat16) for _ in range(61)]
    assert ds.check(sglang_mla)[60][0] is sglang_mla[60]
    one_tensor = torch.zeros(80, 2, 2, 16, 8, 128, dtype=torch.bfloat16)  # all layers in one
    assert llama.check(one_tensor)[3][0].data_ptr() == one_tensor[3].data_ptr()


@pytest.mark.parametrize(
    ("split", "offsets", "strides", "nbytes"),
    [
        ("stacked", [0, 6 * 128], [128, 128], 2 * 6 * 128),
        ("interleaved", [0, 128], [256, 256], 2 * 6 * 128),
        ("separate", [0, 0], [128, 128], 6 * 128),
    ],
)
def test_segments_address_every_page_once(
    split: str, offsets: list[int], strides: list[int], nbytes: int
) -> None:
    layout = KvLayout(**SMALL, kv_split=split)  # type: ignore[arg-type]
    assert layout.page_bytes == 4 * 2 * 8 * 2 == 128
    assert [s.offset for s in layout.segments] == offsets and [s.stride for s in layout.segments] == strides
    assert layout.tensor_nbytes == nbytes
    # the pages of all segments tile each tensor exactly
    for t in range(layout.tensors_per_layer):
        cover = np.zeros(nbytes, np.int64)
        for s in layout.segments:
            if s.tensor == t:
                for p in range(layout.num_blocks):
                    cover[s.offset + p * s.stride : s.offset + p * s.stride + layout.page_bytes] += 1
        assert (cover == 1).all()


@pytest.mark.parametrize("src", ["stacked", "interleaved", "separate"])
@pytest.mark.parametrize("dst", ["stacked", "interleaved", "separate"])
def test_write_units_fuse_k_and_v_only_when_both_sides_interleave_or_stack(src: str, dst: str) -> None:
    a = KvLayout(**SMALL, kv_split=src)  # type: ignore[arg-type]
    b = KvLayout(**{**SMALL, "num_blocks": 9}, kv_split=dst)  # type: ignore[arg-type]
    units = write_units(a, b)
    if src == dst == "interleaved":  # a page's K and V lie back to back on both sides: one write
        assert len(units) == 1 and units[0].names == ("k", "v") and units[0].length == 2 * 128
        assert units[0].src == a.segments[0] and units[0].dst == b.segments[0]
        assert units[0].shifts == ((0, 0),)
    elif src == dst == "stacked":  # V is K's pages shifted by each side's num_blocks: one request
        assert len(units) == 1 and units[0].names == ("k", "v") and units[0].length == 128
        assert units[0].src == a.segments[0] and units[0].dst == b.segments[0]
        assert units[0].shifts == ((0, 0), (a.num_blocks, b.num_blocks))
    else:
        assert [u.names for u in units] == [("k",), ("v",)] and {u.length for u in units} == {128}
        assert [u.src for u in units] == list(a.segments) and [u.dst for u in units] == list(b.segments)
        assert all(u.shifts == ((0, 0),) for u in units)
    # whatever the grouping, the units move every byte of every segment's page, once
    for lay, side, k in ((a, "src", 0), (b, "dst", 1)):
        spans = sorted(
            (getattr(u, side).tensor, getattr(u, side).offset + (p + shift[k]) * getattr(u, side).stride + i)
            for u in units
            for shift in u.shifts
            for p in range(lay.num_blocks)
            for i in range(u.length)
        )
        want = sorted(
            (s.tensor, s.offset + p * s.stride + i)
            for s in lay.segments
            for p in range(lay.num_blocks)
            for i in range(lay.page_bytes)
        )
        assert spans == want


def test_write_units_keep_a_single_page_cache_apart_and_refuse_other_formats() -> None:
    # stacked with one block: V's page starts where K's ends; fusing it into K's write would
    # make two pages of that write overlap, so it rides as K's page shifted by one instead
    one = KvLayout(**{**SMALL, "num_blocks": 1}, kv_split="stacked")
    (unit,) = write_units(one, one)
    assert unit.names == ("k", "v") and unit.length == one.page_bytes and unit.shifts == ((0, 0), (1, 1))
    src, dst = unit.pages(np.array([0]), np.array([0]))
    assert src.tolist() == dst.tolist() == [0, 1]
    mla = KvLayout.mla(num_layers=2, num_blocks=4, block_size=4, latent_dim=16, dtype="float16")
    assert [(u.names, u.length) for u in write_units(mla, mla)] == [(("latent",), mla.page_bytes)]
    with pytest.raises(ConfigError, match="page formats differ"):
        write_units(mla, KvLayout(**SMALL, kv_split="stacked"))


def test_the_ack_carries_the_prefill_layout() -> None:
    lay = KvLayout(**SMALL, kv_split="interleaved")
    for ack in (wire.Ack(True, 2, 1 << 30, lay), wire.Ack(False, 1, 4096, lay, "page formats differ")):
        assert wire.decode(wire.encode(ack)) == ack
    raw = wire.encode(wire.Ack(True, 2, 1 << 30, lay))
    with pytest.raises(wire.ProtocolError, match="ACK"):
        wire.decode(raw[:20])  # the layout cut short
    with pytest.raises(wire.ProtocolError):
        wire.decode(raw[:20] + b"x" + raw[21:])  # not a layout document


def test_check_names_what_to_fix() -> None:
    layout = KvLayout.vllm(**SMALL)
    good = make_caches(layout, fill=0)
    assert len(layout.check(good)) == 2
    bad_shape = [good[0], np.zeros((2, 6, 4, 2, 4), np.float16)]
    with pytest.raises(ConfigError, match=r"layer 1 kv: shape \(2, 6, 4, 2, 4\).*wants \(2, 6, 4, 2, 8\)"):
        layout.check(bad_shape)
    with pytest.raises(ConfigError, match=r"layer 0 kv: dtype float32 but the layout says float16"):
        layout.check([np.zeros((2, 6, 4, 2, 8), np.float32), good[1]])
    transposed = np.zeros((8, 2, 4, 6, 2), np.float16).transpose(4, 3, 2, 1, 0)
    assert transposed.shape == (2, 6, 4, 2, 8)
    with pytest.raises(ConfigError, match="not contiguous"):
        layout.check([transposed, good[1]])
    with pytest.raises(ConfigError, match="not contiguous"):
        layout.check([torch.zeros(8, 2, 4, 6, 2, dtype=torch.float16).permute(4, 3, 2, 1, 0), good[1]])
    with pytest.raises(ConfigError, match="the layout has 2 layers but 1 layer caches"):
        layout.check(good[:1])
    with pytest.raises(ConfigError, match="overlap in memory"):
        layout.check([good[0], good[0]])
    with pytest.raises(ConfigError, match="numpy array or a torch tensor, got list"):
        layout.check([good[0], [[1, 2]]])


def test_check_separate_and_latent_layouts() -> None:
    sg = KvLayout.sglang(**SMALL)
    caches = make_caches(sg, fill=0)
    assert sg.check(caches)[1] == caches[1]
    with pytest.raises(ConfigError, match=r"keeps a \(k, v\) pair of tensors per layer, got 1"):
        sg.check([caches[0][0], caches[1]])
    blocks = [(np.zeros((6, 4, 2, 8), np.float16), np.zeros((6, 4, 2, 8), np.float16)) for _ in range(2)]
    assert len(sg.check(blocks)) == 2  # [num_blocks, block_size, ...] works as well
    mla = KvLayout.mla(num_layers=1, num_blocks=3, block_size=4, latent_dim=576, dtype="bfloat16")
    for shape in [(3, 4, 576), (12, 1, 576), (12, 576), (3, 4, 1, 576)]:
        mla.check([torch.zeros(shape, dtype=torch.bfloat16)])
    with pytest.raises(ConfigError, match="shape"):
        mla.check([torch.zeros(3, 4, 512, dtype=torch.bfloat16)])


def test_bad_layouts_and_page_formats_are_refused() -> None:
    with pytest.raises(ConfigError, match="num_blocks must be a positive int"):
        KvLayout(**{**SMALL, "num_blocks": 0}, kv_split="stacked")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dtype 'float64'"):
        KvLayout(**{**SMALL, "dtype": "float64"}, kv_split="stacked")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_split 'kv'"):
        KvLayout(**SMALL, kv_split="kv")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="one head per token"):
        KvLayout(**SMALL, kv_split="latent")  # type: ignore[arg-type]
    vllm, sglang = KvLayout.vllm(**SMALL), KvLayout.sglang(**{**SMALL, "num_blocks": 60})
    vllm.check_compatible(sglang)  # same page format, other pool size and style
    with pytest.raises(ConfigError, match=r"head_dim: 8 here, 16 there; dtype: 'float16' here, 'bfloat16'"):
        vllm.check_compatible(KvLayout.vllm(**{**SMALL, "head_dim": 16, "dtype": "bfloat16"}))
    assert KvLayout.from_json(sglang.to_json()) == sglang
    with pytest.raises(ConfigError, match="not a KvLayout document"):
        KvLayout.from_json(b'{"num_layers": 1}')


# --- the page allocator ----------------------------------------------------------------------
def test_allocator_hands_out_each_page_once_and_takes_it_back() -> None:
    a = PageAllocator(10, reserved=[0])
    assert a.capacity == 9 and a.stats().free == 9
    first = a.alloc(4, owner=7)
    assert first.tolist() == [1, 2, 3, 4]  # ascending runs from a fresh allocator; page 0 reserved
    rest = a.alloc(5, owner=8)
    assert sorted(first.tolist() + rest.tolist()) == list(range(1, 10))
    assert a.stats().used == 9 and a.owners() == {7: 4, 8: 5}
    with pytest.raises(PagesExhausted, match="asked for 1 pages but 0 of 9"):
        a.alloc(1)
    a.free(first)
    assert a.alloc(4).tolist() == first.tolist()  # freed pages come back first (LIFO)


def test_exhaustion_allocates_nothing() -> None:
    a = PageAllocator(8)
    held = a.alloc(5)
    with pytest.raises(PagesExhausted):
        a.alloc(4)
    assert a.stats().free == 3 and a.alloc(3).size == 3
    a.free(held)
    assert a.stats().free == 5


def test_double_free_and_bad_frees_free_nothing() -> None:
    a = PageAllocator(8, reserved=[7])
    p = a.alloc(3)
    a.free(p[:1])
    with pytest.raises(PageStateError, match=rf"{int(p[0])} \(free\)"):
        a.free(p)  # p[0] twice: p[1:] must stay allocated
    assert a.allocated(p[1:]) and a.stats().used == 2
    with pytest.raises(PageStateError, match="named twice"):
        a.free([int(p[1]), int(p[1])])
    with pytest.raises(PageStateError, match="outside"):
        a.free([8])
    with pytest.raises(PageStateError, match=r"7 \(reserved\)"):
        a.free([7])
    with pytest.raises(ConfigError, match="one-dimensional"):
        a.free(np.zeros((1, 1), np.int64))
    assert a.stats().used == 2


def test_leak_check_lists_pages_per_owner() -> None:
    a = PageAllocator(8)
    a.check_no_leaks()
    kept = a.alloc(2, owner=42)
    with pytest.raises(
        PageLeak, match=re.escape(f"2 page(s) still allocated: owner 42: pages {kept.tolist()}")
    ):
        a.check_no_leaks()
    a.free(kept)
    a.check_no_leaks()


# --- the imm pool --------------------------------------------------------------------------------
def test_imm_pool_is_fifo_and_never_hands_out_a_held_or_retired_value() -> None:
    pool = ImmPool(100, 3)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert (a, b, c) == (100, 101, 102)
    with pytest.raises(ImmsExhausted):
        pool.acquire()
    pool.release(b)
    pool.retire(a)
    pool.release(c)
    assert pool.acquire() == b and pool.acquire() == c  # FIFO: the longest-rested value first
    with pytest.raises(ImmsExhausted):
        pool.acquire()  # a is retired for good
    assert pool.stats().retired == 1
    with pytest.raises(ConfigError, match="not held"):
        pool.release(a)
    with pytest.raises(ConfigError, match="within 32 bits"):
        ImmPool((1 << 32) - 1, 2)


# --- the wire ------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=300, unique=True), st.booleans())
def test_page_lists_round_trip(pages: list[int], sort: bool) -> None:
    arr = np.array(sorted(pages) if sort else pages, np.int64)
    msg = wire.Request(seq=9, imm=0x4B560001, expected=12, skip=3, request_id="r-é", pages=arr)
    back = wire.decode(wire.encode(msg))
    assert isinstance(back, wire.Request)
    assert back.pages.tolist() == arr.tolist() and (back.seq, back.imm, back.expected, back.skip) == (
        9,
        0x4B560001,
        12,
        3,
    )
    assert back.request_id == "r-é"


def test_runs_make_contiguous_page_lists_small() -> None:
    pages = np.arange(10_000, 18_192, dtype=np.int64)
    mode, data = wire.encode_pages(pages)
    assert mode == 1 and len(data) == 8


def test_malformed_messages_raise_protocol_error() -> None:
    done = wire.encode(wire.Done(5, wire.Status.FAILED, False, 7, "RemoteAccessError", "boom"))
    back = wire.decode(done)
    assert back == wire.Done(5, wire.Status.FAILED, False, 7, "RemoteAccessError", "boom")
    for bad in [b"", b"XYZ\x01\x01", done[:3] + b"\x09" + done[4:], done[:8], b"FKV\x01\x77"]:
        with pytest.raises(wire.ProtocolError):
            wire.decode(bad)
