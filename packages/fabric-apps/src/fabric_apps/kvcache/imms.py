"""The imm allocation scheme of the KV-cache transfer.

An engine counts imms in one 32-bit space with no sender identity, so the only safe owner of
an imm value is the instance that counts it: **the decoder allocates the imm of every request
that writes into it**, from its own pool ``[imm_base, imm_base + imm_slots)`` (by default
``0x4B560000 + 0..65535``; the high half ``0x4B56`` ("KV") keeps the range apart from other
applications on the same engine). A request holds exactly one imm; every paged write of every
layer of that request carries it. Because the decoder hands each live request its own value,
requests never share an imm, however many prefill instances write into one decoder at once;
prefill instances never choose imms.

Reuse is where imms collide: a late write of an old request must never be counted for a new
request that got the same value. A value therefore goes back to the pool only when *no write
of its request can still be counted*:

* **completed**: the request's counter reached its expected count, which is every imm the
  prefill sends for it; nothing more can arrive, so the value is free at once;
* **cancelled or timed out** (the prefill may still be writing): the decoder sends CANCEL and
  keeps the value (and the pages) *quarantined*. The prefill stops submitting layers, waits
  until every write it did submit has completed at its side and answers DONE with the exact
  number of imms those writes carry (``Transfer.imms_at_target`` summed). Sender completion
  means the bytes are in place, so the pages are freed then; the decoder then *counts that
  many imms down* (a wait that consumes them) and only then returns the value to the pool;
* **count unknown** (the prefill died, or one of its writes failed part way, so some of its
  work requests may have been counted and some not): the value and pages stay quarantined
  for a grace period (``lost_peer_grace_s``) in which stragglers already on the wire land,
  then whatever count is left on the value is consumed and the value is reused;
* a DONE that never comes (``settle_timeout_s``) or a countdown that does not finish retires
  the value for good (it is never handed out again; ``ImmPool.retired`` counts them).

Free values are reused first-in first-out, so a value rests as long as the pool allows
before it comes back, and a value whose counter is not zero when taken is retired instead
of used (a last guard against a straggler nobody accounted for).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from fabric_core.errors import ConfigError

from .errors import ImmsExhausted

__all__ = ["DEFAULT_IMM_BASE", "DEFAULT_IMM_SLOTS", "ImmPool", "ImmPoolStats"]

logger = logging.getLogger(__name__)

DEFAULT_IMM_BASE = 0x4B56_0000
DEFAULT_IMM_SLOTS = 1 << 16


@dataclass(frozen=True, slots=True)
class ImmPoolStats:
    free: int
    in_use: int
    retired: int


class ImmPool:
    """Imm values ``[base, base + slots)``, handed out FIFO. Thread-safe."""

    def __init__(self, base: int = DEFAULT_IMM_BASE, slots: int = DEFAULT_IMM_SLOTS) -> None:
        for name, v in (("imm_base", base), ("imm_slots", slots)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        if slots < 1 or base < 0 or base + slots > 1 << 32:
            raise ConfigError(
                f"imm range [{base:#x}, {base + slots:#x}) must be non-empty and within 32 bits"
            )
        self.base, self.slots = base, slots
        self._lock = threading.Lock()
        self._free: deque[int] = deque(range(base, base + slots))
        self._in_use: set[int] = set()
        self._retired: set[int] = set()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise ImmsExhausted(
                    f"all {self.slots} imm values are held ({len(self._in_use)} by requests in flight or "
                    f"being reclaimed, {len(self._retired)} retired): raise imm_slots or wait for "
                    "requests to finish"
                )
            imm = self._free.popleft()
            self._in_use.add(imm)
            return imm

    def release(self, imm: int) -> None:
        """The value can be counted for a new request: no write of its last one is left."""
        with self._lock:
            self._take(imm)
            self._free.append(imm)

    def retire(self, imm: int) -> None:
        """Never hand ``imm`` out again (its count cannot be accounted for)."""
        with self._lock:
            self._take(imm)
            self._retired.add(imm)
        logger.warning("kvcache: imm %#x retired: a late write could still be counted on it", imm)

    def _take(self, imm: int) -> None:
        if imm not in self._in_use:
            raise ConfigError(f"imm {imm:#x} is not held")
        self._in_use.discard(imm)

    def stats(self) -> ImmPoolStats:
        with self._lock:
            return ImmPoolStats(len(self._free), len(self._in_use), len(self._retired))

    def __contains__(self, imm: object) -> bool:
        return isinstance(imm, int) and self.base <= imm < self.base + self.slots
