"""GPU-side waits on an imm counter: a CUDA stream waits for imms with no host round trip.

``engine.device_counter(imm)`` gives a :class:`DeviceCounter`. The engine publishes the imm's
arrivals into a 32-bit word of page-locked host memory mapped into the GPUs, from the thread
that counts them (the C++ worker on the compiled backends); ``wait(n, stream)`` queues on the
stream a one-thread kernel that polls that word (one warp of one SM while it waits; it can
be captured in a CUDA graph), so kernels queued after it start as soon as the n-th imm is
counted. A kernel rather than ``cuStreamWaitValue32``: a stream blocked in a stream memory
operation blocks the hardware queue it shares with other streams, and unrelated work of the
process stalls behind it (see ``fabric_core.cuda``)::

    dc = engine.device_counter(IMM, peer=prefill_address)
    for step in range(steps):
        dc.wait(layers_per_step, stream)   # on the GPU: wait for this step's writes
        attention(kv, stream=stream)       # then use them
    stream.synchronize()
    dc.check()                             # raise if a wait was released by a failure

Semantics:

* A device counter sees every arrival of its imm since the engine started, like
  :class:`~fabric_core.ImmCounter`, and keeps a ledger of its own: ``wait(n)`` asks for n
  arrivals beyond those earlier waits asked for. Host waiters on the same imm consume their
  own counts and do not move it (use one imm per consumer, as usual).
* Failures never hang the GPU. When the peer the counter names is lost, when the engine
  closes, or when a wait's ``timeout`` passes on the host, the word is set so that every
  queued GPU wait passes, and the counter is failed: :meth:`check` (and any later
  :meth:`wait`) raises the typed error. GPU work queued after a released wait then runs on
  data that may not have landed: call ``check()`` before trusting its results.
* Only CUDA memory written by the NIC or the engine's own copies is covered: the engine
  counts an imm once its write's bytes are in place.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from . import cuda
from .errors import ConfigError, EngineClosed, TransferTimeout
from .models import DomainAddress

if TYPE_CHECKING:
    from .counters import CounterTable

__all__ = ["DeviceCounter"]

_WORDS_PER_BLOCK = 1024


class _WordPool:
    """Words of mapped host memory, handed out and taken back. Blocks are never freed: a
    stream may still wait on a word whose counter is gone, and since a word's value only
    grows (``CounterTable.attach_mirror``), such a wait stays satisfied when it is reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = []  # (host address, device address)

    def take(self) -> tuple[int, int]:
        with self._lock:
            if not self._free:
                block = cuda.mapped_words(_WORDS_PER_BLOCK)
                self._free = [
                    (block.host_ptr + 4 * i, block.device_ptr + 4 * i) for i in reversed(range(block.count))
                ]
            return self._free.pop()

    def give(self, word: tuple[int, int]) -> None:
        with self._lock:
            self._free.append(word)


_pool = _WordPool()


class _Watchdog:
    """One thread for the host-side deadlines of every device wait in the process: a wait
    whose arrivals are not in by its deadline fails its counter (releasing the GPU)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waits: list[tuple[float, weakref.ref[DeviceCounter], int]] = []
        self._thread: threading.Thread | None = None

    def watch(self, counter: DeviceCounter, reserved: int, deadline: float) -> None:
        with self._cv:
            self._waits.append((deadline, weakref.ref(counter), reserved))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fabric-device-waits", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            expired: list[tuple[DeviceCounter, int]] = []
            with self._cv:
                now = time.monotonic()
                keep = []
                for entry in self._waits:
                    deadline, ref, reserved = entry
                    counter = ref()
                    if counter is None or counter._settled(reserved):
                        continue
                    if now >= deadline:
                        expired.append((counter, reserved))
                    else:
                        keep.append(entry)
                self._waits = keep
                if not keep and not expired:
                    self._thread = None
                    return
                if not expired:
                    # arrivals are not signalled here: look again soon, or at the next deadline
                    self._cv.wait(min(0.05, max(0.0, min(e[0] for e in keep) - now)))
            for counter, reserved in expired:
                counter._expire(reserved)


_watchdog = _Watchdog()


def _stream_handle(stream: object) -> int:
    """A ``CUstream`` from a ``torch.cuda.Stream`` (or anything with ``cuda_stream``), an int
    handle, or None (torch's current stream, else the legacy default stream)."""
    if stream is None:
        try:
            import torch
        except ImportError:
            return 0
        return int(torch.cuda.current_stream().cuda_stream)
    if isinstance(stream, bool):
        raise ConfigError("stream must be a CUDA stream, a CUstream handle or None, got a bool")
    if isinstance(stream, int):
        if not 0 <= stream < 1 << 64:
            raise ConfigError(f"stream handle {stream!r} is not a 64-bit CUstream")
        return stream
    handle: Any = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int) and not isinstance(handle, bool):
        return handle
    raise ConfigError(f"stream must be a CUDA stream, a CUstream handle or None, got {type(stream).__name__}")


