"""The bounded staging pool a sender casts into before writing."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from fabric_core.api import TransferEngine
from fabric_core.errors import ConfigError, FabricError
from fabric_core.models import MemoryRegion

from . import _torch

__all__ = ["StagingPool"]

logger = logging.getLogger(__name__)


class StagingPool:
    """``capacity`` bytes (the watermark) registered once and cut into slots of ``slot_bytes``.

    A staged write holds one slot from the cast until its transfer completes at the sender;
    ``acquire`` blocks while every slot is held. ``high_water`` is the most bytes ever held at
    once since the last ``reset_high_water``: never above the watermark.
    """

    def __init__(self, engine: TransferEngine, capacity: int, slot_bytes: int, device: Any) -> None:
        if slot_bytes < 1 or capacity < slot_bytes:
            raise ConfigError(
                f"the staging watermark ({capacity} bytes) must hold at least one staged write "
                f"({slot_bytes} bytes): raise it or plan with a smaller stage_chunk_bytes"
            )
        torch = _torch.module()
        slots = capacity // slot_bytes
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        # zeros, not empty: every page is resident before the first step. With empty() the
        # casts first touched the pages, a few slots a step, and a sender still took ~1,300
        # page faults a step after ten steps (fabric bench rl, 4 -> 2)
        self.buffer: Any = torch.zeros(slots * slot_bytes, dtype=torch.uint8, device=device)
        self.region: MemoryRegion = engine.register(self.buffer, writable=False)
        self._engine = engine
        # a stack: the slot released last is taken first, still in cache
        self._free: list[int] = list(range((slots - 1) * slot_bytes, -1, -slot_bytes))
        self._cv = threading.Condition()
        self._used = 0
        self.high_water = 0

    @property
    def slots(self) -> int:
        return self.buffer.numel() // self.slot_bytes  # type: ignore[no-any-return]

    @property
    def in_use(self) -> int:
        with self._cv:
            return self._used

    def acquire(self, nbytes: int, deadline: float) -> int | None:
        """Offset of a free slot for ``nbytes``, or None if none frees up by ``deadline``."""
        with self._cv:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            offset = self._free.pop()
            self._used += nbytes
            self.high_water = max(self.high_water, self._used)
            return offset

    def release(self, offset: int, nbytes: int) -> None:
        with self._cv:
            self._free.append(offset)
            self._used -= nbytes
            self._cv.notify_all()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until no slot is held (True) or ``deadline`` passes (False)."""
        with self._cv:
            while self._used:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def reset_high_water(self) -> None:
        with self._cv:
            self.high_water = self._used

    def close(self) -> None:
        if self._engine.closed:
            return
        try:
            self._engine.deregister(self.region)
        except FabricError as exc:  # already withdrawn
            logger.debug("weights: deregistering the staging pool: %s", exc)
