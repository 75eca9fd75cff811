"""Errors of the weight update, placed in fabric_core's error tree.

A step that fails raises a ``StepFailed`` on every affected rank: a sender whose writes to
some destinations failed, a destination whose sources did not all land. It says which peers
failed (``failed``: peer rank → the transport error), which completed (``completed``) and, at
a destination, which are still pending. The class follows the cause, so callers can catch
fabric_core's own types: ``StepPeerLost`` is also a ``PeerUnreachable``, ``StepTimeout`` also a
``TransferTimeout`` (and a ``TimeoutError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from fabric_core.errors import PeerUnreachable, TransferTimeout, TransportError

__all__ = ["StepFailed", "StepPeerLost", "StepTimeout", "step_error"]

Side = Literal["source", "destination"]


class StepFailed(TransportError):
    """Step ``step`` failed at ``side`` rank ``rank``.

    ``failed`` maps each peer rank whose part failed to its error, ``completed`` lists the
    peer ranks whose part is fully done, ``pending`` (destinations) those neither done nor
    known failed when the wait ended. ``expected``/``received`` give imm counts per imm value
    where known (timeouts at a destination).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        side: Side,
        rank: int,
        failed: Mapping[int, BaseException],
        completed: tuple[int, ...] = (),
        pending: tuple[int, ...] = (),
        expected: Mapping[int, int] | None = None,
        received: Mapping[int, int] | None = None,
    ) -> None:
        first = next(iter(failed.values()), None)
        TransportError.__init__(
            self,
            message,
            peer=getattr(first, "peer", None),
            nic=getattr(first, "nic", None),
            transfer_id=getattr(first, "transfer_id", None),
        )
        self.step = step
        self.side: Side = side
        self.rank = rank
        self.failed = dict(failed)
        self.completed = completed
        self.pending = pending
        self.expected = dict(expected or {})
        self.received = dict(received or {})


class StepPeerLost(StepFailed, PeerUnreachable):
    """A peer of the step is gone (a destination at a sender, a source at a destination)."""


class StepTimeout(StepFailed, TransferTimeout):
    """The step's deadline passed before every write completed (or every count arrived)."""


def step_error(
    *,
    step: int,
    side: Side,
    rank: int,
    failed: Mapping[int, BaseException],
    completed: tuple[int, ...] = (),
    pending: tuple[int, ...] = (),
    expected: Mapping[int, int] | None = None,
    received: Mapping[int, int] | None = None,
    timeout: bool = False,
    note: str = "",
) -> StepFailed:
    """The most specific ``StepFailed`` for these per-peer outcomes."""
    peers = "destination" if side == "source" else "source"
    cls: type[StepFailed] = StepFailed
    if any(isinstance(e, PeerUnreachable) for e in failed.values()):
        cls = StepPeerLost
    elif timeout or (failed and all(isinstance(e, TransferTimeout) for e in failed.values())):
        cls = StepTimeout
    parts = [f"{peers} {r}: {type(e).__name__}: {e}" for r, e in sorted(failed.items())]
    if note:
        parts.append(note)
    if pending:
        parts.append(f"{peers}s {', '.join(map(str, pending))} pending")
    done = f"; {peers}s {', '.join(map(str, completed))} complete" if completed else ""
    message = f"weights step {step} failed at {side} rank {rank}: {'; '.join(parts)}{done}"
    return cls(
        message,
        step=step,
        side=side,
        rank=rank,
        failed=failed,
        completed=completed,
        pending=pending,
        expected=expected,
        received=received,
    )
