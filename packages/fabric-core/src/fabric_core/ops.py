"""Requests, routing, and the plan that cuts a request into work requests.

The plan is the single source of the counting rule: each work request (WR) that carries an
imm is counted once at its target, so ``imms_per_target`` of a plan is what each target
will count. The rule depends only on the request, the group's NIC count and the largest
message size, never on which NICs are alive: a failed NIC's share moves to a live one but
the number of WRs stays the same.

Cutting rules
-------------
* single write, ``Sharded(k)``: the bytes are cut into at most ``k`` contiguous shards of
  ``round_up(ceil(len / k), 4096)`` bytes (so no shard is empty; a zero-length write is one
  WR), one shard per NIC starting at a rotating NIC;
* ``Pinned(i)``: everything on NIC ``i``;
* paged write: one WR per page; ``Sharded(k)`` gives each of ``k`` NICs a contiguous range
  of the page list;
* scatter: ``ShardPeers`` puts each target whole on one NIC (round robin), ``Sharded(k)``
  shards every target's bytes like a single write;
* imm-only: one zero-length WR; barrier: one per destination;
* every shard longer than ``max_msg_size`` is cut again into pieces of at most that size;
  each piece is a WR and carries the imm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from .counters import check_imm
from .errors import ConfigError
from .memory import index_array
from .models import DomainAddress, MemoryRegion, MemoryRegionDescriptor

__all__ = [
    "SHARD_ALIGN",
    "BarrierRequest",
    "ImmRequest",
    "Message",
    "PagedWriteRequest",
    "PeerGroup",
    "Pinned",
    "Plan",
    "Request",
    "Routing",
    "ScatterRequest",
    "ScatterTarget",
    "ShardPeers",
    "Sharded",
    "WriteRequest",
    "plan_request",
]

SHARD_ALIGN = 4096
_I64 = np.int64
_LIMIT = 1 << 63

IntArray = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True, slots=True)
class Sharded:
    """Shard bytes (or pages) over ``nics`` NICs of the group (None: all of them)."""

    nics: int | None = None


@dataclass(frozen=True, slots=True)
class Pinned:
    """Send everything through NIC ``nic`` of the group."""

    nic: int


@dataclass(frozen=True, slots=True)
class ShardPeers:
    """Scatter/barrier: each target whole on one NIC, targets spread round robin."""


Routing = Union[Sharded, Pinned, ShardPeers]


@dataclass(frozen=True, slots=True)
class PeerGroup:
    """Peers resolved once (address vectors / connections) and reused by scatters."""

    handle: int
    peers: tuple[DomainAddress, ...]
    _members: frozenset[bytes] = field(repr=False, default=frozenset())


@dataclass(frozen=True, slots=True)
class Message:
    """A two-sided control message received from ``peer``."""

    peer: DomainAddress
    data: bytes


@dataclass(frozen=True, slots=True)
class WriteRequest:
    src: MemoryRegion
    src_offset: int
    length: int
    dst: MemoryRegionDescriptor
    dst_offset: int = 0
    imm: int | None = None
    routing: Routing = Sharded()


@dataclass(frozen=True, slots=True)
class PagedWriteRequest:
    """Write ``page_length`` bytes from ``src_offset + src_pages[i] * src_stride`` to
    ``dst_offset + dst_pages[i] * dst_stride`` for every i; indices as numpy/torch/sequence."""

    src: MemoryRegion
    src_pages: Any
    src_stride: int
    dst: MemoryRegionDescriptor
    dst_pages: Any
    dst_stride: int
    page_length: int
    src_offset: int = 0
    dst_offset: int = 0
    imm: int | None = None
    routing: Routing = Sharded()


@dataclass(frozen=True, slots=True)
class ScatterTarget:
    dst: MemoryRegionDescriptor
    length: int
    src_offset: int = 0
    dst_offset: int = 0


@dataclass(frozen=True, slots=True)
class ScatterRequest:
    src: MemoryRegion
    targets: Sequence[ScatterTarget]
    imm: int | None = None
    routing: Routing = ShardPeers()
    group: PeerGroup | None = None


@dataclass(frozen=True, slots=True)
class ImmRequest:
    """A zero-length write carrying ``imm``: the target counts exactly one."""

    dst: MemoryRegionDescriptor
    imm: int
    routing: Routing = Sharded(1)


@dataclass(frozen=True, slots=True)
class BarrierRequest:
    """One imm to each destination: each counts exactly one."""

    dsts: Sequence[MemoryRegionDescriptor]
    imm: int
    routing: Routing = ShardPeers()


Request = Union[WriteRequest, PagedWriteRequest, ScatterRequest, ImmRequest, BarrierRequest]


@dataclass(frozen=True, slots=True)
class Plan:
    """Work requests of one request, as parallel arrays (one entry per WR)."""

    nic: IntArray
    target: IntArray
    src_off: IntArray
    dst_off: IntArray
    length: IntArray
    imm: int | None
    targets: tuple[MemoryRegionDescriptor, ...]
    imms_per_target: tuple[int, ...]

    @property
    def num_wrs(self) -> int:
        return int(self.nic.size)


def _int(value: object, what: str, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an int, got {type(value).__name__}")
    v = int(value)
    if v < (1 if positive else 0) or v >= _LIMIT:
        bound = "positive" if positive else "non-negative"
        raise ConfigError(f"{what} must be {bound} and below 2**63, got {v}")
    return v


def _check_dst(dst: object, num_nics: int, what: str = "dst") -> MemoryRegionDescriptor:
    if not isinstance(dst, MemoryRegionDescriptor):
        raise ConfigError(f"{what} must be a MemoryRegionDescriptor, got {type(dst).__name__}")
    if len(dst.nics) != num_nics:
        raise ConfigError(
            f"{what} descriptor has {len(dst.nics)} NIC keys but this engine's group has "
            f"{num_nics} NICs: both sides must use the same NIC count"
        )
    if not dst.writable:
        raise ConfigError(f"{what} descriptor names read-only memory: it cannot be written")
    return dst


def _check_src(src: object) -> MemoryRegion:
    if not isinstance(src, MemoryRegion):
        raise ConfigError(f"src must be a MemoryRegion of this engine, got {type(src).__name__}")
    return src


def _span(off: int, length: int, limit: int, what: str) -> None:
    if off + length >= _LIMIT:
        raise ConfigError(f"{what}: bytes [{off}, {off + length}) reach beyond 2**63")
    if off + length > limit:
        raise ConfigError(f"{what}: bytes [{off}, {off + length}) exceed the region's {limit} bytes")


def _nics(routing: object, num_nics: int, kind: str, *, allow_shard_peers: bool) -> tuple[str, int]:
    """Validate routing: returns ('shard', k), ('pin', nic) or ('peers', num_nics)."""
    if isinstance(routing, Sharded):
        if routing.nics is None:
            return "shard", num_nics
        k = _int(routing.nics, "Sharded.nics", positive=True)
        if k > num_nics:
            raise ConfigError(f"routing shards over {k} NICs but the group has {num_nics}")
        return "shard", k
    if isinstance(routing, Pinned):
        nic = _int(routing.nic, "Pinned.nic")
        if nic >= num_nics:
            raise ConfigError(f"routing pins NIC {nic} but the group has NICs 0..{num_nics - 1}")
        return "pin", nic
    if isinstance(routing, ShardPeers):
        if not allow_shard_peers:
            raise ConfigError(f"ShardPeers routes scatters and barriers, not a {kind}")
        return "peers", num_nics
    raise ConfigError(f"routing must be Sharded, Pinned or ShardPeers, got {type(routing).__name__}")


def _split(
    nic: IntArray, target: IntArray, src: IntArray, dst: IntArray, length: IntArray, max_msg: int
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Cut every entry longer than ``max_msg`` into pieces of at most ``max_msg``."""
    pieces = np.maximum(1, -(-length // max_msg))
    if int(pieces.max(initial=1)) == 1:
        return nic, target, src, dst, length
    rep = np.repeat(np.arange(length.size), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(rep.size) - np.repeat(first, pieces)
    off = j * max_msg
    ln = np.minimum(max_msg, length[rep] - off)
    return nic[rep], target[rep], src[rep] + off, dst[rep] + off, ln


def _shards(length: int, k: int) -> tuple[list[int], list[int]]:
    """Offsets and lengths of the shard rule: at most ``k`` shards of
    ``round_up(ceil(len / k), SHARD_ALIGN)`` bytes, never empty (zero bytes: one WR)."""
    if length == 0:
        return [0], [0]
    per_nic = -(-length // k)
    size = -(-per_nic // SHARD_ALIGN) * SHARD_ALIGN
    offs = list(range(0, length, size))
    return offs, [min(size, length - o) for o in offs]


def plan_request(request: Request, num_nics: int, max_msg_size: int, rotation: int = 0) -> Plan:
    """Validate ``request`` against its descriptors and cut it into work requests.

    Raises ``ConfigError`` (nothing posted) for any bad input. ``rotation`` picks the NIC
    the round robin starts at (it changes which NIC, never how many WRs).
    """
    if isinstance(max_msg_size, bool) or not isinstance(max_msg_size, int) or max_msg_size < 1:
        raise ConfigError(f"max_msg_size must be a positive int, got {max_msg_size!r}")
    if isinstance(request, WriteRequest):
        return _plan_write(request, num_nics, max_msg_size, rotation)
    if isinstance(request, PagedWriteRequest):
        return _plan_paged(request, num_nics, max_msg_size, rotation)
    if isinstance(request, ScatterRequest):
        return _plan_scatter(request, num_nics, max_msg_size, rotation)
    if isinstance(request, ImmRequest):
        return _plan_barrier([request.dst], request.imm, request.routing, num_nics, rotation, "imm")
    if isinstance(request, BarrierRequest):
        return _plan_barrier(request.dsts, request.imm, request.routing, num_nics, rotation, "barrier")
    raise ConfigError(f"not a fabric request: {type(request).__name__}")


def _imm(imm: object) -> int | None:
    return None if imm is None else check_imm(imm)


def _finish(
    parts: tuple[IntArray, IntArray, IntArray, IntArray, IntArray],
    imm: int | None,
    targets: tuple[MemoryRegionDescriptor, ...],
    max_msg: int,
) -> Plan:
    nic, target, src, dst, length = _split(*parts, max_msg)
    if imm is None:
        per_target = (0,) * len(targets)
    else:
        per_target = tuple(int(c) for c in np.bincount(target, minlength=len(targets)))
    return Plan(nic, target, src, dst, length, imm, targets, per_target)


def _plan_write(r: WriteRequest, n: int, max_msg: int, rot: int) -> Plan:
    src, dst = _check_src(r.src), _check_dst(r.dst, n)
    imm = _imm(r.imm)
    length = _int(r.length, "length")
    so, do = _int(r.src_offset, "src_offset"), _int(r.dst_offset, "dst_offset")
    _span(so, length, src.length, "source")
    _span(do, length, dst.length, "destination")
    mode, k = _nics(r.routing, n, "write", allow_shard_peers=False)
    if mode == "pin":
        offs, lens, nics = [0], [length], [k]
    else:
        offs, lens = _shards(length, k)
        nics = [(rot + i) % n for i in range(len(offs))]
    # one array for the five columns: a single allocation on the small-write hot path
    rows = np.array([nics, [0] * len(offs), [so + o for o in offs], [do + o for o in offs], lens], _I64)
    parts = (rows[0], rows[1], rows[2], rows[3], rows[4])
    if max(lens) > max_msg:  # pieces: the vectorised split
        return _finish(parts, imm, (dst,), max_msg)
    return Plan(*parts, imm, (dst,), (0 if imm is None else len(offs),))


def _plan_paged(r: PagedWriteRequest, n: int, max_msg: int, rot: int) -> Plan:
    src, dst = _check_src(r.src), _check_dst(r.dst, n)
    imm = _imm(r.imm)
    sp, dp = index_array(r.src_pages, "src_pages"), index_array(r.dst_pages, "dst_pages")
    if sp.size != dp.size:
        raise ConfigError(f"src_pages has {sp.size} entries but dst_pages has {dp.size}")
    if sp.size == 0:
        raise ConfigError("a paged write needs at least one page")
    plen = _int(r.page_length, "page_length")
    ss, ds = _int(r.src_stride, "src_stride"), _int(r.dst_stride, "dst_stride")
    so, do = _int(r.src_offset, "src_offset"), _int(r.dst_offset, "dst_offset")
    for name, idx in (("src_pages", sp), ("dst_pages", dp)):
        if int(idx.min()) < 0:
            raise ConfigError(f"{name} holds a negative index ({int(idx.min())})")
    _span(so + int(sp.max()) * ss, plen, src.length, f"source page {int(sp.max())}")
    _span(do + int(dp.max()) * ds, plen, dst.length, f"destination page {int(dp.max())}")
    if plen and dp.size > 1:
        if ds < plen:
            raise ConfigError(f"dst_stride {ds} is below page_length {plen}: destination pages overlap")
        if np.unique(dp).size != dp.size:
            raise ConfigError("dst_pages names a page twice: two writes would race on its bytes")
    mode, k = _nics(r.routing, n, "paged write", allow_shard_peers=False)
    count = sp.size
    # Sharded: NIC j of k takes the j-th contiguous range of the page list.
    spread = (rot + (np.arange(count, dtype=_I64) * k) // count) % n
    nic = np.full(count, k, _I64) if mode == "pin" else spread
    return _finish(
        (nic, np.zeros(count, _I64), so + sp * ss, do + dp * ds, np.full(count, plen, _I64)),
        imm,
        (dst,),
        max_msg,
    )


def _plan_scatter(r: ScatterRequest, n: int, max_msg: int, rot: int) -> Plan:
    src = _check_src(r.src)
    imm = _imm(r.imm)
    targets = tuple(r.targets)
    if not targets:
        raise ConfigError("a scatter needs at least one target")
    mode, k = _nics(r.routing, n, "scatter", allow_shard_peers=True)
    members = r.group._members if r.group is not None else None
    nics, tgt, so_l, do_l, ln_l = [], [], [], [], []
    for j, t in enumerate(targets):
        if not isinstance(t, ScatterTarget):
            raise ConfigError(f"targets[{j}] must be a ScatterTarget, got {type(t).__name__}")
        dst = _check_dst(t.dst, n, f"targets[{j}].dst")
        if members is not None and dst.peer.raw not in members:
            raise ConfigError(f"targets[{j}] is not a member of the peer group {r.group.handle}")  # type: ignore[union-attr]
        length = _int(t.length, f"targets[{j}].length")
        so, do = (
            _int(t.src_offset, f"targets[{j}].src_offset"),
            _int(t.dst_offset, f"targets[{j}].dst_offset"),
        )
        _span(so, length, src.length, f"targets[{j}] source")
        _span(do, length, dst.length, f"targets[{j}] destination")
        if mode == "shard":
            shard_offs, shard_lens = _shards(length, k)
            offs, lens = np.array(shard_offs, _I64), np.array(shard_lens, _I64)
            nic = (rot + j + np.arange(offs.size, dtype=_I64)) % n
        else:
            offs, lens = np.zeros(1, _I64), np.array([length], _I64)
            nic = np.full(1, k if mode == "pin" else (rot + j) % n, _I64)
        nics.append(nic)
        tgt.append(np.full(offs.size, j, _I64))
        so_l.append(so + offs)
        do_l.append(do + offs)
        ln_l.append(lens)
    parts = tuple(np.concatenate(a) for a in (nics, tgt, so_l, do_l, ln_l))
    return _finish(parts, imm, tuple(t.dst for t in targets), max_msg)  # type: ignore[arg-type]


def _plan_barrier(
    dsts: Sequence[MemoryRegionDescriptor], imm: object, routing: Routing, n: int, rot: int, kind: str
) -> Plan:
    value = check_imm(imm)
    targets = tuple(_check_dst(d, n, f"dsts[{j}]") for j, d in enumerate(dsts))
    if not targets:
        raise ConfigError(f"a {kind} needs at least one destination")
    mode, k = _nics(routing, n, kind, allow_shard_peers=True)
    count = len(targets)
    idx = np.arange(count, dtype=_I64)
    nic = np.full(count, k, _I64) if mode == "pin" else (rot + idx) % n
    zero = np.zeros(count, _I64)
    return _finish((nic, idx, zero, zero, zero), value, targets, 1 << 62)
