"""Paged KV-cache layouts: the tensors of one layer, and where each page of K, V or latent lives.

Inference engines keep the KV cache per layer, cut into pages (blocks) of ``block_size``
tokens. A ``KvLayout`` names the few numbers that fix every byte's place:

=============  ==================================================  ================================
``kv_split``   tensors per layer (shape)                           used by
=============  ==================================================  ================================
stacked        one ``[2, num_blocks, block_size, heads, head_dim]``  vLLM (flash-attn backends)
interleaved    one ``[num_blocks, 2, block_size, heads, head_dim]``  vLLM FlashInfer-style
separate       K and V, each ``[num_blocks * block_size, heads,      SGLang ``MHATokenToKVPool``
               head_dim]`` (or ``[num_blocks, block_size, ...]``)
latent         one ``[num_blocks, block_size, head_dim]`` (MLA,      vLLM / SGLang MLA (DeepSeek)
               ``heads == 1``; also ``[tokens, 1, head_dim]``)
=============  ==================================================  ================================

Inside a page the bytes are ``[block_size, heads, head_dim]`` in every layout, so a page of K
written from one layout lands as a page of K in another: a vLLM-style prefill instance can
feed an SGLang-style decode instance as long as their *page format* (layers, block size,
heads, head dim, dtype and segments) agrees. ``num_blocks`` is each instance's own.

A layer's pages are addressed by *segments*: ``k`` and ``v`` (or ``latent``), each with the
tensor that holds it, the byte offset of page 0 and the page stride. A paged write of one
segment moves ``page_bytes`` from ``offset + page * stride`` on each side.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, get_args

import numpy as np

from fabric_core.errors import ConfigError

__all__ = [
    "DType",
    "KvLayout",
    "KvSplit",
    "Segment",
    "WriteUnit",
    "deepseek_v3",
    "llama31_70b",
    "write_units",
]

logger = logging.getLogger(__name__)

KvSplit = Literal["stacked", "interleaved", "separate", "latent"]
DType = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]

_ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class Segment:
    """One page-addressable part of a layer's cache: ``k``, ``v`` or ``latent``.

    Page ``p`` of the segment is the ``page_bytes`` bytes at ``offset + p * stride`` of the
    layer's tensor number ``tensor``.
    """

    name: str
    tensor: int
    offset: int
    stride: int


@dataclass(frozen=True, slots=True)
class WriteUnit:
    """What one paged write per layer moves: the segments ``names``, ``length`` bytes per page,
    read with the prefill's geometry ``src`` and written with the decoder's ``dst`` (each a
    ``Segment`` whose page ``p`` starts at ``offset + p * stride``).

    ``shifts`` are ``(src, dst)`` page-index shifts, one per page set the write carries: a
    request's pages ``s -> d`` go as ``s + src -> d + dst`` for each shift, in one paged write.
    ``((0, 0),)`` (the default) is the plain write of the segment's pages; a stacked cache
    (``[2, num_blocks, ...]``) on both sides carries V as K's pages shifted by ``num_blocks``.
    """

    names: tuple[str, ...]
    src: Segment
    dst: Segment
    length: int
    shifts: tuple[tuple[int, int], ...] = ((0, 0),)

    def pages(self, src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The page lists of this unit's paged write for a request's ``src_pages -> dst_pages``."""
        if len(self.shifts) == 1 and self.shifts[0] == (0, 0):
            return src_pages, dst_pages
        return (
            np.concatenate([src_pages + s for s, _ in self.shifts]),
            np.concatenate([dst_pages + d for _, d in self.shifts]),
        )


