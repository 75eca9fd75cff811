"""Disaggregated prefill→decode KV-cache transfer on the fabric contract.

The decode instance owns a paged KV cache (``KvDecoder``): per request it allocates pages
and one imm, tells the prefill instance where to write, and completes the request when one
counter has counted every imm of every page of every layer. The prefill instance
(``KvPrefiller``) writes the pages layer by layer with paged WriteImm as layers become ready.
Layouts (``KvLayout``) cover vLLM-style, SGLang-style and MLA caches. Instances join and
leave through a ``torch.distributed`` Store (``KvMembership``); a decoder routes over the
prefill instances that are up with a ``PrefillRouter``. The imm scheme is in
``fabric_apps.kvcache.imms``; the protocol in ``fabric_apps.kvcache.protocol``.
"""

from __future__ import annotations

from .allocator import AllocatorStats, PageAllocator, Pages, as_pages
from .decode import DecoderStats, KvDecoder, KvReceive
from .errors import (
    Exhausted,
    ImmsExhausted,
    PageLeak,
    PagesExhausted,
    PageStateError,
    RequestAborted,
    RequestCancelled,
)
from .imms import DEFAULT_IMM_BASE, DEFAULT_IMM_SLOTS, ImmPool, ImmPoolStats
from .layout import DType, KvLayout, KvSplit, Segment, WriteUnit, deepseek_v3, llama31_70b, write_units
from .membership import KvMembership, Member, MemberState, NoPrefill, PrefillRouter, Role
from .prefill import DecodeRequest, KvPrefiller, PrefillerStats, PrefillJob

__all__ = [
    # layouts
    "DType",
    "KvLayout",
    "KvSplit",
    "Segment",
    "WriteUnit",
    "deepseek_v3",
    "llama31_70b",
    "write_units",
    # pages and imms
    "AllocatorStats",
    "PageAllocator",
    "Pages",
    "as_pages",
    "DEFAULT_IMM_BASE",
    "DEFAULT_IMM_SLOTS",
    "ImmPool",
    "ImmPoolStats",
    # the two sides
    "DecoderStats",
    "KvDecoder",
    "KvReceive",
    "DecodeRequest",
    "KvPrefiller",
    "PrefillJob",
    "PrefillerStats",
    # membership
    "KvMembership",
    "Member",
    "MemberState",
    "PrefillRouter",
    "Role",
    # errors
    "Exhausted",
    "NoPrefill",
    "ImmsExhausted",
    "PageLeak",
    "PageStateError",
    "PagesExhausted",
    "RequestAborted",
    "RequestCancelled",
]
