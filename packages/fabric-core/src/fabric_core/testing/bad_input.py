"""Bad input, fuzzed: property tests (hypothesis) over every public entry point of the contract.

Every bad input must raise exactly ``ConfigError`` (``CapabilityError`` for memory the backend
cannot carry) with a message that names what is wrong, post nothing (the submit count, the
registration count and every byte of the target stay as they were, and the target counts no
imm) and leave the engine usable: after all the examples of a test, a valid write lands with
exact bytes and the exact imm count.

Each test keeps one set of engines for all its examples, so the engines see every bad input
of the test in a row before the final valid write. The number of examples is small
(``BAD_INPUT_EXAMPLES``) so each test runs in about a second on every harness; hypothesis'
own variety replaces the seed parametrization (one seed).
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..api import TransferEngine
from ..errors import CapabilityError, ConfigError
from ..memory import RawMemory
from ..models import MemoryRegion, MemoryRegionDescriptor, NicKey
from ..ops import Pinned, ScatterTarget, Sharded, ShardPeers
from .harness import Harness

__all__ = ["BAD_INPUT_EXAMPLES", "BadInputConformance"]

BAD_INPUT_EXAMPLES = 6
"""Examples per kind of bad input (each is one refused call; a few RPCs on a remote harness)."""
T = 10.0
CANARY = 0xA5
SIZE = 1 << 14
PAGE = 64
PAGES = SIZE // PAGE
IMM = 7  # the imm of the valid write that proves the engine usable
U63 = 1 << 63
U8Array = np.ndarray[Any, np.dtype[np.uint8]]

PROPS = settings(
    max_examples=BAD_INPUT_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
Case = Callable[["World", st.DataObject, str], None]


@dataclass
class World:
    """A writer ``a`` and a target ``b`` (as many NICs as the harness gives, up to 2), with
    what a bad request needs: a descriptor of another NIC count, one of read-only memory, a
    region of another engine and a deregistered region."""

    h: Harness
    a: TransferEngine
    b: TransferEngine
    src: U8Array
    dst: U8Array
    src_mr: MemoryRegion
    dst_mr: MemoryRegion
    other_nics_desc: MemoryRegionDescriptor | None
    ro_desc: MemoryRegionDescriptor
    foreign: MemoryRegion
    deregistered: MemoryRegion

    @property
    def desc(self) -> MemoryRegionDescriptor:
        return self.dst_mr.descriptor

    def snapshot(self) -> tuple[int, int]:
        s = self.a.stats()
        return s.submitted, s.registrations

    def assert_untouched(self, before: tuple[int, int]) -> None:
        assert self.snapshot() == before, "a refused call posted or registered something"
        assert (self.dst == CANARY).all(), "a refused call changed target memory"

    def assert_still_usable(self) -> None:
        """Nothing arrived at the target, and a valid write lands exactly, counted exactly."""
        self.h.settle()
        assert self.b.stats().imms_received == 0, "a refused call delivered an imm"
        assert (self.dst == CANARY).all(), "a refused call changed target memory"
        t = self.a.submit_write(self.src_mr, 0, 2 * PAGE, self.desc, PAGE, imm=IMM)
        assert t.imms_at_target >= 1
        self.b.counter(IMM).wait(t.imms_at_target, timeout=T)
        t.wait(T)
        assert np.array_equal(self.dst[PAGE : 3 * PAGE], self.src[: 2 * PAGE])
        assert (self.dst[:PAGE] == CANARY).all() and (self.dst[3 * PAGE :] == CANARY).all()
        self.h.settle()
        assert self.b.counter(IMM).value == 0, "the target counted more imms than imms_at_target"
        assert self.b.stats().imms_received == t.imms_at_target


def _world(h: Harness) -> World:
    nics = min(2, h.max_nics)
    a, b = h.open_engine(nics), h.open_engine(nics)
    src = h.alloc(SIZE)
    src[:] = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    src[src == CANARY] = CANARY + 1
    dst = h.alloc(SIZE)
    dst[:] = CANARY
    other = h.open_engine(1 if nics > 1 else min(2, h.max_nics))
    ro = h.alloc(PAGE)
    ro.flags.writeable = False
    scratch = h.alloc(PAGE)
    gone = a.register(scratch)
    a.deregister(gone)
    return World(
        h=h,
        a=a,
        b=b,
        src=src,
        dst=dst,
        src_mr=a.register(src),
        dst_mr=b.register(dst),
        other_nics_desc=other.register(h.alloc(PAGE)).descriptor if other.num_nics != nics else None,
        ro_desc=b.register(ro).descriptor,
        foreign=other.register(h.alloc(PAGE)),
        deregistered=gone,
    )


def _check(h: Harness, case: Case, fields: list[str]) -> None:
    """Run ``case`` for every kind of bad input in ``fields`` (each one over a few examples,
    so no kind is left to chance) against one world, then prove the engine usable."""
    w = _world(h)

    def runner(field: str) -> Callable[[], None]:
        @PROPS
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            case(w, data, field)

        return run

    for field in fields:
        runner(field)()
    w.assert_still_usable()


def _refused(w: World, call: Callable[[], object], match: str, error: type[Exception] = ConfigError) -> None:
    before = w.snapshot()
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"expected exactly {error.__name__}, got {type(info.value).__name__}"
    assert re.search(match, str(info.value)), f"message {str(info.value)!r} does not name /{match}/"
    w.assert_untouched(before)


# --- strategies ---------------------------------------------------------------------------
negative = st.integers(max_value=-1) | st.integers(-(1 << 63), -1).map(np.int64)
too_big = st.integers(min_value=U63, max_value=1 << 70)
not_int = st.sampled_from([8.0, "8", None, b"8", [8], True, float("nan"), np.float32(8.0), 8 + 0j])
bad_count = negative | too_big | not_int
"""Not an int in [0, 2**63): every length, offset, stride and page length refuses it."""
bad_imm = (
    st.integers(max_value=-1)
    | st.integers(min_value=1 << 32, max_value=1 << 70)
    | st.integers(1 << 32, (1 << 63) - 1).map(np.int64)
    | st.sampled_from([1.0, "1", True, b"\x01", [1], float("inf")])
)
bad_timeout = st.sampled_from([0, 0.0, -1, -0.5, float("nan"), -math.inf, "1", True, b"1", [1]]) | st.floats(
    max_value=0.0, allow_nan=False
)
bad_wait_timeout = st.sampled_from([-1, -1e-9, float("nan"), -math.inf, "1", True, [1]]) | st.floats(
    max_value=-1e-6, allow_nan=False
)


def _bad_routing(n: int, allow_peers: bool) -> st.SearchStrategy[tuple[object, str]]:
    out: st.SearchStrategy[tuple[object, str]] = st.one_of(
        st.integers(n, 1 << 70).map(lambda k: (Pinned(k), "Pinned|pins NIC|NIC")),
        (negative | not_int).map(lambda k: (Pinned(k), "Pinned.nic")),
        st.integers(n + 1, 1 << 70).map(lambda k: (Sharded(k), "Sharded|shards over|NIC")),
        (st.integers(max_value=0) | not_int.filter(lambda v: v is not None)).map(
            lambda k: (Sharded(k), "Sharded.nics")
        ),
        st.sampled_from([None, "sharded", 1, object, Sharded]).map(lambda r: (r, "routing")),
    )
    if not allow_peers:
        peers: tuple[object, str] = (ShardPeers(), "ShardPeers")
        out = out | st.just(peers)
    return out


def _page_list(kind: str, values: list[int] | np.ndarray[Any, Any]) -> object:
    """The same page indices as a list, a numpy array of some int dtype, or a torch tensor."""
    if kind == "list":
        return [int(v) for v in values]
    if kind == "torch":
        import torch

        return torch.tensor(np.asarray(values, dtype=np.int64))
    return np.asarray(values, dtype=np.int64).astype(kind)


def _crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


# --- the cases: each draws one bad call (one thing wrong, the rest valid) ------------------
WRITE_FIELDS = ["src_offset", "length", "dst_offset", "span", "imm", "routing", "src", "dst", "timeout"]


def _write_case(w: World, data: st.DataObject, field: str) -> None:
    n = w.a.num_nics
    length = data.draw(st.integers(0, SIZE // 2), "length")
    so = data.draw(st.integers(0, SIZE // 2), "src_offset")
    do = data.draw(st.integers(0, SIZE // 2), "dst_offset")
    args: dict[str, Any] = {
        "src": w.src_mr,
        "src_offset": so,
        "length": length,
        "dst": w.desc,
        "dst_offset": do,
        "imm": data.draw(st.none() | st.integers(0, (1 << 32) - 1), "imm"),
        "routing": Sharded(),
        "timeout": None,
    }
    match = field
    if field in ("src_offset", "length", "dst_offset"):
        args[field] = data.draw(bad_count, field)
    elif field == "span":  # each value valid, together past the end of one region
        side = data.draw(st.sampled_from(["src_offset", "dst_offset"]))
        args["src_offset"] = args["dst_offset"] = 0
        args["length"] = length = data.draw(st.integers(0, SIZE))
        args[side] = data.draw(st.integers(SIZE - length + 1, U63 - 1 - length))
        match = "source" if side == "src_offset" else "destination"
    elif field == "imm":
        args["imm"] = data.draw(bad_imm, "imm")
    elif field == "routing":
        args["routing"], match = data.draw(_bad_routing(n, allow_peers=False), "routing")
    elif field == "src":
        args["src"], match = data.draw(
            st.sampled_from(
                [
                    (w.deregistered, "not registered with this engine"),
                    (w.foreign, "not registered with this engine"),
                    (w.desc, "MemoryRegion"),
                    (None, "MemoryRegion"),
                    (b"\x00" * 8, "MemoryRegion"),
                ]
            ),
            "src",
        )
    elif field == "dst":
        bad_dsts: list[tuple[object, str]] = [
            (w.ro_desc, "dst descriptor names read-only memory"),
            (w.desc.to_bytes(), "dst must be a MemoryRegionDescriptor"),
            (w.dst_mr, "dst must be a MemoryRegionDescriptor"),
            (None, "dst must be a MemoryRegionDescriptor"),
            (w.desc.model_dump(), "dst must be a MemoryRegionDescriptor"),
        ]
        if w.other_nics_desc is not None:
            bad_dsts.append((w.other_nics_desc, "dst descriptor has .* NIC keys"))
        args["dst"], match = data.draw(st.sampled_from(bad_dsts), "dst")
    else:
        args["timeout"] = data.draw(bad_timeout, "timeout")
    _refused(
        w,
        lambda: w.a.submit_write(
            args["src"],
            args["src_offset"],
            args["length"],
            args["dst"],
            args["dst_offset"],
            imm=args["imm"],
            routing=args["routing"],
            timeout=args["timeout"],
        ),
        match,
    )


PAGED_FIELDS = [
    "negative",
    "out-of-range",
    "duplicate",
    "mismatch",
    "empty",
    "float",
    "two-dim",
    "ragged",
    "not-array",
    "stride",
    "overlap",
    "page_length",
    "offset",
    "imm",
    "routing",
    "timeout",
]


def _paged_case(w: World, data: st.DataObject, field: str) -> None:
    count = data.draw(st.integers(2, 16), "pages")
    raw: dict[str, list[Any]] = {
        "src": data.draw(st.lists(st.integers(0, PAGES - 1), min_size=count, max_size=count), "src_pages"),
        "dst": data.draw(st.permutations(range(PAGES)).map(lambda p: list(p[:count])), "dst_pages"),
    }
    a: dict[str, Any] = {
        "src_stride": PAGE,
        "dst_stride": PAGE,
        "page_length": PAGE,
        "src_offset": 0,
        "dst_offset": 0,
        "imm": 3,
        "routing": Sharded(),
        "timeout": None,
    }
    kind = data.draw(st.sampled_from(["list", "int64", "int32", "uint16", "torch"]), "index kind")
    wide = kind if kind in ("list", "int64", "torch") else "int64"  # holds any int64 index
    side = data.draw(st.sampled_from(["src", "dst"]), "side")
    what = f"{side}_pages"
    match = what
    if field == "negative":
        raw[side][data.draw(st.integers(0, count - 1))] = data.draw(st.integers(-(1 << 62), -1))
        kind, match = wide, f"{what} holds a negative index"
    elif field == "out-of-range":
        raw[side][data.draw(st.integers(0, count - 1))] = data.draw(st.integers(PAGES, U63 - 1))
        kind, match = wide, ("source page" if side == "src" else "destination page")
    elif field == "duplicate":
        i, j = data.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
        raw["dst"][j] = raw["dst"][i]
        match = "dst_pages names a page twice"
    elif field == "mismatch":
        raw[side] = raw[side] + [0] * data.draw(st.integers(1, 4))
        match = f"src_pages has {len(raw['src'])} entries but dst_pages has {len(raw['dst'])}"
    elif field == "empty":
        raw = {"src": [], "dst": []}
        match = "at least one page"
    elif field in ("stride", "offset"):
        a[f"{side}_{field}"] = data.draw(bad_count)
        match = f"{side}_{field}"
    elif field == "overlap":
        a["dst_stride"] = data.draw(st.integers(0, PAGE - 1))
        match = "dst_stride .* is below page_length"
    elif field == "page_length":
        a["page_length"] = data.draw(bad_count)
        match = "page_length"
    elif field == "imm":
        a["imm"] = data.draw(bad_imm)
        match = "imm"
    elif field == "routing":
        a["routing"], match = data.draw(_bad_routing(w.a.num_nics, allow_peers=False))
    elif field == "timeout":
        a["timeout"] = data.draw(bad_timeout)
        match = "timeout"
    pages = {k: _page_list(kind, v) for k, v in raw.items()}
    if field == "float":
        dtype = data.draw(st.sampled_from(["float64", "float32", "bool"]))
        pages[side] = np.asarray(raw[side], dtype=dtype)
        match = f"{what} must hold integers"
    elif field == "two-dim":
        pages[side] = np.asarray(raw[side], dtype=np.int64).reshape(1, -1)
        match = f"{what} must be one-dimensional"
    elif field == "ragged":
        pages[side] = [[0, 1], [2], *raw[side]]
    elif field == "not-array":
        pages[side] = data.draw(st.sampled_from([None, 3, "0,1", object()]))
    _refused(
        w,
        lambda: w.a.submit_paged_write(
            w.src_mr,
            pages["src"],
            a["src_stride"],
            w.desc,
            pages["dst"],
            a["dst_stride"],
            a["page_length"],
            src_offset=a["src_offset"],
            dst_offset=a["dst_offset"],
            imm=a["imm"],
            routing=a["routing"],
            timeout=a["timeout"],
        ),
        match,
    )


OTHER_FIELDS = [
    "scatter-empty",
    "scatter-not-target",
    "scatter-dst",
    "scatter-length",
    "scatter-offset",
    "scatter-span",
    "scatter-imm",
    "scatter-routing",
    "imm-value",
    "imm-dst",
    "imm-routing",
    "barrier-empty",
    "barrier-dst",
    "barrier-imm",
    "send-size",
    "send-peer",
    "send-timeout",
    "counter-imm",
    "wait-n",
    "wait-timeout",
    "recv-timeout",
]


def _other_case(w: World, data: st.DataObject, field: str) -> None:
    n = w.a.num_nics
    count = data.draw(st.integers(1, 4), "targets")
    targets: list[Any] = [
        ScatterTarget(w.desc, PAGE, src_offset=j * PAGE, dst_offset=j * PAGE) for j in range(count)
    ]
    j = data.draw(st.integers(0, count - 1), "bad target")
    bad_dsts: list[tuple[object, str]] = [
        (w.ro_desc, "read-only"),
        (None, "MemoryRegionDescriptor"),
        (w.desc.to_bytes(), "MemoryRegionDescriptor"),
    ]
    if w.other_nics_desc is not None:
        bad_dsts.append((w.other_nics_desc, "NIC keys"))
    bad_dst = st.sampled_from(bad_dsts)
    imm: Any = 1
    routing: Any = ShardPeers()  # the default of a scatter
    timeout: Any = None
    call: Callable[[], object]
    match = ""

    def scatter() -> object:
        return w.a.submit_scatter(w.src_mr, targets, imm=imm, routing=routing)

    if field == "scatter-empty":
        targets.clear()
        call, match = scatter, "at least one target"
    elif field == "scatter-not-target":
        targets[j] = data.draw(st.sampled_from([w.desc, None, (w.desc, PAGE), {"dst": w.desc}]))
        call, match = scatter, rf"targets\[{j}\] must be a ScatterTarget"
    elif field == "scatter-dst":
        bad, why = data.draw(bad_dst)
        targets[j] = ScatterTarget(bad, PAGE)  # type: ignore[arg-type]
        call, match = scatter, rf"targets\[{j}\]\.dst.*{why}"
    elif field in ("scatter-length", "scatter-offset"):
        name = (
            "length"
            if field == "scatter-length"
            else data.draw(st.sampled_from(["src_offset", "dst_offset"]))
        )
        kw: dict[str, Any] = {"length": PAGE, "src_offset": 0, "dst_offset": 0}
        kw[name] = data.draw(bad_count)
        targets[j] = ScatterTarget(w.desc, **kw)
        call, match = scatter, rf"targets\[{j}\]\.{name}"
    elif field == "scatter-span":
        side = data.draw(st.sampled_from(["src_offset", "dst_offset"]))
        off = data.draw(st.integers(SIZE - PAGE + 1, U63 - PAGE - 1))
        targets[j] = ScatterTarget(w.desc, PAGE, **{side: off})
        where = "source" if side == "src_offset" else "destination"
        call, match = scatter, rf"targets\[{j}\] {where}"
    elif field == "scatter-imm":
        imm = data.draw(bad_imm)
        call, match = scatter, "imm"
    elif field == "scatter-routing":
        routing, match = data.draw(_bad_routing(n, allow_peers=True))
        call = scatter
    elif field == "imm-value":
        imm = data.draw(bad_imm)
        call, match = (lambda: w.a.submit_imm(w.desc, imm)), "imm"
    elif field == "imm-dst":
        bad, match = data.draw(bad_dst)
        call = lambda: w.a.submit_imm(bad, 1)  # type: ignore[arg-type]  # noqa: E731
    elif field == "imm-routing":
        routing, match = data.draw(_bad_routing(n, allow_peers=True))
        call = lambda: w.a.submit_imm(w.desc, 1, routing=routing)  # noqa: E731
    elif field == "barrier-empty":
        call, match = (lambda: w.a.submit_barrier([], 1)), "at least one destination"
    elif field == "barrier-dst":
        bad, why = data.draw(bad_dst)
        dsts: list[Any] = [w.desc] * count
        dsts[j] = bad
        call, match = (lambda: w.a.submit_barrier(dsts, 1)), rf"dsts\[{j}\].*{why}"
    elif field == "barrier-imm":
        imm = data.draw(bad_imm)
        call, match = (lambda: w.a.submit_barrier([w.desc] * count, imm)), "imm"
    elif field == "send-size":
        payload = b"x" * (w.a.capabilities.max_send_size + data.draw(st.integers(1, 4096)))
        call, match = (lambda: w.a.submit_send(w.b.address, payload)), "max_send_size"
    elif field == "send-peer":
        peer: Any = data.draw(st.sampled_from([w.b.address.raw, str(w.b.address), None, w.desc]))
        call, match = (lambda: w.a.submit_send(peer, b"x")), "peer must be a DomainAddress"
    elif field == "send-timeout":
        timeout = data.draw(bad_timeout)
        call, match = (lambda: w.a.submit_send(w.b.address, b"x", timeout=timeout)), "timeout"
    elif field == "counter-imm":
        imm = data.draw(bad_imm)
        call, match = (lambda: w.b.counter(imm)), "imm"
    elif field == "wait-n":
        wait_n: Any = data.draw(st.integers(max_value=0) | st.sampled_from([1.0, "1", True, None]))
        call, match = (lambda: w.b.counter(IMM).wait(wait_n, timeout=0)), "count to wait for"
    elif field == "wait-timeout":
        timeout = data.draw(bad_wait_timeout)
        call, match = (lambda: w.b.counter(IMM).wait(1, timeout=timeout)), "timeout"
    else:
        timeout = data.draw(bad_wait_timeout)
        call, match = (lambda: w.b.recv(timeout=timeout)), "timeout"
    _refused(w, call, match)


DESCRIPTOR_FIELDS = ["random", "truncated", "bit-flip", "version", "magic", "trailing", "count", "nics"]


def _descriptor_case(w: World, data: st.DataObject, field: str) -> None:
    good = w.desc.to_bytes()
    if field == "random":
        raw = data.draw(st.binary(max_size=300).filter(lambda b: b != good))
    elif field == "truncated":
        raw = good[: data.draw(st.integers(0, len(good) - 1))]
    elif field == "bit-flip":  # CRC-32 catches every error of up to 3 bits
        flips = data.draw(st.lists(st.integers(0, 8 * len(good) - 1), min_size=1, max_size=3, unique=True))
        buf = bytearray(good)
        for bit in flips:
            buf[bit // 8] ^= 1 << (bit % 8)
        raw = bytes(buf)
    elif field == "version":
        version = data.draw(st.integers(0, 255).filter(lambda v: v != good[4]))
        raw = _crc(good[:4] + bytes([version]) + good[5:-4])
    elif field == "magic":
        magic = data.draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != b"FBMR"))
        raw = _crc(magic + good[4:-4])
    elif field == "trailing":
        raw = good + data.draw(st.binary(min_size=1, max_size=16))
    elif field == "count":  # the header's NIC count disagrees with the entries; checksum fixed
        count = struct.unpack_from("<H", good, 8)[0]
        wrong = data.draw(st.integers(0, 0xFFFF).filter(lambda c: c != count))
        raw = _crc(good[:8] + struct.pack("<H", wrong) + good[10:-4])
    else:  # well formed, with another NIC count than the engines: parses, and the write refuses it
        keys = data.draw(st.integers(1, 8).filter(lambda k: k != w.a.num_nics))
        nics = tuple(NicKey(address=w.desc.nics[i % len(w.desc.nics)].address, rkey=i) for i in range(keys))
        forged = w.desc.model_copy(update={"nics": nics})
        parsed = MemoryRegionDescriptor.from_bytes(forged.to_bytes())
        assert parsed == forged
        _refused(
            w, lambda: w.a.submit_write(w.src_mr, 0, PAGE, parsed, 0, imm=1), "dst descriptor has .* NIC keys"
        )
        _refused(w, lambda: w.a.submit_imm(parsed, 1), "NIC keys")
        return
    _refused(w, lambda: MemoryRegionDescriptor.from_bytes(raw), "^MemoryRegionDescriptor: ")
    text = raw.hex() if data.draw(st.booleans()) else raw.decode("latin-1")
    _refused(w, lambda: MemoryRegionDescriptor.from_json(text), "^MemoryRegionDescriptor JSON: ")


REGISTER_FIELDS = [
    "strided",
    "torch",
    "empty",
    "read-only",
    "raw-ptr",
    "raw-length",
    "device",
    "object",
    "cuda",
]
BAD_DEVICES = [
    "cuda:\u00b2",
    "cuda:-1",
    "cuda:1.5",
    "cuda: 1",
    "CUDA",
    "gpu",
    "cuda:0x1",
    "",
    "cuda:",
    "cpu:0",
]


def _register_case(w: World, data: st.DataObject, field: str) -> None:
    error: type[Exception] = ConfigError
    call: Callable[[], object]
    if field == "strided":
        step, rows = data.draw(st.integers(2, 8)), data.draw(st.integers(1, 8))
        arr = w.h.alloc(rows * 8 * step).reshape(rows, 8 * step)[:, ::step]
        writable = data.draw(st.sampled_from([None, True, False]))
        call, match = (lambda: w.a.register(arr, writable=writable)), "not contiguous"
    elif field == "torch":
        torch = pytest.importorskip("torch")
        r, c = data.draw(st.integers(2, 16)), data.draw(st.integers(3, 16))
        base = torch.zeros(r, c, dtype=data.draw(st.sampled_from([torch.uint8, torch.float32, torch.int64])))
        how = data.draw(st.sampled_from(["t", "step", "expand"]))
        tensor = base.t() if how == "t" else base[:, ::2] if how == "step" else base[:1].expand(r, c)
        call, match = (lambda: w.a.register(tensor)), "tensor is not contiguous"
    elif field == "empty":
        empty = data.draw(
            st.sampled_from([bytearray(), np.zeros(0, np.uint8), np.zeros((4, 0)), memoryview(b"")])
        )
        call, match = (lambda: w.a.register(empty)), "empty"
    elif field == "read-only":
        ro = w.h.alloc(data.draw(st.integers(1, 256)))
        ro.flags.writeable = False
        call, match = (lambda: w.a.register(ro, writable=True)), "read-only"
    elif field == "raw-ptr":
        ptr: Any = data.draw(
            st.integers(max_value=0)
            | st.integers(min_value=1 << 64)
            | st.sampled_from([True, 1.5, "1", None])
        )
        call, match = (lambda: w.a.register_ptr(ptr, 64)), "RawMemory.ptr"
    elif field == "raw-length":
        base_ptr = data.draw(st.integers(1, (1 << 64) - 1))
        length: Any = data.draw(
            st.integers(max_value=0)
            | st.integers(min_value=(1 << 64) - base_ptr + 1, max_value=1 << 66)
            | st.sampled_from([True, 64.0, "64", None])
        )
        call, match = (lambda: w.a.register(RawMemory(base_ptr, length))), "RawMemory.length"
    elif field == "device":
        device = data.draw(
            st.sampled_from(BAD_DEVICES)
            | st.integers(1 << 16, 1 << 20).map(lambda i: f"cuda:{i}")
            | st.text(max_size=12).filter(lambda t: t != "cpu" and not re.fullmatch(r"cuda(:[0-9]+)?", t))
        )
        call, match = (lambda: w.a.register_ptr(0x10000, 64, device)), "unknown device"
    elif field == "cuda" and not w.a.capabilities.cuda_memory:
        cuda = f"cuda:{data.draw(st.integers(0, (1 << 16) - 1))}"
        error, match = CapabilityError, "cannot be registered|host memory only"
        call = lambda: w.a.register(RawMemory(0x10000, 4096, cuda))  # noqa: E731
    else:
        thing = data.draw(st.sampled_from([object(), 42, "text", None, 1.5, [1, 2, 3]]))
        call, match = (lambda: w.a.register(thing)), "cannot register"
    _refused(w, call, match, error)


# --------------------------------------------------------------------------------------
class BadInputConformance:
    """Bad input, fuzzed: a typed error naming the problem, nothing posted, engine usable."""

    @pytest.mark.fabric_seeds(1)
    def test_fuzzed_write_is_refused(self, fabric_harness: Harness) -> None:
        _check(fabric_harness, _write_case, WRITE_FIELDS)

    @pytest.mark.fabric_seeds(1)
    def test_fuzzed_paged_write_is_refused(self, fabric_harness: Harness) -> None:
        _check(fabric_harness, _paged_case, PAGED_FIELDS)

    @pytest.mark.fabric_seeds(1)
    def test_fuzzed_scatter_imm_barrier_send_wait_are_refused(self, fabric_harness: Harness) -> None:
        _check(fabric_harness, _other_case, OTHER_FIELDS)

    @pytest.mark.fabric_seeds(1)
    def test_fuzzed_descriptor_bytes_are_refused(self, fabric_harness: Harness) -> None:
        """Random, truncated, bit-flipped, re-versioned, re-counted or extended descriptor
        bytes: ``from_bytes``/``from_json`` refuse them with ``ConfigError`` naming the
        descriptor; a well-formed descriptor with another NIC count is refused by the write."""
        _check(fabric_harness, _descriptor_case, DESCRIPTOR_FIELDS)

    @pytest.mark.fabric_seeds(1)
    def test_fuzzed_registration_is_refused(self, fabric_harness: Harness) -> None:
        """Non-contiguous numpy arrays and torch tensors, empty buffers, read-only memory
        asked to be writable, bad raw pointers and lengths, bad device strings, CUDA memory
        on a host-only backend, unsupported objects: refused, nothing registered."""
        _check(fabric_harness, _register_case, REGISTER_FIELDS)