def write_units(src: KvLayout, dst: KvLayout) -> tuple[WriteUnit, ...]:
    """The paged writes a prefill of layout ``src`` makes per layer to a decoder of layout
    ``dst``: one per segment, except where two segments can share one request on **both**
    sides:

    - consecutive segments lying back to back in one tensor, at one stride, go as one write
      per page: two interleaved caches (``[num_blocks, 2, ...]``) move a page's K and V in one
      64 KiB write for Llama-70B instead of two of 32 KiB;
    - a segment whose pages are another's shifted by a whole number of pages, past that
      segment's last page, in the same tensor at the same stride, rides in the other's request
      as a second page set (``WriteUnit.shifts``): two stacked caches (``[2, num_blocks, ...]``)
      move K and V of a layer in one paged request of twice the pages, still one 32 KiB write
      per page and segment. Half the requests: a Llama-70B request of 4,096 tokens is 80
      submits instead of 160.

    Any other pairing keeps one request per segment. Both sides compute this from the two
    layouts (the decoder learns the prefill's from its ACK), so the decoder's expected imm
    count and the prefill's writes agree. ``ConfigError`` if the page formats differ."""
    src.check_compatible(dst)
    page = src.page_bytes
    units: list[WriteUnit] = []
    for a, b in zip(src.segments, dst.segments, strict=True):
        if units:
            last = units[-1]
            grown = last.length + page
            if len(last.shifts) == 1 and all(
                new.tensor == old.tensor
                and new.stride == old.stride
                and new.offset == old.offset + last.length
                and old.stride >= grown
                for new, old in ((a, last.src), (b, last.dst))
            ):
                units[-1] = WriteUnit((*last.names, a.name), last.src, last.dst, grown)
                continue
            s_shift, d_shift = (
                _page_shift(last.src, a, src.num_blocks),
                _page_shift(last.dst, b, dst.num_blocks),
            )
            if last.length == page and s_shift is not None and d_shift is not None:
                units[-1] = WriteUnit(
                    (*last.names, a.name), last.src, last.dst, page, (*last.shifts, (s_shift, d_shift))
                )
                continue
        units.append(WriteUnit((a.name,), a, b, page))
    return tuple(units)


def _page_shift(base: Segment, seg: Segment, num_blocks: int) -> int | None:
    """How many pages ``seg``'s page 0 lies past ``base``'s, where ``seg`` is ``base``'s pages
    shifted (same tensor and stride, a whole number of strides, past ``base``'s last page, so
    no page of one is a page of the other); None otherwise."""
    if seg.tensor != base.tensor or seg.stride != base.stride or seg.offset <= base.offset:
        return None
    shift, rest = divmod(seg.offset - base.offset, base.stride)
    return shift if rest == 0 and shift >= num_blocks else None


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _describe(obj: Any) -> tuple[str, tuple[int, ...], bool, int, int]:
    """(dtype name, shape, C-contiguous, address, bytes) of a numpy array or torch tensor."""
    if _is_torch(obj):
        dtype = str(obj.dtype).removeprefix("torch.")
        nbytes = int(obj.numel()) * int(obj.element_size())
        return dtype, tuple(int(s) for s in obj.shape), bool(obj.is_contiguous()), int(obj.data_ptr()), nbytes
    if isinstance(obj, np.ndarray):
        # ml_dtypes names its dtypes as torch does ("bfloat16", "float8_e4m3fn")
        return obj.dtype.name, obj.shape, bool(obj.flags.c_contiguous), int(obj.ctypes.data), int(obj.nbytes)
    raise ConfigError(f"expected a numpy array or a torch tensor, got {type(obj).__name__}")


