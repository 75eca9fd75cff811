"""The decode side: owns the paged cache, hands out pages and imms, and waits for the writes.

Per request the decoder allocates pages and one imm, arms one counter expectation for the
exact number of imms the prefill's paged writes will carry, and tells the prefill where to
write (REQUEST). The request completes when that count is reached: every page of every layer
has landed. Its pages then belong to the caller (``KvReceive.release`` gives them back).
A request that is cancelled, times out, is refused by the prefill or loses its prefill fails
at once with a typed error, and its pages and imm are reclaimed as ``fabric_apps.kvcache.imms``
describes: never reused while a write of the failed request could still land or be counted.

Threads: one service thread per decoder receives control messages and runs deadlines;
completions arrive on the engine's callback thread. Handle callbacks run on one of those:
keep them short. The decoder owns its engine's control channel (``recv``): do not receive on
that engine elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric_core.api import TransferEngine
from fabric_core.counters import Expectation
from fabric_core.errors import (
    ConfigError,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    TransferTimeout,
)
from fabric_core.models import DomainAddress
from fabric_core.ops import PagedWriteRequest, plan_request
from fabric_core.transfer import Transfer

from . import protocol as wire
from ._cache import RegisteredCache
from ._sync import Guard
from .allocator import PageAllocator, Pages, as_pages
from .errors import RequestCancelled, engine_gone
from .imms import DEFAULT_IMM_BASE, DEFAULT_IMM_SLOTS, ImmPool
from .layout import KvLayout, WriteUnit, write_units

__all__ = ["DecoderStats", "KvDecoder", "KvReceive"]

logger = logging.getLogger(__name__)

# request states at the decoder
_PENDING = "pending"  # counting towards the expected imms
_AWAIT_DONE = "await_done"  # failed; waiting for the prefill's DONE (how many imms it sent)
_DRAINING = "draining"  # counting down the imms the failed request's writes still carry
_GRACE = "grace"  # count unknown: waiting for stragglers before consuming what is left


class KvReceive:
    """One request at the decoder: completes when every page of every layer has landed.

    ``pages`` are the pages allocated for it (written by the prefill), ``block_table`` is the
    prefix pages followed by ``pages``. On success the pages are the caller's: ``release()``
    (or leaving a ``with`` block) returns them to the allocator. On failure the decoder takes
    them back itself. Await it, ``wait(timeout)`` on it, or add ``on_done``/``on_error``.
    """

    def __init__(
        self,
        decoder: KvDecoder,
        seq: int,
        request_id: str,
        prefill: DomainAddress,
        imm: int,
        pages: Pages,
        prefix: Pages,
        expected_imms: int,
    ) -> None:
        self._decoder = decoder
        self.seq = seq
        self.request_id = request_id
        self.prefill = prefill
        self.imm = imm
        self.pages = pages
        self.block_table: Pages = np.concatenate((prefix, pages))
        self.expected_imms = expected_imms
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._released = False
        self._lock = threading.Lock()

    # --- outcome -----------------------------------------------------------------------
    def done(self) -> bool:
        return self._future.done()

    def succeeded(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The request's error (None on success); ``TransferTimeout`` if not over in ``timeout``."""
        try:
            return self._future.exception(self._decoder._limit(timeout))
        except concurrent.futures.TimeoutError:
            raise self._wait_timeout(timeout) from None

    def wait(self, timeout: float | None = None) -> None:
        """Block until every page has landed; raise the request's typed error if it failed.

        ``timeout=None`` uses the decoder's default; a wait that times out raises
        ``TransferTimeout`` and leaves the request running.
        """
        exc = self.exception(timeout)
        if exc is not None:
            raise exc

    def _wait_timeout(self, timeout: float | None) -> TransferTimeout:
        return TransferTimeout(
            f"request {self.request_id!r} not over after {self._decoder._limit(timeout):g} s (it goes on)"
        )

    def on_done(self, callback: Callable[[KvReceive], None]) -> KvReceive:
        """Call ``callback(self)`` once every page has landed (at once if it already has)."""

        def run(f: concurrent.futures.Future[None]) -> None:
            if f.exception() is None:
                callback(self)

        self._future.add_done_callback(run)
        return self

    def on_error(self, callback: Callable[[KvReceive, BaseException], None]) -> KvReceive:
        """Call ``callback(self, error)`` if the request fails (at once if it already has)."""

        def run(f: concurrent.futures.Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                callback(self, exc)

        self._future.add_done_callback(run)
        return self

    async def _await(self) -> KvReceive:
        await asyncio.wrap_future(self._future)
        return self

    def __await__(self) -> Generator[Any, None, KvReceive]:
        return self._await().__await__()

    # --- control -----------------------------------------------------------------------
    def cancel(self) -> bool:
        """Fail the request with ``RequestCancelled`` if it is still pending (True), and have
        the prefill stop; its pages come back once no write of it can land any more."""
        return self._decoder._cancel(self.seq, RequestCancelled(f"request {self.request_id!r} was cancelled"))

    def release(self) -> None:
        """Give the pages of a completed request back to the allocator (idempotent)."""
        if not self.succeeded():
            raise ConfigError(
                "only a completed request's pages are the caller's to release; a failed one's are "
                "reclaimed by the decoder"
            )
        with self._lock:
            if self._released:
                return
            self._released = True
        self._decoder.allocator.free(self.pages)

    def __enter__(self) -> KvReceive:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.succeeded():
            self.release()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("done" if self.succeeded() else "failed")
        return (
            f"<KvReceive {self.request_id!r} seq={self.seq} imm={self.imm:#x} pages={self.pages.size} "
            f"{state}>"
        )


@dataclass(frozen=True, slots=True)
class DecoderStats:
    pending: int
    """Requests counting towards their imms."""
    reclaiming: int
    """Failed requests whose pages or imm are not back yet."""
    completed: int
    failed: int
    pages_free: int
    pages_used: int
    """Pages of pending and reclaimed requests plus pages handed to callers."""
    pages_quarantined: int
    """Pages of failed requests that a late write could still reach."""
    imms_free: int
    imms_retired: int


_EXPECTED_KEPT = 4096  # page counts whose imm count a _Peer keeps


@dataclass(eq=False)
class _Peer:
    address: DomainAddress
    event: threading.Event = field(default_factory=threading.Event)
    ready: bool = False
    num_nics: int = 0
    max_msg_size: int = 0
    units: tuple[WriteUnit, ...] = ()
    """The prefill's paged writes per layer (``write_units`` of its layout and this one's)."""
    error: BaseException | None = None
    lost: BaseException | None = None
    expected: dict[int, int] = field(default_factory=dict)
    """Imms per request by page count (the count rule's answer depends on nothing else)."""


@dataclass(eq=False)
class _Req:
    seq: int
    handle: KvReceive
    peer: _Peer
    imm: int
    pages: Pages
    state: str = _PENDING
    expectation: Expectation | None = None
    pages_held: bool = True


class KvDecoder:
    """The decode instance's side of the KV-cache transfer, over ``engine``.

    ``caches`` are the layer tensors (checked against ``layout`` and registered). Imms come
    from ``[imm_base, imm_base + imm_slots)``; ``timeout`` is the default deadline of a
    request; ``settle_timeout_s`` bounds the wait for a cancelled request's DONE and
    countdown; ``lost_peer_grace_s`` is how long a failed request whose imm count is unknown
    keeps its pages and imm before they are reused.
    """

    def __init__(
        self,
        engine: TransferEngine,
        layout: KvLayout,
        caches: Any,
        *,
        imm_base: int = DEFAULT_IMM_BASE,
        imm_slots: int = DEFAULT_IMM_SLOTS,
        reserved_pages: tuple[int, ...] = (),
        timeout: float = 60.0,
        settle_timeout_s: float = 30.0,
        lost_peer_grace_s: float = 0.5,
        poll_interval_s: float = 0.05,
    ) -> None:
        for name, v in (
            ("timeout", timeout),
            ("settle_timeout_s", settle_timeout_s),
            ("poll_interval_s", poll_interval_s),
        ):
            if not v > 0:
                raise ConfigError(f"{name} must be positive, got {v!r}")
        if not lost_peer_grace_s >= 0:
            raise ConfigError(f"lost_peer_grace_s must be >= 0, got {lost_peer_grace_s!r}")
        self.engine = engine
        self.layout = layout
        self.timeout = timeout
        self.settle_timeout_s = settle_timeout_s
        self.lost_peer_grace_s = lost_peer_grace_s
        self._poll = poll_interval_s
        self.imms = ImmPool(imm_base, imm_slots)
        self.allocator = PageAllocator(layout.num_blocks, reserved=reserved_pages)
        self._cache = RegisteredCache(engine, layout, caches)
        self._hello = wire.encode(wire.Hello(layout, self._cache.descriptors))
        if len(self._hello) > engine.capabilities.max_send_size:
            self._cache.close()
            raise ConfigError(
                f"the decoder's HELLO (layout and {len(self._cache.descriptors)} descriptors) is "
                f"{len(self._hello)} bytes, above max_send_size {engine.capabilities.max_send_size}: "
                "raise FABRIC_MAX_SEND_SIZE"
            )
        self._lock = Guard()
        self._idle = threading.Condition(self._lock.rlock)
        self._peers: dict[bytes, _Peer] = {}
        self._reqs: dict[int, _Req] = {}
        self._seqs = itertools.count(1)
        self._timers: list[tuple[float, int, int, str]] = []
        self._timer_ids = itertools.count()
        self._completed = self._failed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvcache-decoder", daemon=True)
        self._thread.start()

    @property
    def address(self) -> DomainAddress:
        return self.engine.address

    def _limit(self, timeout: float | None) -> float | None:
        limit = self.timeout if timeout is None else timeout
        return None if math.isinf(limit) else limit

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this KvDecoder is closed")

    # --- connecting ----------------------------------------------------------------------
    def connect(self, prefill: DomainAddress, timeout: float | None = None) -> None:
        """Send ``prefill`` this decoder's layout and descriptors and wait for its answer.

        ``ConfigError`` if the prefill refuses (page formats or NIC counts differ),
        ``PeerUnreachable`` if it is gone, ``TransferTimeout`` if it does not answer.
        Idempotent once accepted.
        """
        self._check_open()
        if not isinstance(prefill, DomainAddress):
            raise ConfigError(f"prefill must be a DomainAddress, got {type(prefill).__name__}")
        with self._lock:
            peer = self._peers.get(prefill.raw)
            if peer is None or (peer.error is not None and peer.lost is None):
                peer = self._peers[prefill.raw] = _Peer(prefill)
        if peer.lost is not None:
            raise PeerUnreachable(f"prefill {prefill} is gone ({peer.lost})", peer=str(prefill))
        if peer.ready:
            return
        sent = self.engine.submit_send(prefill, self._hello)
        sent.on_error(lambda _t, exc: self._connect_failed(peer, exc))
        limit = self._limit(timeout)
        if not peer.event.wait(limit):
            raise TransferTimeout(f"prefill {prefill} did not answer the decoder's HELLO within {limit:g} s")
        if peer.error is not None:
            raise peer.error

    def _connect_failed(self, peer: _Peer, exc: BaseException) -> None:
        if isinstance(exc, PeerUnreachable):
            self._peer_lost(peer, exc)
        peer.error = peer.error or exc
        peer.event.set()

    # --- requests ------------------------------------------------------------------------
    def expected_imms(self, prefill: DomainAddress, num_pages: int) -> int:
        """Imms the prefill's paged writes of ``num_pages`` pages per segment and layer carry
        at this decoder (fabric_core's count rule with the prefill's NIC count and largest
        message size)."""
        peer = self._ready_peer(prefill)
        pages = np.arange(num_pages, dtype=np.int64)
        return self._expected(peer, pages, self.imms.base)

    def _expected(self, peer: _Peer, pages: Pages, imm: int) -> int:
        # The prefill submits one PagedWriteRequest per layer and write unit; the count depends
        # on the page count, the unit's length, the sender's NIC count and max message size
        # only, so the decoder plans the same request over its own region of layer 0 (every
        # layer has the same geometry), once per page count and prefill (planning 256 pages
        # twice took 0.3 ms of each request on an H200 host). The prefill checks its real
        # requests against this number.
        known = peer.expected.get(int(pages.size))
        if known is not None:
            return known
        per_layer = 0
        for unit in peer.units:
            seg = unit.dst
            region = self._cache.regions[0][seg.tensor]
            _, unit_pages = unit.pages(pages, pages)
            request = PagedWriteRequest(
                region,
                unit_pages,
                seg.stride,
                region.descriptor,
                unit_pages,
                seg.stride,
                unit.length,
                seg.offset,
                seg.offset,
                imm,
            )
            per_layer += plan_request(request, peer.num_nics, peer.max_msg_size).imms_per_target[0]
        if len(peer.expected) >= _EXPECTED_KEPT:
            peer.expected.clear()
        peer.expected[int(pages.size)] = total = per_layer * self.layout.num_layers
        return total

    def _ready_peer(self, prefill: DomainAddress) -> _Peer:
        if not isinstance(prefill, DomainAddress):
            raise ConfigError(f"prefill must be a DomainAddress, got {type(prefill).__name__}")
        with self._lock:
            peer = self._peers.get(prefill.raw)
        if peer is not None and peer.lost is not None:
            raise PeerUnreachable(f"prefill {prefill} is gone ({peer.lost})", peer=str(prefill))
        if peer is None or not peer.ready:
            raise ConfigError(f"prefill {prefill} is not connected: call connect() first")
        return peer

    def receive(
        self,
        prefill: DomainAddress,
        request_id: str,
        num_pages: int,
        *,
        prefix_pages: Any = (),
        timeout: float | None = None,
    ) -> KvReceive:
        """Allocate pages for a sequence of ``num_pages`` pages and have ``prefill`` fill them.

        ``prefix_pages`` are pages this decoder already holds for the sequence's first
        ``len(prefix_pages)`` pages (a prefix-cache hit; they must be allocated, e.g. pages of
        an earlier request not yet released): they are not sent, only the rest are allocated
        and written. The request fails with ``TransferTimeout`` after ``timeout`` s (default:
        the decoder's). Raises ``PagesExhausted``/``ImmsExhausted`` (nothing taken),
        ``ConfigError`` for bad input, ``PeerUnreachable`` if the prefill is known gone.
        """
        self._check_open()
        peer = self._ready_peer(prefill)
        if not isinstance(request_id, str):
            raise ConfigError(f"request_id must be a str, got {type(request_id).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
            raise ConfigError(f"num_pages must be a positive int, got {num_pages!r}")
        prefix = as_pages(prefix_pages, "prefix_pages")
        if prefix.size >= num_pages:
            raise ConfigError(
                f"{prefix.size} prefix pages cover the whole {num_pages}-page sequence: nothing to transfer"
            )
        if prefix.size and (np.unique(prefix).size != prefix.size or not self.allocator.allocated(prefix)):
            raise ConfigError("prefix_pages must be distinct pages this decoder holds (allocated)")
        limit = self.timeout if timeout is None else timeout
        if not limit > 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        with self._lock:
            seq = next(self._seqs)
            imm = self._take_imm()
            try:
                pages = self.allocator.alloc(int(num_pages) - prefix.size, owner=seq)
            except BaseException:
                self.imms.release(imm)
                raise
            try:
                expected = self._expected(peer, pages, imm)
                message = wire.encode(wire.Request(seq, imm, expected, prefix.size, request_id, pages))
                if len(message) > self.engine.capabilities.max_send_size:
                    raise ConfigError(
                        f"the request's page list needs a {len(message)}-byte message, above max_send_size "
                        f"{self.engine.capabilities.max_send_size}: raise FABRIC_MAX_SEND_SIZE"
                    )
                handle = KvReceive(self, seq, request_id, peer.address, imm, pages, prefix, expected)
                req = _Req(seq, handle, peer, imm, pages)
                self._reqs[seq] = req
                req.expectation = self.engine.counter(imm).expect(
                    expected,
                    lambda: self._landed(seq),
                    on_error=lambda exc: self._expect_failed(seq, exc),
                    peer=peer.address,
                )
            except BaseException:
                # nothing was sent and the imm's count was zero: both go straight back
                self._reqs.pop(seq, None)
                self.allocator.free(pages)
                self.imms.release(imm)
                raise
            self._schedule(time.monotonic() + limit, seq, "deadline")
        try:
            self._send(peer, message)
        except BaseException as exc:
            self._fail_pending(seq, exc, "send")
            raise
        return handle

    def _take_imm(self) -> int:
        while True:
            imm = self.imms.acquire()
            left = self.engine.counter(imm).value
            if left == 0:
                return imm
            logger.warning("kvcache: imm %#x holds %d unaccounted count(s) when taken", imm, left)
            self.imms.retire(imm)

    def _send(self, peer: _Peer, message: bytes) -> Transfer:
        sent = self.engine.submit_send(peer.address, message)
        sent.on_error(lambda _t, exc: self._send_failed(peer, exc))
        return sent

    def _send_failed(self, peer: _Peer, exc: BaseException) -> None:
        if isinstance(exc, PeerUnreachable):
            self._peer_lost(peer, exc)
        else:
            logger.warning("kvcache: control message to %s failed: %s", peer.address, exc)

    # --- outcomes ------------------------------------------------------------------------
    def _landed(self, seq: int) -> None:
        """The request's counter reached its expected count (engine callback thread)."""
        with self._lock:
            req = self._reqs.pop(seq, None)
            if req is None or req.state != _PENDING:  # cannot happen: withdrawals are exclusive
                logger.error("kvcache: request %d completed in state %s", seq, req and req.state)
                return
            self.imms.release(req.imm)  # every imm the prefill sends for it has been counted
            self._completed += 1
            self._idle.notify_all()
            self._lock.defer(req.handle._future, None)

    def _expect_failed(self, seq: int, exc: BaseException) -> None:
        """The expectation failed: its prefill is gone (or the engine closed)."""
        with self._lock:
            req = self._reqs.get(seq)
            if req is None or req.state != _PENDING:
                return
            if isinstance(exc, PeerUnreachable) and req.peer.lost is None:
                req.peer.lost = exc
            self._fail_locked(req, exc)
            self._reclaim_unknown(req)

    def _cancel(self, seq: int, exc: BaseException) -> bool:
        with self._lock:
            req = self._reqs.get(seq)
            if req is None or req.state != _PENDING or req.expectation is None:
                return False
            if not req.expectation.cancel():
                return False  # it fired (or failed) just now: that outcome stands
            self._fail_locked(req, exc)
            self._stop_prefill(req)
            return True

    def _fail_pending(self, seq: int, exc: BaseException, why: str) -> None:
        with self._lock:
            req = self._reqs.get(seq)
            if req is None or req.state != _PENDING or req.expectation is None:
                return
            if not req.expectation.cancel():
                return
            self._fail_locked(req, exc)
            if why == "send":  # the REQUEST never left: nothing can be written or counted
                self._finish_locked(req, free_pages=True, imm="release")
            else:
                self._reclaim_unknown(req)

    def _fail_locked(self, req: _Req, exc: BaseException) -> None:
        self._failed += 1
        self._lock.defer(req.handle._future, exc)

    def _stop_prefill(self, req: _Req) -> None:
        """Ask the prefill to stop and wait (bounded) for its DONE."""
        req.state = _AWAIT_DONE
        self._schedule(time.monotonic() + self.settle_timeout_s, req.seq, "settle")
        if req.peer.lost is not None:
            self._reclaim_unknown(req)
            return
        try:
            self._send(req.peer, wire.encode(wire.Cancel(req.seq)))
        except FabricError as exc:
            logger.warning("kvcache: could not cancel request %d at %s: %s", req.seq, req.peer.address, exc)
            self._reclaim_unknown(req)

    def _reclaim_unknown(self, req: _Req) -> None:
        """The imm count of the failed request is unknown: grace, then consume what is left."""
        req.state = _GRACE
        if isinstance(req.peer.lost, EngineClosed) or self.engine.closed:
            self._finish_locked(req, free_pages=True, imm="release")
            return
        self._schedule(time.monotonic() + self.lost_peer_grace_s, req.seq, "grace")

    def _on_done(self, peer: _Peer, done: wire.Done) -> None:
        with self._lock:
            req = self._reqs.get(done.seq)
            if req is None or req.peer is not peer:
                return  # completed already (DONE of a finished request), or not ours
            if req.state == _PENDING:
                if done.status == wire.Status.OK:
                    return  # the counter completes it
                if req.expectation is None or not req.expectation.cancel():
                    return  # it completed just now
                self._fail_locked(req, wire.error_from_wire(done, str(peer.address)))
            elif req.state != _AWAIT_DONE:
                return
            if not done.exact:
                self._reclaim_unknown(req)
                return
            # Every write of the request completed at the prefill and nothing more will be
            # written. A completion at the writer does not always mean the bytes are here
            # (tcp completes a write once the kernel has it): fence the prefill, whose answer
            # travels behind them, before the pages go back (docs/concepts/failures.md).
            try:
                self.engine.fence([peer.address], timeout=self.settle_timeout_s)
            except FabricError as exc:
                logger.warning("kvcache: fence of %s for request %d failed: %s", peer.address, req.seq, exc)
                self._reclaim_unknown(req)
                return
            # The pages are free; the imms those writes carry are counted down before the
            # value is reused.
            self._free_pages_locked(req)
            if done.imms_sent == 0:
                self._finish_locked(req, free_pages=False, imm="release")
                return
            req.state = _DRAINING
            self._schedule(time.monotonic() + self.settle_timeout_s, req.seq, "drain")
            req.expectation = self.engine.counter(req.imm).expect(
                done.imms_sent,
                lambda: self._drained(req.seq),
                on_error=lambda exc: self._drain_failed(req.seq, exc),
            )

    def _drained(self, seq: int) -> None:
        with self._lock:
            req = self._reqs.get(seq)
            if req is not None and req.state == _DRAINING:
                self._finish_locked(req, free_pages=False, imm="release")

    def _drain_failed(self, seq: int, exc: BaseException) -> None:
        with self._lock:
            req = self._reqs.get(seq)
            if req is not None and req.state == _DRAINING:
                self._finish_locked(req, free_pages=False, imm="retire")

    def _free_pages_locked(self, req: _Req) -> None:
        if req.pages_held:
            req.pages_held = False
            self.allocator.free(req.pages)

    def _finish_locked(self, req: _Req, *, free_pages: bool, imm: str) -> None:
        """The failed request's reclamation is over: pages and imm go back (or imm retires)."""
        if free_pages:
            self._free_pages_locked(req)
        if imm == "release":
            self.imms.release(req.imm)
        elif imm == "retire":
            self.imms.retire(req.imm)
        self._reqs.pop(req.seq, None)
        self._idle.notify_all()

    def _consume_residual(self, req: _Req) -> str:
        """Consume whatever count is left on the imm (no waiter is on it); 'release' or 'retire'."""
        counter = self.engine.counter(req.imm)
        left = counter.value
        if left:
            try:
                counter.wait(left, timeout=self._poll)
            except FabricError as exc:
                logger.warning("kvcache: could not consume %d count(s) of imm %#x: %s", left, req.imm, exc)
                return "retire"
        return "release"

    # --- peers ---------------------------------------------------------------------------
    def _peer_lost(self, peer: _Peer, exc: BaseException) -> None:
        """Fail every pending request of ``peer`` with ``PeerUnreachable``; reclaim them."""
        lost = (
            exc
            if isinstance(exc, PeerUnreachable)
            else PeerUnreachable(f"prefill {peer.address} is gone ({exc})", peer=str(peer.address))
        )
        with self._lock:
            if peer.lost is None:
                peer.lost = lost
                logger.info("kvcache: prefill %s lost: %s", peer.address, exc)
            for req in [r for r in self._reqs.values() if r.peer is peer]:
                if req.state == _PENDING:
                    if req.expectation is not None and req.expectation.cancel():
                        self._fail_locked(req, lost)
                        self._reclaim_unknown(req)
                elif req.state == _AWAIT_DONE:
                    self._reclaim_unknown(req)

    # --- timers and the service thread ---------------------------------------------------
    def _schedule(self, when: float, seq: int, kind: str) -> None:
        heapq.heappush(self._timers, (when, next(self._timer_ids), seq, kind))

    def _run_timers(self) -> float:
        """Run due timers; return seconds until the next one (at most the poll interval)."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > now:
                    nxt = self._timers[0][0] - now if self._timers else self._poll
                    return max(0.0, min(nxt, self._poll))
                _, _, seq, kind = heapq.heappop(self._timers)
                req = self._reqs.get(seq)
                if req is None:
                    continue
                try:
                    self._timer(req, kind)
                except Exception:
                    logger.exception("kvcache: decoder timer %s of request %d failed", kind, seq)

    def _timer(self, req: _Req, kind: str) -> None:
        if kind == "deadline" and req.state == _PENDING:
            if req.expectation is None or not req.expectation.cancel():
                return
            seen = self.engine.counter(req.imm).value
            self._fail_locked(
                req,
                TransferTimeout(
                    f"request {req.handle.request_id!r} from prefill {req.peer.address} timed out",
                    expected={req.imm: req.handle.expected_imms},
                    received={req.imm: seen},
                    peer=str(req.peer.address),
                ),
            )
            self._stop_prefill(req)
        elif kind == "settle" and req.state == _AWAIT_DONE:
            logger.warning(
                "kvcache: prefill %s never confirmed the end of request %d: pages freed, imm %#x retired",
                req.peer.address,
                req.seq,
                req.imm,
            )
            self._finish_locked(req, free_pages=True, imm="retire")
        elif kind == "grace" and req.state == _GRACE:
            self._finish_locked(req, free_pages=True, imm=self._consume_residual(req))
        elif kind == "drain" and req.state == _DRAINING and req.expectation and req.expectation.cancel():
            logger.warning("kvcache: the count-down of imm %#x did not finish", req.imm)
            self._finish_locked(req, free_pages=False, imm="retire")

    def _serve(self) -> None:
        while True:
            wait = self._run_timers()
            if self._closed:
                return
            try:
                got = wire.next_message(self.engine, wait, "decoder")
            except EngineClosed as exc:
                self._engine_gone(exc)
                return
            if got is None:
                continue
            message, msg = got
            with self._lock:
                peer = self._peers.get(message.peer.raw)
            if peer is None:
                logger.warning("kvcache: dropped a %s from unknown peer %s", type(msg).__name__, message.peer)
                continue
            try:
                if isinstance(msg, wire.Ack):
                    self._on_ack(peer, msg)
                elif isinstance(msg, wire.Done):
                    self._on_done(peer, msg)
                else:
                    logger.warning("kvcache: a decoder got a %s from %s", type(msg).__name__, peer.address)
            except Exception:
                logger.exception("kvcache: handling %s from %s failed", type(msg).__name__, peer.address)

    def _on_ack(self, peer: _Peer, ack: wire.Ack) -> None:
        if peer.ready or peer.event.is_set():
            return
        if not ack.ok:
            peer.error = ConfigError(f"prefill {peer.address} refused the connection: {ack.error}")
        elif ack.num_nics != self.engine.num_nics:
            peer.error = ConfigError(
                f"prefill {peer.address} has {ack.num_nics} NICs, this decoder {self.engine.num_nics}: "
                "both sides must use the same NIC count"
            )
        else:
            try:
                units = write_units(ack.layout, self.layout)
            except ConfigError as exc:
                peer.error = ConfigError(f"prefill {peer.address} accepted a layout it cannot write: {exc}")
            else:
                peer.num_nics, peer.max_msg_size, peer.units = ack.num_nics, ack.max_msg_size, units
                peer.expected.clear()  # counts of the geometry acknowledged before, if any
                peer.ready = True
        peer.event.set()

    def _engine_gone(self, cause: EngineClosed) -> None:
        exc = engine_gone("the decoder's engine closed with this request in flight", cause)
        with self._lock:
            for req in list(self._reqs.values()):
                if req.state == _PENDING:
                    if req.expectation is None or not req.expectation.cancel():
                        continue  # its expectation fired or failed: that callback settles it
                    self._fail_locked(req, exc)
                self._finish_locked(req, free_pages=True, imm="release")

    # --- state ---------------------------------------------------------------------------
    def stats(self) -> DecoderStats:
        with self._lock:
            reqs = list(self._reqs.values())
            pages = self.allocator.stats()
            imms = self.imms.stats()
            return DecoderStats(
                pending=sum(r.state == _PENDING for r in reqs),
                reclaiming=sum(r.state != _PENDING for r in reqs),
                completed=self._completed,
                failed=self._failed,
                pages_free=pages.free,
                pages_used=pages.used,
                pages_quarantined=sum(r.pages.size for r in reqs if r.state != _PENDING and r.pages_held),
                imms_free=imms.free,
                imms_retired=imms.retired,
            )

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is pending or being reclaimed (True) or ``timeout`` passes."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._reqs, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Fail pending requests with ``EngineClosed`` (asking their prefills to stop), stop
        the service thread and deregister the cache. Idempotent; the engine stays open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            exc = EngineClosed("the KvDecoder was closed with this request in flight")
            for req in list(self._reqs.values()):
                if req.state == _PENDING:
                    if req.expectation is None or not req.expectation.cancel():
                        continue  # its expectation fired or failed: that callback settles it
                    self._fail_locked(req, exc)
                    if req.peer.lost is None and not self.engine.closed:
                        try:
                            self._send(req.peer, wire.encode(wire.Cancel(req.seq)))
                        except FabricError:
                            pass
                elif req.state == _DRAINING and req.expectation is not None:
                    req.expectation.cancel()
                self._finish_locked(req, free_pages=True, imm="release")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._cache.close()

    def __enter__(self) -> KvDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<KvDecoder {self.address} pending={s.pending} pages={s.pages_used}/{self.allocator.capacity}>"
        )
