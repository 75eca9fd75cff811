"""Running one function per rank in threads, for tests of multi-rank code in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["run_ranks", "unwrap_ranks"]

R = TypeVar("R")


def run_ranks(fn: Callable[[int], R], n: int, timeout: float) -> list[R | BaseException]:
    """Run ``fn(rank)`` for ranks ``0..n-1``, each in a daemon thread of its own; each rank's
    result or the exception it raised. Raises ``AssertionError`` naming the ranks still
    running after ``timeout`` seconds (a hang), so a test never waits longer."""
    out: list[R | BaseException | None] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    hung = [r for r, th in enumerate(threads) if th.is_alive()]
    assert not hung, f"ranks {hung} still running after {timeout} s"
    return out  # type: ignore[return-value]  # every slot was set by its finished thread


def unwrap_ranks(results: Sequence[R | BaseException]) -> list[R]:
    """The results of :func:`run_ranks`, or ``AssertionError`` (chained) for the first rank
    that raised."""
    for r, res in enumerate(results):
        if isinstance(res, BaseException):
            raise AssertionError(f"rank {r} failed: {type(res).__name__}: {res}") from res
    return list(results)  # type: ignore[arg-type]  # no exception left
