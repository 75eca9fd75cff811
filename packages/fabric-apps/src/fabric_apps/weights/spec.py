"""Sharding metadata of the weight update: parameters, how each fleet shards them, and where
each rank's pieces sit in its one registered buffer.

Both fleets (the training ranks that send, the inference ranks that receive) describe the
same parameters — name, global shape, dtype — and how *they* shard each one:

==================  =========================================================================
sharding            what rank ``r`` of a group of ``g`` ranks holds
==================  =========================================================================
``Replicated()``    the whole tensor
``FsdpShard()``     the tensor flattened (C order) and cut into ``g`` chunks of
                    ``c = ceil(numel / g)`` elements: elements ``[r*c, min((r+1)*c, numel))``.
                    The local piece is ``c`` elements on every rank (FSDP pads the flat
                    shard); the last ranks' pieces hold fewer real elements (possibly none),
                    and their padding is never read nor written by a plan
``TensorParallel``  a slice along ``dim`` as ``torch.chunk`` / DTensor ``Shard(dim)`` cut it:
                    ``c = ceil(size / g)`` indices, rank ``r`` holds ``[r*c, min((r+1)*c,
                    size))`` (the last ranks shorter or empty), no padding. ``tp_row()`` is
                    dim 0, ``tp_column()`` dim 1 (Megatron's ColumnParallelLinear splits
                    dim 0 of the ``[out, in]`` weight: that is ``tp_row()`` here)
``ExpertPlacement`` a stacked ``[E, ...]`` tensor; rank ``r`` holds the experts listed for it,
                    stacked in that order (an expert may live on several ranks: redundant
                    experts are replicas the planner can choose from)
==================  =========================================================================

``replicas`` (on ``FsdpShard`` and ``TensorParallel``) splits the fleet into that many groups
of consecutive ranks, each holding a whole copy sharded among its ``g = world / replicas``
ranks: HSDP, or data parallel x tensor parallel with TP ranks consecutive. FSDP2's
per-parameter ``Shard(0)`` is ``TensorParallel(dim=0)`` geometry.

A rank keeps all its pieces in **one contiguous buffer** (``LocalLayout``): parameters in the
fleet's order, each local piece C-contiguous at an offset aligned to ``FleetSpec.align``
bytes. At a destination this buffer *is* the inference engine's parameter memory:
``layout.views(buffer)`` gives one torch tensor per parameter, in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args

import numpy as np

from fabric_core.errors import ConfigError

from . import _torch

__all__ = [
    "DType",
    "ExpertPlacement",
    "FleetSpec",
    "FsdpShard",
    "LayoutEntry",
    "LocalLayout",
    "ParamSpec",
    "Replicated",
    "Runs",
    "Sharding",
    "TensorParallel",
    "itemsize",
    "sharding_from_dict",
    "tp_column",
    "tp_row",
]

logger = logging.getLogger(__name__)

DType = Literal[
    "float64",
    "float32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
]
_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"})

IntArray = np.ndarray[Any, np.dtype[np.int64]]
_I64 = np.int64


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a name of ``DType``)."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype!r} is not one of {list(get_args(DType))}") from None


def _int(value: object, what: str, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise ConfigError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class Runs:
    """Where a rank's piece of a parameter comes from, in elements: run ``i`` is the global
    (C-order flat) elements ``[start[i], start[i] + length[i])``, held at local element offset
    ``local[i]``. Runs are sorted by ``start``, disjoint, and never empty."""

    start: IntArray
    length: IntArray
    local: IntArray

    @property
    def elements(self) -> int:
        return int(self.length.sum())


def _runs(start: IntArray, length: IntArray, local: IntArray) -> Runs:
    """Sort by start, drop empty runs and merge runs contiguous on both sides."""
    keep = length > 0
    start, length, local = start[keep], length[keep], local[keep]
    order = np.argsort(start, kind="stable")
    start, length, local = start[order], length[order], local[order]
    if start.size > 1:
        joined = (start[:-1] + length[:-1] == start[1:]) & (local[:-1] + length[:-1] == local[1:])
        first = np.flatnonzero(np.concatenate(([True], ~joined)))
        start, local = start[first], local[first]
        length = np.add.reduceat(length, first)
    return Runs(start.astype(_I64), length.astype(_I64), local.astype(_I64))


_EMPTY = _runs(np.zeros(0, _I64), np.zeros(0, _I64), np.zeros(0, _I64))


def _group(world: int, replicas: int, rank: int) -> tuple[int, int]:
    """(ranks per group, index of ``rank`` inside its group)."""
    g = world // replicas
    return g, rank % g


class _Sharding(ABC):
    """How one fleet shards one parameter (see the module docstring)."""

    __slots__ = ()
    kind: str

    @abstractmethod
    def check(self, shape: tuple[int, ...], world: int, name: str) -> None:
        """Raise ``ConfigError`` if this sharding cannot apply to ``shape`` over ``world`` ranks."""

    @abstractmethod
    def local_shape(self, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
        """Shape of rank ``rank``'s local piece (its bytes in the rank's buffer)."""

    @abstractmethod
    def runs(self, shape: tuple[int, ...], world: int, rank: int) -> Runs:
        """Which global elements rank ``rank`` holds, and where in its local piece."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]: ...

    def layout_class(self, world: int, rank: int) -> Hashable:
        """Ranks with equal classes hold the same elements at the same local offsets
        (replicas): the planner computes each class once."""
        return rank % (world // getattr(self, "replicas", 1))

    def describe(self) -> str:
        return self.kind


def _check_replicas(replicas: int, world: int, name: str, kind: str) -> None:
    if world % replicas:
        raise ConfigError(
            f"{name}: {kind} with replicas={replicas} needs a world size divisible by it, got {world}"
        )


@dataclass(frozen=True, slots=True)
class Replicated(_Sharding):
    """Every rank holds the whole tensor."""

    kind: Literal["replicated"] = field(default="replicated", init=False)

    def check(self, shape: tuple[int, ...], world: int, name: str) -> None:
        return None

    def local_shape(self, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
        return shape

    def runs(self, shape: tuple[int, ...], world: int, rank: int) -> Runs:
        n = math.prod(shape)
        return _runs(np.array([0], _I64), np.array([n], _I64), np.array([0], _I64))

    def layout_class(self, world: int, rank: int) -> Hashable:
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True, slots=True)
class FsdpShard(_Sharding):
    """Flat FSDP shard: the flattened tensor cut into ``world / replicas`` padded chunks."""

    replicas: int = 1
    kind: Literal["fsdp"] = field(default="fsdp", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", _int(self.replicas, "FsdpShard.replicas", low=1))

    def check(self, shape: tuple[int, ...], world: int, name: str) -> None:
        _check_replicas(self.replicas, world, name, "FsdpShard")

    def chunk(self, shape: tuple[int, ...], world: int) -> int:
        """Elements per rank's flat piece (padding included)."""
        return -(-math.prod(shape) // (world // self.replicas))

    def local_shape(self, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
        return (self.chunk(shape, world),)

    def runs(self, shape: tuple[int, ...], world: int, rank: int) -> Runs:
        n = math.prod(shape)
        _g, i = _group(world, self.replicas, rank)
        c = self.chunk(shape, world)
        lo = min(i * c, n)
        hi = min(lo + c, n)
        return _runs(np.array([lo], _I64), np.array([hi - lo], _I64), np.array([0], _I64))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "replicas": self.replicas}

    def describe(self) -> str:
        return "fsdp" if self.replicas == 1 else f"fsdp(replicas={self.replicas})"


@dataclass(frozen=True, slots=True)
class TensorParallel(_Sharding):
    """A slice along ``dim`` per rank (``torch.chunk`` cut), ``replicas`` groups of copies.

    ``sections``: a fused tensor (QKV, gate and up), its sizes along ``dim`` in order. Each
    section is cut across the ranks on its own and a rank holds its slices of all of them,
    back to back in section order: an inference engine's fused projection, whose rank r holds
    ``[q_r; k_r; v_r]``, not rows ``[r n / W, (r + 1) n / W)`` of the fused tensor. Empty
    (the default): the whole size along ``dim`` is one section."""

    dim: int
    replicas: int = 1
    sections: tuple[int, ...] = ()
    kind: Literal["tp"] = field(default="tp", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", _int(self.dim, "TensorParallel.dim"))
        object.__setattr__(self, "replicas", _int(self.replicas, "TensorParallel.replicas", low=1))
        if isinstance(self.sections, (str, bytes)) or not hasattr(self.sections, "__iter__"):
            raise ConfigError(f"TensorParallel.sections must be a sequence of ints, got {self.sections!r}")
        sections = tuple(_int(x, "TensorParallel.sections entry", low=1) for x in self.sections)
        object.__setattr__(self, "sections", sections)

    def check(self, shape: tuple[int, ...], world: int, name: str) -> None:
        if self.dim >= len(shape):
            raise ConfigError(
                f"{name}: TensorParallel(dim={self.dim}) needs a tensor of at least {self.dim + 1} "
                f"dimensions, the shape is {shape}"
            )
        if self.sections and sum(self.sections) != shape[self.dim]:
            raise ConfigError(
                f"{name}: the sections {list(self.sections)} add up to {sum(self.sections)}, "
                f"but dimension {self.dim} of {shape} is {shape[self.dim]}"
            )
        _check_replicas(self.replicas, world, name, "TensorParallel")

    def _slices(self, shape: tuple[int, ...], world: int, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s ``[lo, hi)`` along ``dim`` in each section, in global indices."""
        g, i = _group(world, self.replicas, rank)
        out, base = [], 0
        for size in self.sections or (shape[self.dim],):
            c = -(-size // g)
            lo = min(i * c, size)
            out.append((base + lo, base + min(lo + c, size)))
            base += size
        return out

    def local_shape(self, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
        n = sum(hi - lo for lo, hi in self._slices(shape, world, rank))
        return (*shape[: self.dim], n, *shape[self.dim + 1 :])

    def runs(self, shape: tuple[int, ...], world: int, rank: int) -> Runs:
        slices = self._slices(shape, world, rank)
        outer, inner = math.prod(shape[: self.dim]), math.prod(shape[self.dim + 1 :])
        rows = sum(hi - lo for lo, hi in slices)
        if rows == 0 or outer == 0 or inner == 0:
            return _EMPTY
        o = np.arange(outer, dtype=_I64)
        starts, lengths, locals_ = [], [], []
        done = 0
        for lo, hi in slices:
            starts.append(o * (shape[self.dim] * inner) + lo * inner)
            lengths.append(np.full(outer, (hi - lo) * inner, _I64))
            locals_.append(o * (rows * inner) + done * inner)
            done += hi - lo
        return _runs(np.concatenate(starts), np.concatenate(lengths), np.concatenate(locals_))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "dim": self.dim, "replicas": self.replicas}
        if self.sections:
            out["sections"] = list(self.sections)
        return out

    def describe(self) -> str:
        rep = "" if self.replicas == 1 else f", replicas={self.replicas}"
        sec = "" if not self.sections else ", sections=" + "+".join(map(str, self.sections))
        return f"tp(dim={self.dim}{rep}{sec})"


@dataclass(frozen=True, slots=True)
class ExpertPlacement(_Sharding):
    """A stacked ``[E, ...]`` tensor: ``experts[r]`` lists the experts rank ``r`` holds, in
    the order they are stacked in its local piece ``[len(experts[r]), ...]``."""

    experts: tuple[tuple[int, ...], ...]
    kind: Literal["experts"] = field(default="experts", init=False)

    def __post_init__(self) -> None:
        try:
            placed = tuple(tuple(_int(e, "expert index") for e in rank) for rank in self.experts)
        except TypeError:
            raise ConfigError("ExpertPlacement.experts must be a sequence of sequences of ints") from None
        object.__setattr__(self, "experts", placed)

    @classmethod
    def contiguous(cls, num_experts: int, world: int, *, replicas: int = 1) -> ExpertPlacement:
        """Expert parallelism as usually laid out: ``ceil(E / g)`` consecutive experts per rank
        of each group of ``g = world / replicas`` consecutive ranks."""
        num_experts = _int(num_experts, "num_experts", low=1)
        world = _int(world, "world", low=1)
        _check_replicas(_int(replicas, "replicas", low=1), world, "ExpertPlacement", "contiguous")
        g = world // replicas
        per = -(-num_experts // g)
        return cls(
            tuple(
                tuple(range(min(i * per, num_experts), min((i + 1) * per, num_experts)))
                for i in (r % g for r in range(world))
            )
        )

    def check(self, shape: tuple[int, ...], world: int, name: str) -> None:
        if not shape:
            raise ConfigError(f"{name}: an expert placement needs a stacked [E, ...] tensor, not a scalar")
        if len(self.experts) != world:
            raise ConfigError(
                f"{name}: the expert placement lists {len(self.experts)} ranks, the fleet has {world}"
            )
        for r, held in enumerate(self.experts):
            if len(set(held)) != len(held):
                raise ConfigError(f"{name}: rank {r} lists an expert twice: {held}")
            bad = [e for e in held if e >= shape[0]]
            if bad:
                raise ConfigError(f"{name}: rank {r} holds expert {bad[0]} but the tensor has {shape[0]}")

    def local_shape(self, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
        return (len(self.experts[rank]), *shape[1:])

    def layout_class(self, world: int, rank: int) -> Hashable:
        return self.experts[rank]

    def runs(self, shape: tuple[int, ...], world: int, rank: int) -> Runs:
        held = np.array(self.experts[rank], _I64)
        inner = math.prod(shape[1:])
        slots = np.arange(held.size, dtype=_I64)
        return _runs(held * inner, np.full(held.size, inner, _I64), slots * inner)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "experts": [list(e) for e in self.experts]}

    def describe(self) -> str:
        return f"experts({sum(len(e) for e in self.experts)} placed)"


Sharding = Union[Replicated, FsdpShard, TensorParallel, ExpertPlacement]
_SHARDINGS: tuple[type[_Sharding], ...] = (Replicated, FsdpShard, TensorParallel, ExpertPlacement)


def tp_row(replicas: int = 1, sections: tuple[int, ...] = ()) -> TensorParallel:
    """Split dim 0 (the rows of a ``[out, in]`` weight: Megatron's ColumnParallelLinear);
    ``sections``: a fused projection's parts (vLLM's QKVParallelLinear, MergedColumnParallelLinear)."""
    return TensorParallel(0, replicas, tuple(sections))


def tp_column(replicas: int = 1) -> TensorParallel:
    """Split dim 1 (the columns of a ``[out, in]`` weight: Megatron's RowParallelLinear)."""
    return TensorParallel(1, replicas)


def sharding_from_dict(data: Any) -> Sharding:
    """The sharding ``to_dict()`` wrote; ``ConfigError`` for anything else."""
    if not isinstance(data, dict) or "kind" not in data:
        raise ConfigError(f"not a sharding: {data!r}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    kind = data["kind"]
    try:
        if kind == "replicated" and not fields:
            return Replicated()
        if kind == "fsdp":
            return FsdpShard(**fields)
        if kind == "tp":
            return TensorParallel(**fields)
        if kind == "experts":
            return ExpertPlacement(**fields)
    except TypeError as exc:
        raise ConfigError(f"bad {kind} sharding {data!r}: {exc}") from None
    raise ConfigError(f"unknown sharding {data!r}")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as one fleet holds it: global ``shape``, ``dtype`` and ``sharding``."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    sharding: Sharding = field(default_factory=Replicated)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a parameter name must be a non-empty str, got {self.name!r}")
        if isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__iter__"):
            raise ConfigError(f"{self.name}: shape must be a sequence of ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(_int(s, f"{self.name}: shape entry") for s in self.shape))
        itemsize(self.dtype)
        if not isinstance(self.sharding, _SHARDINGS):
            raise ConfigError(
                f"{self.name}: sharding must be Replicated, FsdpShard, TensorParallel or "
                f"ExpertPlacement, got {type(self.sharding).__name__}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "sharding": self.sharding.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ParamSpec:
        if not isinstance(data, dict) or set(data) != {"name", "shape", "dtype", "sharding"}:
            raise ConfigError(f"not a parameter spec: {data!r}")
        return cls(data["name"], tuple(data["shape"]), data["dtype"], sharding_from_dict(data["sharding"]))


@dataclass(frozen=True, slots=True)
class LayoutEntry:
    """One parameter's local piece in a rank's buffer: ``nbytes`` at ``offset``."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True)
class LocalLayout:
    """Where each local piece sits in rank ``rank``'s one contiguous buffer of ``nbytes``."""

    rank: int
    nbytes: int
    entries: tuple[LayoutEntry, ...]
    _index: dict[str, LayoutEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {e.name: e for e in self.entries})

    def __getitem__(self, name: str) -> LayoutEntry:
        try:
            return self._index[name]
        except KeyError:
            raise ConfigError(f"rank {self.rank}'s layout has no parameter {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def allocate(self, device: str = "cpu") -> Any:
        """A zeroed torch ``uint8`` tensor of ``nbytes`` (this layout's buffer)."""
        torch = _torch.module()
        return torch.zeros(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buffer: Any) -> dict[str, Any]:
        """One torch tensor per parameter (local shape and dtype), sharing ``buffer``'s memory."""
        raw = _torch.byte_view(buffer)
        if raw.numel() < self.nbytes:
            raise ConfigError(
                f"the buffer holds {raw.numel()} bytes, rank {self.rank}'s layout needs {self.nbytes}"
            )
        return {
            e.name: raw[e.offset : e.offset + e.nbytes].view(_torch.dtype(e.dtype)).view(e.shape)
            for e in self.entries
        }


@dataclass(frozen=True)
class FleetSpec:
    """One fleet (the training ranks, or the inference ranks): its world size and every
    parameter as it shards it. Parameters are packed in this order, each local piece at an
    offset aligned to ``align`` bytes (a power of two, at least 8)."""

    world_size: int
    params: tuple[ParamSpec, ...]
    align: int = 256
    _index: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)
    _layouts: dict[int, LocalLayout] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        world = _int(self.world_size, "world_size", low=1)
        object.__setattr__(self, "world_size", world)
        align = _int(self.align, "align", low=8)
        if align & (align - 1):
            raise ConfigError(f"align must be a power of two, got {align}")
        params = tuple(self.params)
        for p in params:
            if not isinstance(p, ParamSpec):
                raise ConfigError(f"params must be ParamSpec, got {type(p).__name__}")
            p.sharding.check(p.shape, world, p.name)
        index: dict[str, ParamSpec] = {}
        for p in params:
            if p.name in index:
                raise ConfigError(f"parameter {p.name!r} is listed twice")
            index[p.name] = p
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_layouts", {})

    def __getitem__(self, name: str) -> ParamSpec:
        try:
            return self._index[name]
        except KeyError:
            raise ConfigError(f"the fleet has no parameter {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @property
    def nbytes(self) -> int:
        """Bytes of one whole copy of every parameter."""
        return sum(p.nbytes for p in self.params)

    def layout(self, rank: int) -> LocalLayout:
        """Rank ``rank``'s buffer: each local piece at the next ``align``-aligned offset."""
        rank = _int(rank, "rank")
        if rank >= self.world_size:
            raise ConfigError(f"rank {rank} is outside [0, {self.world_size})")
        cached = self._layouts.get(rank)
        if cached is not None:
            return cached
        entries, off = [], 0
        for p in self.params:
            off = -(-off // self.align) * self.align
            shape = p.sharding.local_shape(p.shape, self.world_size, rank)
            nbytes = math.prod(shape) * p.itemsize
            entries.append(LayoutEntry(p.name, off, nbytes, shape, p.dtype))
            off += nbytes
        layout = LocalLayout(rank, max(self.align, -(-off // self.align) * self.align), tuple(entries))
        self._layouts[rank] = layout
        return layout

    # --- wire form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "align": self.align,
            "params": [p.to_dict() for p in self.params],
        }

    @classmethod
    def from_dict(cls, data: Any) -> FleetSpec:
        if not isinstance(data, dict) or set(data) != {"world_size", "align", "params"}:
            raise ConfigError("not a fleet spec document")
        if not isinstance(data["params"], list):
            raise ConfigError("a fleet spec's params must be a list")
        return cls(data["world_size"], tuple(ParamSpec.from_dict(p) for p in data["params"]), data["align"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> FleetSpec:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"not a fleet spec document: {exc}") from None
        return cls.from_dict(data)

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: two ranks agree on the spec iff digests match."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()
