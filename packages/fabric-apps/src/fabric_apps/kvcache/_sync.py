"""A re-entrant lock that resolves futures only once its outermost holder lets go."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

__all__ = ["Guard"]


class Guard:
    """Futures resolved while the lock is held (``defer``) are resolved when the outermost
    holder releases it, so user callbacks attached to them never run under the lock."""

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self._depth = threading.local()
        self._deferred: list[tuple[concurrent.futures.Future[Any], BaseException | None]] = []

    def defer(self, future: concurrent.futures.Future[Any], exc: BaseException | None) -> None:
        """Resolve ``future`` (with ``exc``, or with None) once the lock is released."""
        self._deferred.append((future, exc))

    def __enter__(self) -> Guard:
        self.rlock.acquire()
        self._depth.n = getattr(self._depth, "n", 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth.n -= 1
        ready: list[tuple[concurrent.futures.Future[Any], BaseException | None]] = []
        if self._depth.n == 0 and self._deferred:
            ready, self._deferred = self._deferred, []
        self.rlock.release()
        for future, error in ready:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
