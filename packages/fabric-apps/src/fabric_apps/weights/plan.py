"""The static transfer plan: computed once from both fleets' metadata, replayed every step.

``make_plan(source, destination, options)`` answers, deterministically: which source rank
copies which byte range of its buffer to which destination rank at which offset, over which
NIC, and whether the bytes are cast on the way. The steps:

1. **Runs.** Ranks of a fleet that hold a parameter the same way (replicas, a replicated
   tensor) form one *layout class*, computed once. Each parameter is cut into elementary
   intervals at every boundary of every class's holdings; for each destination rank, each
   interval it needs has a set of *holders* (source ranks). An interval nobody holds is a
   ``ConfigError``.
2. **Sources.** Intervals with one holder go to it. Those held by a class of replicas form
   one *unit* per (parameter, destination), handed out largest first to the least loaded
   holder (bytes so far; ties rotate over the holders with the destination rank, so
   destinations spread over equal replicas); a unit of at least ``2 * split_bytes`` is cut
   into up to one piece per holder (pieces of at least ``split_bytes``), so a big replicated
   tensor is read from several replicas at once.
3. **Coalescing.** Copies from one source to one destination that are adjacent in both
   buffers (and share a cast) become one write: adjacent parameters packed in the same
   order, whole TP slices, neighbouring experts.
4. **Packing and splitting.** A series of copies shorter than ``pack_bytes``, from one
   source to one destination, back to back at the destination and equally spaced at the
   source (a TP column slice of row-major rows: one copy per row), becomes one packed row
   (``src_stride``, ``count``) that the sender gathers in its staging pool. A write is cut
   at ``max_write_bytes`` (the senders' largest work request, so every write is exactly one
   work request and one imm at its target); a write that is cast or packed is cut into
   staging chunks of ``chunk_bytes`` (whole elements, whole pieces); a large write is cut
   into up to one piece per NIC (pieces of at least ``nic_split_bytes``, 4 KiB aligned).
5. **Routing.** Writes are placed on NICs largest first, each on the NIC where its source's
   and its destination's bytes so far sum lowest, so both ends spread over every NIC.

The result is a ``TransferPlan``: one row per write, as parallel integer columns, sorted by
(source, destination, NIC, cast, destination offset). Every destination byte that holds
parameter data is written by exactly one row; alignment gaps and FSDP padding never are. A
plan serializes (``to_bytes``/``to_json``), compares by value, has a ``digest()`` that ranks
compare to agree on it, and ``explain()`` prints what it does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Hashable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fabric_core.errors import ConfigError

from .imms import DEFAULT_IMM_BASE, ImmScheme
from .spec import FLOAT_DTYPES, FleetSpec, LocalLayout, ParamSpec, Runs, itemsize

__all__ = ["PlanBalance", "PlanEntry", "PlanOptions", "TransferPlan", "make_plan"]

logger = logging.getLogger(__name__)

IntArray = np.ndarray[Any, np.dtype[np.int64]]
_I64 = np.int64
COLUMNS = ("src_rank", "src_offset", "dst_rank", "dst_offset", "length", "nic", "cast", "src_stride", "count")
_ALIGN = 4096  # NIC pieces of a raw write are cut at multiples of this
_MAGIC = b"FWPL"
_VERSION = 2  # 2: packed rows (src_stride, count)
_HEAD = struct.Struct("<4sBI")
_CRC = struct.Struct("<I")


def _int(value: object, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be an int, got {value!r}")
    v = int(value)
    if v < low or (high is not None and v > high):
        raise ConfigError(f"{what} must be in [{low}, {high if high is not None else 'inf'}], got {v}")
    return v


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Knobs of ``make_plan``.

    ``num_nics``: NICs per rank (both fleets use the same count). ``max_write_bytes``: the
    largest write (at most the senders' ``max_msg_size``). ``staging_bytes``: the staging
    watermark of each sender, the most memory cast bytes may occupy at once;
    ``stage_chunk_bytes`` (0: a quarter of it) the size of one staged write. ``split_bytes``:
    smallest piece a replicated run is cut into across its holders. ``nic_split_bytes``:
    smallest piece a write is cut into across NICs. ``imm_base``: first of the plan's 2**24
    imm values (see ``fabric_apps.weights.imms``). ``pack_bytes``: copies shorter than this
    that form a strided series (a TP column slice of row-major source rows) are packed into
    one staged write (0: never).
    """

    num_nics: int = 1
    max_write_bytes: int = 1 << 30
    staging_bytes: int = 64 << 20
    stage_chunk_bytes: int = 0
    split_bytes: int = 1 << 20
    nic_split_bytes: int = 1 << 20
    imm_base: int = DEFAULT_IMM_BASE
    pack_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        _int(self.num_nics, "num_nics", 1, 64)
        _int(self.max_write_bytes, "max_write_bytes", 64)
        staging = _int(self.staging_bytes, "staging_bytes", 64)
        chunk = _int(self.stage_chunk_bytes, "stage_chunk_bytes", 0, staging)
        if 0 < chunk < 8:
            raise ConfigError(f"stage_chunk_bytes must be 0 or at least 8, got {chunk}")
        _int(self.split_bytes, "split_bytes", 1)
        _int(self.nic_split_bytes, "nic_split_bytes", 1)
        _int(self.pack_bytes, "pack_bytes", 0)
        ImmScheme(self.imm_base)

    @property
    def chunk_bytes(self) -> int:
        """Largest staged (cast) write."""
        return self.stage_chunk_bytes or self.staging_bytes // 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> PlanOptions:
        if not isinstance(data, dict):
            raise ConfigError(f"not plan options: {data!r}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"not plan options: {exc}") from None


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One write of a plan: ``length`` bytes at ``dst_offset`` of destination ``dst_rank``'s
    buffer, from ``src_length`` bytes at ``src_offset`` of source ``src_rank``'s buffer (the
    same bytes, or the same elements in another dtype when ``cast`` names the pair). A packed
    write (``count`` > 1) reads ``count`` equal pieces, piece ``i`` at ``src_offset + i *
    src_stride``, and writes them back to back."""

    src_rank: int
    src_offset: int
    src_length: int
    dst_rank: int
    dst_offset: int
    length: int
    nic: int
    cast: tuple[str, str] | None
    src_stride: int = 0
    count: int = 1

    @property
    def staged(self) -> bool:
        """Goes through the sender's staging pool (cast or packed)."""
        return self.cast is not None or self.count > 1