def _positive(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ConfigError(f"KvLayout.{what} must be a positive int, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The paged KV cache of one instance: ``num_layers`` layers of ``num_blocks`` pages.

    ``page_bytes`` (one page of one segment) and ``page_stride`` are derived. Bad values raise
    ``ConfigError``. ``check(caches)`` holds real tensors to the layout.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    kv_split: KvSplit

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _positive(getattr(self, name), name))
        if self.dtype not in _ITEMSIZE:
            raise ConfigError(f"KvLayout.dtype {self.dtype!r} is not one of {sorted(_ITEMSIZE)}")
        if self.kv_split not in get_args(KvSplit):
            raise ConfigError(f"KvLayout.kv_split {self.kv_split!r} is not one of {list(get_args(KvSplit))}")
        if self.kv_split == "latent" and self.num_kv_heads != 1:
            raise ConfigError(
                f"a latent (MLA) cache has one head per token, got num_kv_heads={self.num_kv_heads}: "
                "put the latent width (e.g. 512 + 64 = 576) in head_dim"
            )
        if self.num_blocks >= 1 << 32:
            raise ConfigError(f"num_blocks {self.num_blocks} does not fit the 32-bit page indices")

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def vllm(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: DType,
    ) -> KvLayout:
        """vLLM flash-attn layout: per layer ``[2, num_blocks, block_size, heads, head_dim]``."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "stacked")

    @classmethod
    def sglang(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: DType,
    ) -> KvLayout:
        """SGLang MHA pool: per layer a K and a V tensor of ``[num_blocks * block_size, heads, head_dim]``."""
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, "separate")

    @classmethod
    def mla(
        cls, *, num_layers: int, num_blocks: int, block_size: int, latent_dim: int, dtype: DType
    ) -> KvLayout:
        """An MLA latent cache: per layer ``[num_blocks, block_size, latent_dim]``."""
        return cls(num_layers, num_blocks, block_size, 1, latent_dim, dtype, "latent")

    def with_blocks(self, num_blocks: int) -> KvLayout:
        """The same page format over another number of pages (each instance sizes its own)."""
        return replace(self, num_blocks=num_blocks)

    # --- derived geometry --------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one segment: ``block_size * heads * head_dim * itemsize``."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_stride(self) -> int:
        """Bytes from a page of a segment to the next page of the same segment."""
        return 2 * self.page_bytes if self.kv_split == "interleaved" else self.page_bytes

    @property
    def tensors_per_layer(self) -> int:
        return 2 if self.kv_split == "separate" else 1

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return (
            ("k", "v")
            if self.kv_split == "separate"
            else ("kv",)
            if self.kv_split != "latent"
            else ("latent",)
        )

    @property
    def tensor_nbytes(self) -> int:
        """Bytes of each tensor of a layer."""
        per_segment = self.num_blocks * self.page_bytes
        return per_segment * (2 if self.kv_split in ("stacked", "interleaved") else 1)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments of every layer (each layer has the same geometry)."""
        p = self.page_bytes
        if self.kv_split == "stacked":
            return (Segment("k", 0, 0, p), Segment("v", 0, self.num_blocks * p, p))
        if self.kv_split == "interleaved":
            return (Segment("k", 0, 0, 2 * p), Segment("v", 0, p, 2 * p))
        if self.kv_split == "separate":
            return (Segment("k", 0, 0, p), Segment("v", 1, 0, p))
        return (Segment("latent", 0, 0, p),)

    @property
    def page_format(self) -> tuple[Any, ...]:
        """What two instances must share for pages to move between them (not ``num_blocks``)."""
        names = tuple(s.name for s in self.segments)
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, names)

    def accepted_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes a layer tensor may have (the first is the canonical one)."""
        nb, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        if self.kv_split == "stacked":
            return ((2, nb, bs, h, d),)
        if self.kv_split == "interleaved":
            return ((nb, 2, bs, h, d),)
        if self.kv_split == "separate":
            return ((nb * bs, h, d), (nb, bs, h, d))
        return ((nb, bs, d), (nb * bs, 1, d), (nb * bs, d), (nb, bs, 1, d))

    def check_compatible(self, other: KvLayout) -> None:
        """Raise ``ConfigError`` naming every field in which the page formats differ."""
        names = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "segments")
        diffs = [
            f"{n}: {a!r} here, {b!r} there"
            for n, a, b in zip(names, self.page_format, other.page_format, strict=True)
            if a != b
        ]
        if diffs:
            raise ConfigError(
                "KV page formats differ (" + "; ".join(diffs) + "): pages cannot move between them"
            )

    # --- checking real tensors -----------------------------------------------------------
    def check(self, caches: Any) -> tuple[tuple[Any, ...], ...]:
        """Hold ``caches`` to the layout; return them as one tuple of tensors per layer.

        ``caches`` is a sequence with one entry per layer: a tensor (or numpy array), or a
        ``(k, v)`` pair for ``kv_split="separate"``. A single tensor whose first dimension is
        the layer works too (its per-layer views are contiguous). Shape, dtype and contiguity
        are checked, and no two tensors may overlap in memory; a mismatch raises
        ``ConfigError`` saying what to fix.
        """
        if isinstance(caches, (str, bytes, dict)) or not hasattr(caches, "__len__"):
            raise ConfigError(
                f"caches must be a sequence with one entry per layer, got {type(caches).__name__}"
            )
        if len(caches) != self.num_layers:
            raise ConfigError(
                f"the layout has {self.num_layers} layers but {len(caches)} layer caches were given"
            )
        per = self.tensors_per_layer
        names = self.tensor_names
        layers: list[tuple[Any, ...]] = []
        spans: list[tuple[int, int, str]] = []
        for i in range(self.num_layers):
            entry = caches[i]
            tensors: tuple[Any, ...] = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
            if len(tensors) != per:
                want = "a (k, v) pair of tensors" if per == 2 else "one tensor"
                raise ConfigError(
                    f"layer {i}: kv_split={self.kv_split!r} keeps {want} per layer, got {len(tensors)}"
                )
            for name, t in zip(names, tensors, strict=True):
                span = self._check_tensor(i, name, t)
                # a meta tensor (a phantom simulator's cache: a shape, no memory) overlaps nothing
                if getattr(getattr(t, "device", None), "type", None) != "meta":
                    spans.append(span)
            layers.append(tensors)
        spans.sort()
        for (lo_a, hi_a, a), (lo_b, _hi_b, b) in itertools.pairwise(spans):
            if lo_b < hi_a:
                raise ConfigError(
                    f"{a} and {b} overlap in memory ([{lo_a:#x}, {hi_a:#x}) and from {lo_b:#x}): "
                    "every layer tensor must be its own memory"
                )
        return tuple(layers)

    def _check_tensor(self, layer: int, name: str, t: Any) -> tuple[int, int, str]:
        where = f"layer {layer} {name}"
        try:
            dtype, shape, contiguous, ptr, nbytes = _describe(t)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if dtype != self.dtype:
            raise ConfigError(
                f"{where}: dtype {dtype} but the layout says {self.dtype}: build the layout with "
                f"dtype={dtype!r} or pass the cache the engine really uses"
            )
        shapes = self.accepted_shapes()
        if shape not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise ConfigError(
                f"{where}: shape {shape} does not match the layout, which wants {want} "
                f"(kv_split={self.kv_split!r}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}): size the layout from "
                "the tensor, or pass the tensor in the layout's shape"
            )
        if not contiguous:
            raise ConfigError(
                f"{where}: the tensor is not contiguous: pages are addressed by byte offset, so pass "
                "the cache as the engine allocated it, not a transposed or sliced view"
            )
        if nbytes != self.tensor_nbytes:  # cannot happen for an accepted shape; kept as a guard
            raise ConfigError(f"{where}: {nbytes} bytes, the layout wants {self.tensor_nbytes}")
        return ptr, ptr + nbytes, where

    # --- wire form -----------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> KvLayout:
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise TypeError("not an object")
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"not a KvLayout document: {exc}") from None


def llama31_70b(num_blocks: int, *, kv_split: KvSplit = "stacked", block_size: int = 16) -> KvLayout:
    """Llama-3.1-70B: 80 layers, 8 KV heads (GQA), head dim 128, bf16, 16-token pages
    (32 KiB per page of K or V)."""
    return KvLayout(80, num_blocks, block_size, 8, 128, "bfloat16", kv_split)


def deepseek_v3(num_blocks: int, *, block_size: int = 64) -> KvLayout:
    """DeepSeek-V3 MLA: 61 layers, one 576-wide latent (512 compressed KV + 64 RoPE) per token,
    bf16, 64-token pages (72 KiB per page)."""
    return KvLayout(61, num_blocks, block_size, 1, 576, "bfloat16", "latent")