class DeviceCounter:
    """A GPU-side view of one imm counter; see the module's documentation."""

    def __init__(
        self, table: CounterTable, imm: int, default_timeout: float, peer: DomainAddress | None = None
    ) -> None:
        self._table, self._imm, self._timeout = table, imm, default_timeout
        self._peer = peer
        self._word = _pool.take()
        try:
            table.attach_mirror(imm, self._word[0], peer.raw if peer is not None else None)
        except BaseException:
            _pool.give(self._word)
            raise
        self._closed = False
        self._error: BaseException | None = None

    @property
    def imm(self) -> int:
        return self._imm

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer(self) -> DomainAddress | None:
        return self._peer

    @property
    def arrived(self) -> int:
        """Arrivals of the imm since the engine started, as the host counted them."""
        return self._table.mirror_state(self._imm)[0]

    @property
    def reserved(self) -> int:
        """Arrivals the waits queued so far asked for, in all."""
        return self._table.mirror_state(self._imm)[1]

    @property
    def word_address(self) -> int:
        """The device address of the 32-bit word GPU waits read (for kernels of your own:
        wait until ``(int32)(word - target) >= 0``)."""
        return self._word[1]

    def wait(self, n: int = 1, stream: object = None, *, timeout: float | None = None) -> int:
        """Queue on ``stream`` a wait for ``n`` more arrivals; returns the word's target.

        Returns at once (the wait happens on the GPU). ``timeout`` (s; None: the engine's
        default): if the arrivals are not in by then, the counter fails with
        ``TransferTimeout`` and the GPU goes on. Raises the counter's error if it failed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n >= 1 << 31:
            raise ConfigError(f"n must be an integer in [1, 2**31), got {n!r}")
        limit = self._timeout if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ConfigError(f"timeout must be a positive number of seconds (or math.inf), got {limit!r}")
        handle = _stream_handle(stream)
        if self._closed:
            raise EngineClosed("this device counter is closed")
        target = self._table.reserve(self._imm, n)
        cuda.stream_wait_value(handle, self._word[1], target)
        if math.isfinite(limit):
            _watchdog.watch(self, self.reserved, time.monotonic() + float(limit))
        return target

    def check(self) -> None:
        """Raise the error the counter failed with, if it failed (call it once the GPU work
        after the waits is done, before trusting its results)."""
        if self._error is not None:
            raise self._error
        try:
            self._table.reserve(self._imm, 0)
        except ConfigError:
            if self._closed:
                raise EngineClosed("this device counter is closed") from None
            raise

    def close(self) -> None:
        """Release the GPU waits still queued and give the word back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._table.fail_mirror(self._imm, EngineClosed("this device counter is closed"), detach=True)
        _pool.give(self._word)

    # --- the watchdog's ----------------------------------------------------------------
    def _settled(self, reserved: int) -> bool:
        return self._closed or self.arrived >= reserved

    def _expire(self, reserved: int) -> None:
        arrived = self.arrived
        exc = TransferTimeout(
            f"device wait on imm {self._imm} timed out (arrivals since engine start)",
            expected={self._imm: reserved},
            received={self._imm: arrived},
            peer=str(self._peer) if self._peer is not None else None,
        )
        if self._table.fail_mirror(self._imm, exc):
            self._error = exc

    def __repr__(self) -> str:
        arrived, reserved = self._table.mirror_state(self._imm)
        return f"DeviceCounter(imm={self._imm}, arrived={arrived}, reserved={reserved})"