@dataclass(frozen=True, slots=True)
class PlanBalance:
    """How evenly a plan loads the ranks and NICs (bytes on the wire).

    Imbalances are max / mean (1.0 is perfect): ``source_imbalance`` over source ranks,
    ``source_nic_imbalance`` over every (source rank, NIC), ``destination_nic_imbalance``
    over every (destination rank, NIC).
    """

    bytes_per_source: tuple[int, ...]
    bytes_per_destination: tuple[int, ...]
    bytes_per_source_nic: tuple[tuple[int, ...], ...]
    bytes_per_destination_nic: tuple[tuple[int, ...], ...]
    writes_per_source: tuple[int, ...]
    source_imbalance: float
    source_nic_imbalance: float
    destination_nic_imbalance: float


def _ratio(values: IntArray) -> float:
    mean = float(values.mean()) if values.size else 0.0
    return float(values.max()) / mean if mean > 0 else 1.0


class TransferPlan:
    """The writes that turn the source fleet's buffers into the destination fleet's.

    Built by ``make_plan`` (or ``from_bytes``/``from_json``); immutable. Columns (numpy
    int64, read-only, one row per write): ``src_rank``, ``src_offset``, ``dst_rank``,
    ``dst_offset``, ``length`` (bytes written at the destination), ``nic``, ``cast`` (index
    into ``casts``, -1 for a plain copy), ``src_stride`` and ``count`` (a packed write:
    ``count`` equal pieces read ``src_stride`` bytes apart; 0 and 1 otherwise).
    """

    __slots__ = (
        "_bounds",
        "_imms",
        "casts",
        "columns",
        "destination",
        "options",
        "source",
    )

    def __init__(
        self,
        source: FleetSpec,
        destination: FleetSpec,
        options: PlanOptions,
        casts: tuple[tuple[str, str], ...],
        columns: dict[str, IntArray],
    ) -> None:
        self.source, self.destination, self.options = source, destination, options
        self.casts = tuple((str(a), str(b)) for a, b in casts)
        if set(columns) != set(COLUMNS):
            raise ConfigError(f"a plan has the columns {COLUMNS}, got {sorted(columns)}")
        cols: dict[str, IntArray] = {}
        n = None
        for name in COLUMNS:
            arr = np.ascontiguousarray(columns[name], dtype=_I64)
            if arr.ndim != 1 or (n is not None and arr.size != n):
                raise ConfigError(f"plan column {name} must be one-dimensional, as long as the others")
            n = arr.size
            arr.flags.writeable = False
            cols[name] = arr
        self.columns = cols
        self._check()
        S, D = source.world_size, destination.world_size
        src, dst = cols["src_rank"], cols["dst_rank"]
        self._bounds = np.searchsorted(src, np.arange(S + 1, dtype=_I64))
        self._imms = np.bincount(dst * S + src, minlength=D * S).reshape(D, S).astype(_I64)

    # --- validation ------------------------------------------------------------------------
    def _check(self) -> None:
        c = self.columns
        S, D = self.source.world_size, self.destination.world_size
        for a, b in self.casts:
            itemsize(a)
            itemsize(b)
        checks = (
            ("src_rank", 0, S - 1),
            ("dst_rank", 0, D - 1),
            ("nic", 0, self.options.num_nics - 1),
            ("cast", -1, len(self.casts) - 1),
            ("length", 1, self.options.max_write_bytes),
            ("src_offset", 0, None),
            ("dst_offset", 0, None),
            ("src_stride", 0, None),
            ("count", 1, None),
        )
        for name, low, high in checks:
            col = c[name]
            if col.size and (int(col.min()) < low or (high is not None and int(col.max()) > high)):
                raise ConfigError(f"plan column {name} holds values outside [{low}, {high}]")
        if c["src_rank"].size > 1 and (np.diff(c["src_rank"]) < 0).any():
            raise ConfigError("plan rows must be sorted by source rank")
        packed = c["count"] > 1
        if (c["length"][packed] % c["count"][packed]).any():
            raise ConfigError("a packed plan row's length must be a multiple of its count")
        s_end = c["src_offset"] + self.src_lengths() // c["count"] + (c["count"] - 1) * c["src_stride"]
        d_end = c["dst_offset"] + c["length"]
        s_size = np.array([self.source.layout(r).nbytes for r in range(S)], _I64)
        d_size = np.array([self.destination.layout(r).nbytes for r in range(D)], _I64)
        if (s_end > s_size[c["src_rank"]]).any() or (d_end > d_size[c["dst_rank"]]).any():
            raise ConfigError("a plan row reaches beyond its rank's buffer")

    def _itemsizes(self) -> tuple[IntArray, IntArray]:
        """Source and destination item sizes per cast index + 1 (index 0: plain bytes)."""
        s = np.array([1] + [itemsize(a) for a, _ in self.casts], _I64)
        d = np.array([1] + [itemsize(b) for _, b in self.casts], _I64)
        return s, d

    def src_lengths(self) -> IntArray:
        """Bytes each row reads at its source (``length`` converted to the source dtype; a
        packed row reads them in ``count`` pieces)."""
        s, d = self._itemsizes()
        k = self.columns["cast"] + 1
        out: IntArray = self.columns["length"] // d[k] * s[k]
        return out

    # --- inspection --------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.columns["length"].size)

    @property
    def imms(self) -> ImmScheme:
        return ImmScheme(self.options.imm_base, self.source.world_size)

    def imm(self, step: int, source: int) -> int:
        """The imm value of ``source``'s writes of ``step``."""
        return self.imms.imm(step, source)

    def rows(self, *, src: int | None = None, dst: int | None = None) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Boolean mask of the rows from ``src`` and/or to ``dst``."""
        mask = np.ones(len(self), bool)
        if src is not None:
            mask &= self.columns["src_rank"] == src
        if dst is not None:
            mask &= self.columns["dst_rank"] == dst
        return mask

    def source_rows(self, src: int) -> slice:
        """The rows of source rank ``src`` (rows are sorted by source)."""
        return slice(int(self._bounds[src]), int(self._bounds[src + 1]))

    def entries(self, *, src: int | None = None, dst: int | None = None) -> Iterator[PlanEntry]:
        """The writes (all, or from ``src`` and/or to ``dst``) as ``PlanEntry`` objects."""
        c = self.columns
        src_len = self.src_lengths()
        for i in np.flatnonzero(self.rows(src=src, dst=dst)).tolist():
            k = int(c["cast"][i])
            yield PlanEntry(
                int(c["src_rank"][i]),
                int(c["src_offset"][i]),
                int(src_len[i]),
                int(c["dst_rank"][i]),
                int(c["dst_offset"][i]),
                int(c["length"][i]),
                int(c["nic"][i]),
                None if k < 0 else self.casts[k],
                int(c["src_stride"][i]),
                int(c["count"][i]),
            )

    def expected_imms(self, dst: int) -> dict[int, int]:
        """Per source rank, the imms destination ``dst`` counts for one step (writes to it:
        each is one work request carrying the imm). Sources that send it nothing are absent."""
        row = self._imms[dst]
        return {int(s): int(row[s]) for s in np.flatnonzero(row)}

    def imm_matrix(self) -> IntArray:
        """``[destination, source]`` imm counts of one step."""
        out: IntArray = self._imms.copy()
        return out

    def destination_ranges(self, dst: int, src: int | None = None) -> list[tuple[int, int]]:
        """``(offset, length)`` of the bytes of ``dst``'s buffer the plan writes (from ``src``
        only, if given), sorted and merged where adjacent."""
        mask = self.rows(src=src, dst=dst)
        off, ln = self.columns["dst_offset"][mask], self.columns["length"][mask]
        order = np.argsort(off, kind="stable")
        out: list[tuple[int, int]] = []
        for o, n in zip(off[order].tolist(), ln[order].tolist(), strict=True):
            if out and out[-1][0] + out[-1][1] == o:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((o, n))
        return out

    def balance(self) -> PlanBalance:
        c = self.columns
        S, D, N = self.source.world_size, self.destination.world_size, self.options.num_nics
        w = c["length"]
        per_src = np.bincount(c["src_rank"], weights=w, minlength=S).astype(_I64)
        per_dst = np.bincount(c["dst_rank"], weights=w, minlength=D).astype(_I64)
        src_nic = np.bincount(c["src_rank"] * N + c["nic"], weights=w, minlength=S * N).astype(_I64)
        dst_nic = np.bincount(c["dst_rank"] * N + c["nic"], weights=w, minlength=D * N).astype(_I64)
        writes = np.bincount(c["src_rank"], minlength=S).astype(_I64)
        return PlanBalance(
            tuple(per_src.tolist()),
            tuple(per_dst.tolist()),
            tuple(tuple(r) for r in src_nic.reshape(S, N).tolist()),
            tuple(tuple(r) for r in dst_nic.reshape(D, N).tolist()),
            tuple(writes.tolist()),
            _ratio(per_src),
            _ratio(src_nic),
            _ratio(dst_nic),
        )

    @property
    def total_bytes(self) -> int:
        """Bytes on the wire per step."""
        return int(self.columns["length"].sum())

    def staged_rows(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Rows that go through the senders' staging pools: cast or packed."""
        return (self.columns["cast"] >= 0) | (self.columns["count"] > 1)

    @property
    def staged_bytes(self) -> int:
        """Bytes per step that go through senders' staging pools (cast or packed)."""
        return int(self.columns["length"][self.staged_rows()].sum())

    @property
    def packed_bytes(self) -> int:
        """Bytes per step written by packed rows (strided pieces gathered at the source)."""
        return int(self.columns["length"][self.columns["count"] > 1].sum())

    def explain(self, max_rows: int = 32) -> str:
        """A human-readable summary: sizes, writes, casts, imms, balance, per-rank tables."""
        c, b, o = self.columns, self.balance(), self.options
        S, D = self.source.world_size, self.destination.world_size
        staged = self.staged_rows()
        lines = [
            f"weights plan {self.digest()[:12]}: {S} source ranks -> {D} destination ranks, "
            f"{o.num_nics} NIC{'s' if o.num_nics > 1 else ''} per rank, "
            f"{len(self.destination.params)} parameters",
            f"  per step: {_size(self.total_bytes)} in {len(self)} writes "
            f"(at most {_size(o.max_write_bytes)} each; one imm per write)",
        ]
        if self.casts:
            pairs = ", ".join(f"{a}->{b}" for a, b in self.casts)
            lines.append(
                f"  cast at the source: {pairs}: {_size(self.staged_bytes)} through a staging pool of "
                f"{_size(o.staging_bytes)} in chunks of at most {_size(o.chunk_bytes)}"
            )
        packed = c["count"] > 1
        if packed.any():
            lines.append(
                f"  packed at the source: {_size(self.packed_bytes)} in {int(packed.sum())} writes gathered "
                f"from {int(c['count'][packed].sum())} strided pieces (copies under {_size(o.pack_bytes)})"
            )
        lines += [
            f"  {self.imms.describe()}",
            f"  balance (max/mean): source bytes {b.source_imbalance:.3f}, source NIC bytes "
            f"{b.source_nic_imbalance:.3f}, destination NIC bytes {b.destination_nic_imbalance:.3f}",
            "  source   bytes        writes  staged       destinations  bytes per NIC",
        ]
        for s in range(min(S, max_rows)):
            sl = self.source_rows(s)
            dsts = np.unique(c["dst_rank"][sl]).size
            st = int(c["length"][sl][staged[sl]].sum())
            nics = " ".join(_size(x) for x in b.bytes_per_source_nic[s])
            lines.append(
                f"  {s:<8} {_size(b.bytes_per_source[s]):<12} {b.writes_per_source[s]:<7} {_size(st):<12} "
                f"{dsts:<13} {nics}"
            )
        if max_rows < S:
            lines.append(f"  ... {S - max_rows} more source ranks")
        lines.append("  dest     bytes        imms    from sources")
        for d in range(min(D, max_rows)):
            exp = self.expected_imms(d)
            lines.append(
                f"  {d:<8} {_size(b.bytes_per_destination[d]):<12} {sum(exp.values()):<7} "
                f"{' '.join(map(str, sorted(exp)))}"
            )
        if max_rows < D:
            lines.append(f"  ... {D - max_rows} more destination ranks")
        lines.append(f"  {'parameter':<33} {'shape':<16} {'dtype':<25} source -> destination")
        for p in self.destination.params[:max_rows]:
            ps = self.source[p.name]
            dt = p.dtype if ps.dtype == p.dtype else f"{ps.dtype}->{p.dtype}"
            lines.append(
                f"  {p.name:<33} {'x'.join(map(str, p.shape)) or 'scalar':<16} {dt:<25} "
                f"{ps.sharding.describe()} -> {p.sharding.describe()}"
            )
        if len(self.destination.params) > max_rows:
            lines.append(f"  ... {len(self.destination.params) - max_rows} more parameters")
        return "\n".join(lines)

    # --- value semantics and wire form ---------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferPlan):
            return NotImplemented
        return (
            self.source == other.source
            and self.destination == other.destination
            and self.options == other.options
            and self.casts == other.casts
            and all(np.array_equal(self.columns[k], other.columns[k]) for k in COLUMNS)
        )

    __hash__ = None  # type: ignore[assignment]

    def _header(self) -> dict[str, Any]:
        return {
            "version": _VERSION,
            "source": self.source.to_dict(),
            "destination": self.destination.to_dict(),
            "options": self.options.to_dict(),
            "casts": [list(p) for p in self.casts],
            "rows": len(self),
        }

    def to_bytes(self) -> bytes:
        """Compact checksummed form: magic, version, JSON header, little-endian int64 columns."""
        head = json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode()
        body = b"".join(
            [_HEAD.pack(_MAGIC, _VERSION, len(head)), head]
            + [self.columns[k].astype("<i8").tobytes() for k in COLUMNS]
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransferPlan:
        data = bytes(data)
        if len(data) < _HEAD.size + _CRC.size or data[:4] != _MAGIC:
            raise ConfigError("not a weights plan (bad magic or truncated)")
        _, version, n_head = _HEAD.unpack_from(data)
        if version != _VERSION:
            raise ConfigError(f"weights plan version {version}, this library reads {_VERSION}")
        (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
        if zlib.crc32(data[: -_CRC.size]) != crc:
            raise ConfigError("weights plan corrupted: checksum mismatch")
        start = _HEAD.size + n_head
        try:
            head = json.loads(data[_HEAD.size : start])
            rows = int(head["rows"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"weights plan header unreadable: {exc}") from None
        if len(data) - _CRC.size - start != rows * 8 * len(COLUMNS):
            raise ConfigError("weights plan truncated: the columns do not match the header")
        cols = np.frombuffer(data, "<i8", rows * len(COLUMNS), start).reshape(len(COLUMNS), rows)
        return cls._from_header(head, {k: cols[i].astype(_I64) for i, k in enumerate(COLUMNS)})

    @classmethod
    def _from_header(cls, head: Any, columns: dict[str, IntArray]) -> TransferPlan:
        try:
            return cls(
                FleetSpec.from_dict(head["source"]),
                FleetSpec.from_dict(head["destination"]),
                PlanOptions.from_dict(head["options"]),
                tuple((a, b) for a, b in head["casts"]),
                columns,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"not a weights plan: {exc!r}") from None

    def to_json(self) -> str:
        """Readable form: the header plus every column as a list."""
        doc = self._header()
        doc["columns"] = {k: self.columns[k].tolist() for k in COLUMNS}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> TransferPlan:
        try:
            doc = json.loads(text)
            if doc.get("version") != _VERSION:
                raise ConfigError(f"weights plan version {doc.get('version')}, this library reads {_VERSION}")
            cols = {k: np.asarray(doc["columns"][k], dtype=_I64).reshape(-1) for k in COLUMNS}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"not a weights plan document: {exc!r}") from None
        return cls._from_header(doc, cols)

    def digest(self) -> str:
        """SHA-256 of ``to_bytes()``: ranks that computed the plan apart compare this."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def __repr__(self) -> str:
        return (
            f"<TransferPlan {self.source.world_size}->{self.destination.world_size} ranks, "
            f"{len(self)} writes, {_size(self.total_bytes)}>"
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# --- the planner -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Classes:
    """One fleet's ranks grouped by layout class for one parameter: ranks of a class hold
    the same elements at the same local offsets (replicas), so each class is computed once."""

    ranks: list[list[int]]
    of_rank: list[int]
    runs: list[Runs]


def _classes(p: ParamSpec, world: int) -> _Classes:
    ids: dict[Hashable, int] = {}
    ranks: list[list[int]] = []
    runs: list[Runs] = []
    of_rank: list[int] = []
    for r in range(world):
        key = p.sharding.layout_class(world, r)
        c = ids.get(key)
        if c is None:
            c = ids[key] = len(ranks)
            ranks.append([])
            runs.append(p.sharding.runs(p.shape, world, r))
        ranks[c].append(r)
        of_rank.append(c)
    return _Classes(ranks, of_rank, runs)


def _cover(runs: Runs, lo: IntArray) -> tuple[IntArray, IntArray]:
    """The elementary intervals (sorted starts ``lo``, cut at every run boundary) that
    ``runs`` holds, and their local element offsets; work in proportion to the answer."""
    if runs.start.size == 0:
        return np.zeros(0, _I64), np.zeros(0, _I64)
    a = np.searchsorted(lo, runs.start)
    count = np.searchsorted(lo, runs.start + runs.length) - a
    rep = np.repeat(np.arange(count.size), count)
    first = np.cumsum(count) - count
    idx: IntArray = a[rep] + (np.arange(rep.size, dtype=_I64) - first[rep])
    local: IntArray = runs.local[rep] + lo[idx] - runs.start[rep]
    return idx, local


@dataclass(frozen=True, slots=True)
class _Unit:
    """Runs of one parameter that one destination rank needs and several source ranks hold
    (replicas): handed out as a whole, or cut across holders when large."""

    param: int
    dst: int
    holders: IntArray  # source ranks, ascending
    src_local: np.ndarray[Any, np.dtype[np.int64]]  # [holder, run] element offsets (may broadcast)
    dst_local: IntArray  # [run]
    count: IntArray  # [run] elements
    s_base: IntArray  # [source rank] byte offset of the parameter's local piece
    d_base: int
    s_isz: int
    d_isz: int
    cast: int

    @property
    def nbytes(self) -> int:
        return int(self.count.sum()) * self.d_isz


def _source_param(source: FleetSpec, pd: ParamSpec) -> ParamSpec:
    if pd.name not in source:
        raise ConfigError(f"destination parameter {pd.name!r} is not among the source fleet's parameters")
    ps = source[pd.name]
    if ps.shape != pd.shape:
        raise ConfigError(f"{pd.name}: shape {ps.shape} at the source, {pd.shape} at the destination")
    if ps.dtype != pd.dtype and not (ps.dtype in FLOAT_DTYPES and pd.dtype in FLOAT_DTYPES):
        raise ConfigError(
            f"{pd.name}: cannot cast {ps.dtype} to {pd.dtype}: only floating dtypes are cast "
            "(integer and bool parameters must match)"
        )
    return ps


class _Rows:
    """Column lists while planning."""

    def __init__(self) -> None:
        self.parts: dict[str, list[IntArray]] = {k: [] for k in ("src", "soff", "dst", "doff", "len", "cast")}

    def add(
        self, src: IntArray, soff: IntArray, dst: int, doff: IntArray, length: IntArray, cast: int
    ) -> None:
        n = src.size
        self.parts["src"].append(src.astype(_I64))
        self.parts["soff"].append(soff.astype(_I64))
        self.parts["dst"].append(np.full(n, dst, _I64))
        self.parts["doff"].append(doff.astype(_I64))
        self.parts["len"].append(length.astype(_I64))
        self.parts["cast"].append(np.full(n, cast, _I64))

    def arrays(self) -> dict[str, IntArray]:
        return {k: (np.concatenate(v) if v else np.zeros(0, _I64)) for k, v in self.parts.items()}


def _param_rows(
    pi: int,
    ps: ParamSpec,
    pd: ParamSpec,
    cast: int,
    src_layouts: list[LocalLayout],
    dst_layouts: list[LocalLayout],
    rows: _Rows,
    loads: IntArray,
    units: list[_Unit],
) -> None:
    """Rows of one parameter whose runs have one holder; a ``_Unit`` per replicated run set."""
    S, D = len(src_layouts), len(dst_layouts)
    s_isz, d_isz = ps.itemsize, pd.itemsize
    src, dst = _classes(ps, S), _classes(pd, D)
    every = src.runs + dst.runs
    cuts = np.unique(
        np.concatenate(
            [np.array([0, pd.numel], _I64)] + [r.start for r in every] + [r.start + r.length for r in every]
        )
    )
    lo, ln = cuts[:-1], np.diff(cuts)
    # which source classes hold each elementary interval (sparse, sorted by interval)
    covers = [_cover(r, lo) for r in src.runs]
    t_idx = np.concatenate([c[0] for c in covers])
    t_cls = np.concatenate([np.full(c[0].size, k, _I64) for k, c in enumerate(covers)])
    t_loc = np.concatenate([c[1] for c in covers])
    order = np.lexsort((t_cls, t_idx))
    t_idx, t_cls, t_loc = t_idx[order], t_cls[order], t_loc[order]
    held_by = np.bincount(t_idx, minlength=lo.size)
    first_holder = np.cumsum(held_by) - held_by
    alone = np.array([r[0] if len(r) == 1 else -1 for r in src.ranks], _I64)
    s_base = np.array([src_layouts[s][pd.name].offset for s in range(S)], _I64)
    dst_cover = [_cover(r, lo) for r in dst.runs]
    for d in range(D):
        idx, dl = dst_cover[dst.of_rank[d]]
        if not idx.size:
            continue
        cnt = held_by[idx]
        nobody = np.flatnonzero(cnt == 0)
        if nobody.size:
            j = int(idx[nobody[0]])
            raise ConfigError(
                f"{pd.name}: destination rank {d} needs elements [{int(lo[j])}, {int(lo[j] + ln[j])}) "
                "that no source rank holds (check the source sharding: an expert placed nowhere?)"
            )
        d_base = dst_layouts[d][pd.name].offset
        cls = t_cls[first_holder[idx]]
        sl = t_loc[first_holder[idx]]
        one_class = cnt == 1
        fixed = one_class & (alone[cls] >= 0)
        if fixed.any():
            s = alone[cls[fixed]]
            length = ln[idx[fixed]] * d_isz
            rows.add(s, s_base[s] + sl[fixed] * s_isz, d, d_base + dl[fixed] * d_isz, length, cast)
            loads += np.bincount(s, weights=length, minlength=S).astype(_I64)
        shared = one_class & ~fixed
        for c in np.unique(cls[shared]).tolist():  # one class of replicas: one unit
            m = shared & (cls == c)
            hs = np.array(src.ranks[c], _I64)
            units.append(
                _Unit(pi, d, hs, np.broadcast_to(sl[m], (hs.size, int(m.sum()))), dl[m], ln[idx[m]],
                      s_base, d_base, s_isz, d_isz, cast)
            )  # fmt: skip
        for j in np.flatnonzero(cnt > 1).tolist():  # held by several classes (redundant experts)
            i = int(idx[j])
            k0, k1 = int(first_holder[i]), int(first_holder[i] + cnt[j])
            pairs = sorted((r, int(t_loc[k])) for k in range(k0, k1) for r in src.ranks[int(t_cls[k])])
            units.append(
                _Unit(pi, d, np.array([r for r, _ in pairs], _I64), np.array([[x] for _, x in pairs], _I64),
                      dl[j : j + 1], ln[i : i + 1], s_base, d_base, s_isz, d_isz, cast)
            )  # fmt: skip


def _assign(units: list[_Unit], rows: _Rows, loads: IntArray, split_bytes: int) -> None:
    """Hand units out largest first to their least loaded holders (ties rotate over the
    holders with the destination); a unit of at least ``2 * split_bytes`` is cut into up to
    one piece per holder, of at least ``split_bytes`` each."""
    units.sort(key=lambda u: (-u.nbytes, u.param, u.dst, int(u.dst_local[0])))
    for u in units:
        k = u.holders.size
        total = int(u.count.sum())
        parts = max(1, min(k, u.nbytes // split_bytes, total))
        turn = (np.arange(k, dtype=_I64) - u.dst) % k
        ranked = np.lexsort((turn, loads[u.holders]))[:parts]
        start = np.cumsum(u.count) - u.count
        for j, h in enumerate(ranked.tolist()):
            b0, b1 = total * j // parts, total * (j + 1) // parts
            st = np.maximum(start, b0)
            en = np.minimum(start + u.count, b1)
            keep = en > st
            off = (st - start)[keep]
            length = (en - st)[keep] * u.d_isz
            s = int(u.holders[h])
            rows.add(
                np.full(off.size, s, _I64),
                u.s_base[s] + (u.src_local[h][keep] + off) * u.s_isz,
                u.dst,
                u.d_base + (u.dst_local[keep] + off) * u.d_isz,
                length,
                u.cast,
            )
            loads[s] += int(length.sum())


def make_plan(source: FleetSpec, destination: FleetSpec, options: PlanOptions | None = None) -> TransferPlan:
    """The static plan that writes every destination rank's layout from the source fleet.

    Deterministic: the same inputs give the same plan (``digest()``) on every rank and run.
    Raises ``ConfigError`` when a destination parameter is missing at the source, has another
    shape, cannot be cast, or needs elements no source rank holds.
    """
    options = options or PlanOptions()
    if not isinstance(source, FleetSpec) or not isinstance(destination, FleetSpec):
        raise ConfigError("make_plan takes two FleetSpec (source fleet, destination fleet)")
    S, D = source.world_size, destination.world_size
    src_layouts = [source.layout(r) for r in range(S)]
    dst_layouts = [destination.layout(r) for r in range(D)]
    casts: list[tuple[str, str]] = []
    rows = _Rows()
    loads = np.zeros(S, _I64)
    units: list[_Unit] = []
    for pi, pd in enumerate(destination.params):
        ps = _source_param(source, pd)
        if pd.numel == 0:
            continue
        cast = -1
        if ps.dtype != pd.dtype:
            if (ps.dtype, pd.dtype) not in casts:
                casts.append((ps.dtype, pd.dtype))
            cast = casts.index((ps.dtype, pd.dtype))
        _param_rows(pi, ps, pd, cast, src_layouts, dst_layouts, rows, loads, units)
    _assign(units, rows, loads, options.split_bytes)
    s_isz_of = np.array([1] + [itemsize(a) for a, _ in casts], _I64)
    d_isz_of = np.array([1] + [itemsize(b) for _, b in casts], _I64)
    cols = _coalesce(rows.arrays(), s_isz_of, d_isz_of)
    cols = _pack(cols, min(options.pack_bytes, options.max_write_bytes, options.chunk_bytes))
    cols = _split(cols, options, s_isz_of, d_isz_of)
    nic = _route(cols, options.num_nics, S, D)
    order = np.lexsort((cols["doff"], cols["cast"], nic, cols["dst"], cols["src"]))
    columns = {
        "src_rank": cols["src"][order],
        "src_offset": cols["soff"][order],
        "dst_rank": cols["dst"][order],
        "dst_offset": cols["doff"][order],
        "length": cols["len"][order],
        "nic": nic[order],
        "cast": cols["cast"][order],
        "src_stride": cols["stride"][order],
        "count": cols["count"][order],
    }
    plan = TransferPlan(source, destination, options, tuple(casts), columns)
    logger.debug("weights: planned %r", plan)
    return plan


def _coalesce(c: dict[str, IntArray], s_isz: IntArray, d_isz: IntArray) -> dict[str, IntArray]:
    """Join rows adjacent in both buffers (same source, destination and cast)."""
    if c["len"].size < 2:
        return c
    order = np.lexsort((c["soff"], c["cast"], c["dst"], c["src"]))
    c = {k: v[order] for k, v in c.items()}
    k = c["cast"] + 1
    slen = c["len"] // d_isz[k] * s_isz[k]
    same = (
        (c["src"][1:] == c["src"][:-1])
        & (c["dst"][1:] == c["dst"][:-1])
        & (c["cast"][1:] == c["cast"][:-1])
        & (c["soff"][:-1] + slen[:-1] == c["soff"][1:])
        & (c["doff"][:-1] + c["len"][:-1] == c["doff"][1:])
    )
    first = np.flatnonzero(np.concatenate(([True], ~same)))
    out = {key: v[first] for key, v in c.items() if key != "len"}
    out["len"] = np.add.reduceat(c["len"], first)
    return out


def _pack(c: dict[str, IntArray], below: int) -> dict[str, IntArray]:
    """Join series of short copies (under ``below`` bytes: one piece always fits a write and
    a staging chunk) from one source to one destination,
    with one cast, of equal length, back to back at the destination and equally spaced at the
    source (a TP column slice read from row-major rows: one copy per row), into packed rows:
    the sender gathers the pieces into a staging slot and writes them as one."""
    n = c["len"].size
    c = {**c, "stride": np.zeros(n, _I64), "count": np.ones(n, _I64)}
    if below <= 0 or n < 2:
        return c
    cand = np.flatnonzero(c["len"] < below)
    if cand.size < 2:
        return c
    order = cand[np.lexsort((c["doff"][cand], c["cast"][cand], c["dst"][cand], c["src"][cand]))]
    src, dst, cast = c["src"][order], c["dst"][order], c["cast"][order]
    soff, doff, ln = c["soff"][order], c["doff"][order], c["len"][order]
    # link i: row i+1 can follow row i in one series (the stride must then stay the same)
    link = (
        (src[1:] == src[:-1])
        & (dst[1:] == dst[:-1])
        & (cast[1:] == cast[:-1])
        & (ln[1:] == ln[:-1])
        & (doff[:-1] + ln[:-1] == doff[1:])
        & (soff[1:] > soff[:-1])
    )
    step = np.diff(soff)
    starts, counts, strides = [], [], []
    i, m = 0, order.size
    links, steps = link.tolist(), step.tolist()
    while i < m:
        j = i
        while j + 1 < m and links[j] and (j == i or steps[j] == steps[i]):
            j += 1
        starts.append(i)
        counts.append(j - i + 1)
        strides.append(steps[i] if j > i else 0)
        i = j + 1
    first = np.array(starts, _I64)
    count = np.array(counts, _I64)
    series = count > 1
    if not series.any():
        return c
    rows = order[first]
    out = {k: np.delete(v, order) for k, v in c.items()}  # every candidate leaves, its series return
    joined = {k: v[rows] for k, v in c.items()}
    joined["len"] = joined["len"] * count
    joined["stride"] = np.where(series, np.array(strides, _I64), 0)
    joined["count"] = count
    return {k: np.concatenate([out[k], joined[k]]) for k in c}


def _split(c: dict[str, IntArray], o: PlanOptions, s_isz: IntArray, d_isz: IntArray) -> dict[str, IntArray]:
    """Cut rows at ``max_write_bytes``, staged rows (cast or packed) into staging chunks of
    whole elements or whole pieces, large rows over NICs."""
    length = c["len"]
    if not length.size:
        return c
    k = c["cast"] + 1
    packed = c["count"] > 1
    # a unit advances ``di`` destination bytes and ``si`` source bytes; a packed row's unit is
    # one piece (its destination bytes, and the stride at the source)
    di = np.where(packed, length // c["count"], d_isz[k])
    si = np.where(packed, c["stride"], s_isz[k])
    raw = (c["cast"] < 0) & ~packed
    unit = np.where(raw, _ALIGN, di)
    cap = np.where(raw, o.max_write_bytes, np.maximum(di, min(o.max_write_bytes, o.chunk_bytes) // di * di))
    over_nics = np.minimum(o.num_nics, np.maximum(1, length // o.nic_split_bytes)) if o.num_nics > 1 else 1
    n = np.maximum(-(-length // cap), over_nics)
    n = -(-n // over_nics) * over_nics  # a multiple of the NICs it spreads over: equal shares
    per = -(-length // n)  # ceil(length / n), rounded up to the unit below
    size = np.minimum(cap, -(-per // unit) * unit)
    pieces = -(-length // size)
    if int(pieces.max()) == 1:
        return c
    rep = np.repeat(np.arange(length.size), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(rep.size, dtype=_I64) - np.repeat(first, pieces)
    off = j * size[rep]
    return {
        "src": c["src"][rep],
        "soff": c["soff"][rep] + off // di[rep] * si[rep],
        "dst": c["dst"][rep],
        "doff": c["doff"][rep] + off,
        "len": np.minimum(size[rep], length[rep] - off),
        "cast": c["cast"][rep],
        "stride": c["stride"][rep],
        "count": np.where(packed[rep], np.minimum(size[rep], length[rep] - off) // di[rep], 1),
    }


def _route(c: dict[str, IntArray], nics: int, S: int, D: int) -> IntArray:
    """A NIC per row: largest first, where source NIC + destination NIC bytes are lowest."""
    n = c["len"].size
    if nics == 1 or n == 0:
        return np.zeros(n, _I64)
    order = np.lexsort((c["doff"], c["dst"], c["src"], -c["len"]))
    src_load = [[0] * nics for _ in range(S)]
    dst_load = [[0] * nics for _ in range(D)]
    out = np.zeros(n, _I64)
    srcs, dsts, lens = c["src"].tolist(), c["dst"].tolist(), c["len"].tolist()
    for i in order.tolist():
        sl, dl, ln = src_load[srcs[i]], dst_load[dsts[i]], lens[i]
        total = [a + b for a, b in zip(sl, dl, strict=True)]
        best = total.index(min(total))  # the lowest such NIC
        sl[best] += ln
        dl[best] += ln
        out[i] = best
    return out
