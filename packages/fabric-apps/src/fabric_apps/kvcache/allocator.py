"""A page allocator over a paged KV cache: O(1) per page, all-or-nothing, double frees caught.

Free pages sit on a stack (a numpy array and a top index), so ``alloc(n)`` and ``free(pages)``
cost O(n) vector operations whatever the cache size, and a fresh allocator hands out
ascending runs. A per-page state array catches double frees and frees of pages never handed
out; every call validates first and changes nothing when it raises.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fabric_core.errors import ConfigError

from .errors import PageLeak, PagesExhausted, PageStateError

__all__ = ["AllocatorStats", "PageAllocator", "Pages", "as_pages"]

logger = logging.getLogger(__name__)

Pages = npt.NDArray[np.int64]

_FREE, _USED, _RESERVED = 0, 1, 2


def as_pages(pages: Any, what: str = "pages") -> Pages:
    """Page indices from a sequence, numpy array or torch tensor, as a 1-D int64 array."""
    if type(pages).__module__.startswith("torch") and hasattr(pages, "detach"):
        pages = pages.detach().to("cpu").numpy()
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise ConfigError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{what} must hold integers, got dtype {arr.dtype}")
    out: Pages = arr.astype(np.int64, copy=True)
    return out


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    capacity: int
    """Pages that can be handed out (the cache minus reserved pages)."""
    free: int
    used: int


class PageAllocator:
    """Hands out page indices in ``[0, num_pages)``, skipping ``reserved`` ones (e.g. SGLang's
    padding page 0). Thread-safe."""

    def __init__(self, num_pages: int, *, reserved: Iterable[int] = ()) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._state = np.zeros(num_pages, np.int8)
        self._owner = np.zeros(num_pages, np.int64)
        held = self._checked(as_pages(list(reserved), "reserved"), "reserved")
        self._state[held] = _RESERVED
        usable = np.flatnonzero(self._state == _FREE).astype(np.int64)
        self._stack: Pages = usable[::-1].copy()  # the top of the stack is the lowest page
        self._top = int(usable.size)
        self.capacity = int(usable.size)

    def _checked(self, pages: Pages, what: str) -> Pages:
        if pages.size:
            lo, hi = int(pages.min()), int(pages.max())
            if lo < 0 or hi >= self.num_pages:
                bad = lo if lo < 0 else hi
                raise PageStateError(f"{what}: page {bad} is outside [0, {self.num_pages})")
            if np.unique(pages).size != pages.size:
                raise PageStateError(f"{what}: a page is named twice")
        return pages

    def alloc(self, n: int, *, owner: int = 0) -> Pages:
        """``n`` free pages (all or none: ``PagesExhausted`` leaves the allocator unchanged).

        ``owner`` tags the pages for ``check_no_leaks`` reports.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"page count must be a non-negative int, got {n!r}")
        n = int(n)
        with self._lock:
            if n > self._top:
                raise PagesExhausted(
                    f"asked for {n} pages but {self._top} of {self.capacity} are free: nothing allocated"
                )
            pages: Pages = self._stack[self._top - n : self._top][::-1].copy()
            self._top -= n
            self._state[pages] = _USED
            self._owner[pages] = owner
        return pages

    def free(self, pages: Any) -> None:
        """Return ``pages``; a page that is not allocated (double free, reserved, never handed
        out) or out of range raises ``PageStateError`` and frees nothing."""
        idx = self._checked(as_pages(pages), "free")
        if idx.size == 0:
            return
        with self._lock:
            state = self._state[idx]
            if (state != _USED).any():
                bad = idx[state != _USED]
                kinds = ["reserved" if self._state[p] == _RESERVED else "free" for p in bad[:8]]
                listed = ", ".join(f"{int(p)} ({k})" for p, k in zip(bad[:8], kinds, strict=False))
                raise PageStateError(
                    f"free: {bad.size} page(s) are not allocated, nothing was freed: {listed}"
                    + (" ..." if bad.size > 8 else "")
                )
            self._stack[self._top : self._top + idx.size] = idx[::-1]
            self._top += idx.size
            self._state[idx] = _FREE
            self._owner[idx] = 0

    def allocated(self, pages: Any) -> bool:
        """True if every page of ``pages`` is currently allocated."""
        idx = as_pages(pages)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_pages):
            return False
        with self._lock:
            return bool((self._state[idx] == _USED).all())

    def stats(self) -> AllocatorStats:
        with self._lock:
            return AllocatorStats(self.capacity, self._top, self.capacity - self._top)

    def owners(self) -> dict[int, int]:
        """Allocated pages per owner tag."""
        with self._lock:
            used = self._state == _USED
            tags, counts = np.unique(self._owner[used], return_counts=True)
        return {int(t): int(c) for t, c in zip(tags, counts, strict=True)}

    def check_no_leaks(self) -> None:
        """Raise ``PageLeak`` (listing pages per owner) if any page is still allocated."""
        with self._lock:
            used = np.flatnonzero(self._state == _USED)
            owners = self._owner[used]
        if used.size:
            groups = {int(o): used[owners == o] for o in np.unique(owners)}
            detail = "; ".join(
                f"owner {o}: pages {g[:8].tolist()}{' ...' if g.size > 8 else ''}" for o, g in groups.items()
            )
            raise PageLeak(f"{used.size} page(s) still allocated: {detail}")

    def __repr__(self) -> str:
        s = self.stats()
        return f"<PageAllocator {s.used}/{s.capacity} used>"
