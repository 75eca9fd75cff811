"""The prefill side: takes decoders' requests and writes pages layer by layer as they are ready.

A decoder connects once (HELLO: its layout and per-layer descriptors) and then sends one
REQUEST per sequence: where to write (destination pages), which imm to carry and how many
imms it will count. The prefill's caller picks requests up (``next_request`` or by id),
``begin``\\ s a job with its own block table for the sequence, and calls
``job.write_layer(layer)`` as each layer's KV is computed: one paged write per segment (K and
V, or the latent) goes out at once, routed over every NIC of the group (``Sharded()``), so
the transfer overlaps the rest of the forward pass.

At most ``max_inflight`` jobs run at once: ``begin`` blocks for a free slot up to its timeout
and raises ``TransferTimeout`` if none frees up. A slot is held until every write the job
submitted has completed at this side. When a job ends (all layers written, cancelled by the
decoder, aborted by the caller, or failed) the prefill sends DONE with the exact number of
imms its completed writes carry, which is what lets the decoder reuse pages and imms safely
(see ``fabric_apps.kvcache.imms``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric_core.api import TransferEngine
from fabric_core.errors import (
    ConfigError,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    TransferTimeout,
)
from fabric_core.models import DomainAddress, MemoryRegionDescriptor
from fabric_core.ops import PagedWriteRequest, Routing, Sharded
from fabric_core.transfer import Transfer

from . import protocol as wire
from ._cache import RegisteredCache
from ._sync import Guard
from .allocator import Pages, as_pages
from .errors import RequestAborted, RequestCancelled, engine_gone
from .layout import KvLayout, WriteUnit, write_units

__all__ = ["DecodeRequest", "KvPrefiller", "PrefillJob", "PrefillerStats"]

logger = logging.getLogger(__name__)

_FINISHED_MEMORY = 1 << 16  # per decoder: seqs remembered as finished (late CANCELs are ignored)
_TOMBSTONE_TTL_S = 600.0  # a CANCEL that overtook its REQUEST waits this long for it


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """A decoder's request: write ``num_pages - prefix_pages`` pages of sequence ``request_id``."""

    request_id: str
    decoder: DomainAddress
    seq: int
    num_pages: int
    """Pages of the whole sequence (the prefill's block table for it has this many)."""
    prefix_pages: int
    """Leading pages the decoder already holds: not sent."""

    @property
    def new_pages(self) -> int:
        return self.num_pages - self.prefix_pages


@dataclass(frozen=True, slots=True)
class PrefillerStats:
    waiting: int
    """Decoder requests not begun yet."""
    inflight: int
    completed: int
    cancelled: int
    failed: int


@dataclass(eq=False)
class _Decoder:
    address: DomainAddress
    layout: KvLayout
    descriptors: tuple[tuple[MemoryRegionDescriptor, ...], ...]
    units: tuple[WriteUnit, ...]
    """The paged writes per layer (``write_units`` of this prefill's layout and the decoder's)."""
    lost: BaseException | None = None
    finished: deque[int] = field(default_factory=deque)
    finished_set: set[int] = field(default_factory=set)
    tombstones: dict[int, float] = field(default_factory=dict)

    def finish(self, seq: int) -> None:
        self.finished.append(seq)
        self.finished_set.add(seq)
        while len(self.finished) > _FINISHED_MEMORY:
            self.finished_set.discard(self.finished.popleft())


@dataclass(eq=False)
class _Incoming:
    request: DecodeRequest
    decoder: _Decoder
    imm: int
    expected: int
    dst: Pages
    offered: bool = False


class PrefillJob:
    """The writes of one request. ``write_layer`` as layers become ready; ``wait`` for the end."""

    def __init__(
        self, prefiller: KvPrefiller, incoming: _Incoming, src: Pages, requests: list[list[PagedWriteRequest]]
    ) -> None:
        self._prefiller = prefiller
        self._incoming = incoming
        self.request = incoming.request
        self._src = src
        self._requests = requests  # [layer][segment], built once at begin
        self._written = np.zeros(len(requests), dtype=bool)
        self._outstanding = 0
        self._imms_sent = 0
        self._exact = True
        self._error: BaseException | None = None
        self._abort_reason: str | None = None
        self._cancelled = False
        self._finished = False
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

    @property
    def imm(self) -> int:
        return self._incoming.imm

    @property
    def expected_imms(self) -> int:
        """Imms the decoder counts once every layer is written."""
        return self._incoming.expected

    @property
    def imms_sent(self) -> int:
        """Imms carried by the writes that completed so far."""
        return self._imms_sent

    @property
    def layers_written(self) -> int:
        return int(self._written.sum())

    @property
    def cancelled(self) -> bool:
        """The decoder cancelled the request: stop computing it if you can."""
        return self._cancelled

    def write_layer(self, layer: int) -> bool:
        """Write layer ``layer`` of the sequence's new pages (one paged write per segment).

        Returns False without writing once the job is over (cancelled by the decoder, aborted
        or failed). Each layer is written once; a bad layer index raises ``ConfigError``.
        """
        return self._prefiller._write_layer(self, layer)

    def write_all(self) -> int:
        """Write every layer not written yet; returns how many were submitted."""
        return sum(self.write_layer(i) for i in range(len(self._requests)) if not self._written[i])

    def abort(self, reason: str = "aborted by the prefill") -> None:
        """Give the request up: no more layers are written; the decoder's request fails with
        ``RequestAborted`` once the writes already submitted have completed."""
        self._prefiller._abort(self, reason)

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """None if every layer was written and every write completed; else why not
        (``RequestCancelled``, ``RequestAborted``, a transport error)."""
        limit = self._prefiller.timeout if timeout is None else timeout
        try:
            return self._future.exception(None if math.isinf(limit) else limit)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(
                f"job {self.request.request_id!r} not over after {limit:g} s "
                f"({self.layers_written}/{len(self._requests)} layers written)"
            ) from None

    def wait(self, timeout: float | None = None) -> None:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc

    async def _await(self) -> None:
        await asyncio.wrap_future(self._future)

    def __await__(self) -> Generator[Any, None, None]:
        return self._await().__await__()

    def __repr__(self) -> str:
        return (
            f"<PrefillJob {self.request.request_id!r} imm={self.imm:#x} "
            f"layers={self.layers_written}/{len(self._requests)} done={self.done()}>"
        )


class KvPrefiller:
    """The prefill instance's side of the KV-cache transfer, over ``engine``.

    ``caches`` are its layer tensors (checked against ``layout`` and registered; the source of
    every write). ``routing`` spreads each paged write over the group's NICs (default: all).
    """

    def __init__(
        self,
        engine: TransferEngine,
        layout: KvLayout,
        caches: Any,
        *,
        max_inflight: int = 8,
        routing: Routing = Sharded(),
        timeout: float = 60.0,
        poll_interval_s: float = 0.05,
    ) -> None:
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ConfigError(f"max_inflight must be a positive int, got {max_inflight!r}")
        if not timeout > 0 or not poll_interval_s > 0:
            raise ConfigError("timeout and poll_interval_s must be positive")
        self.engine = engine
        self.layout = layout
        self.routing = routing
        self.timeout = timeout
        self.max_inflight = max_inflight
        self._poll = poll_interval_s
        self._cache = RegisteredCache(engine, layout, caches)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._lock = Guard()
        self._arrived = threading.Condition(self._lock.rlock)
        self._decoders: dict[bytes, _Decoder] = {}
        self._incoming: dict[tuple[bytes, int], _Incoming] = {}
        self._queue: deque[tuple[bytes, int]] = deque()
        self._jobs: dict[tuple[bytes, int], PrefillJob] = {}
        self._completed = self._cancelled = self._failed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvcache-prefiller", daemon=True)
        self._thread.start()

    @property
    def address(self) -> DomainAddress:
        return self.engine.address

    def _limit(self, timeout: float | None) -> float:
        limit = self.timeout if timeout is None else timeout
        if not limit >= 0:
            raise ConfigError(f"timeout must be >= 0, got {timeout!r}")
        return limit

    # --- taking requests ---------------------------------------------------------------
    def next_request(self, timeout: float | None = None) -> DecodeRequest:
        """The oldest decoder request nobody has taken yet; ``TransferTimeout`` if none comes."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        with self._lock:
            while True:
                if self._closed:
                    raise EngineClosed("this KvPrefiller is closed")
                while self._queue:
                    key = self._queue.popleft()
                    inc = self._incoming.get(key)
                    if inc is not None and not inc.offered:
                        inc.offered = True
                        return inc.request
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no decoder request within {limit:g} s")
                self._arrived.wait(None if math.isinf(left) else left)

    def _find(self, request: DecodeRequest | str, deadline: float, limit: float) -> _Incoming:
        """The incoming request (waiting for one with that id to arrive); lock held."""
        if isinstance(request, DecodeRequest):
            inc = self._incoming.get((request.decoder.raw, request.seq))
            if inc is None:
                if (request.decoder.raw, request.seq) in self._jobs:
                    raise ConfigError(f"request {request.request_id!r} has begun already")
                dec = self._decoders.get(request.decoder.raw)
                if dec is not None and dec.lost is not None:
                    raise PeerUnreachable(f"decoder {request.decoder} is gone", peer=str(request.decoder))
                raise RequestCancelled(f"request {request.request_id!r} was cancelled by its decoder")
            return inc
        if not isinstance(request, str):
            raise ConfigError(
                f"request must be a DecodeRequest or a request id, got {type(request).__name__}"
            )
        while True:
            if self._closed:
                raise EngineClosed("this KvPrefiller is closed")
            for inc in self._incoming.values():  # insertion order: the oldest first
                if inc.request.request_id == request:
                    return inc
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"no decoder asked for request {request!r} within {limit:g} s")
            self._arrived.wait(None if math.isinf(left) else left)

    def begin(
        self, request: DecodeRequest | str, src_pages: Any, *, timeout: float | None = None
    ) -> PrefillJob:
        """Start writing ``request`` (a ``DecodeRequest``, or a request id to wait for) from
        ``src_pages``: this instance's block table for the whole sequence (``num_pages``
        entries; the first ``prefix_pages`` are skipped).

        Waits up to ``timeout`` for a free slot (and for the request, given by id):
        ``TransferTimeout`` then. ``RequestCancelled`` if the decoder cancelled it meanwhile;
        ``ConfigError`` for a bad block table (the decoder's request then fails too).
        """
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        if self._closed:
            raise EngineClosed("this KvPrefiller is closed")
        if not self._slots.acquire(timeout=None if math.isinf(limit) else limit):
            raise TransferTimeout(f"all {self.max_inflight} job slots stayed busy for {limit:g} s")
        try:
            with self._lock:
                inc = self._find(request, deadline, limit)
                job = self._start(inc, src_pages)
        except BaseException:
            self._slots.release()
            raise
        return job

    def _start(self, inc: _Incoming, src_pages: Any) -> PrefillJob:
        """Claim ``inc`` and build its writes; a bad block table rejects it (lock held)."""
        req = inc.request
        key = (req.decoder.raw, req.seq)
        try:
            src = as_pages(src_pages, "src_pages")
            if src.size != req.num_pages:
                raise ConfigError(
                    f"src_pages has {src.size} entries but request {req.request_id!r} spans "
                    f"{req.num_pages} pages ({req.prefix_pages} prefix pages are skipped)"
                )
            src = src[req.prefix_pages :]
            if int(src.min()) < 0 or int(src.max()) >= self.layout.num_blocks:
                raise ConfigError(f"src_pages must lie in [0, {self.layout.num_blocks}) (this cache's pages)")
            units = [(unit, *unit.pages(src, inc.dst)) for unit in inc.decoder.units]
            requests = [
                [self._paged(layer, unit, inc, sp, dp) for unit, sp, dp in units]
                for layer in range(self.layout.num_layers)
            ]
            # The decoder armed its counter with its own computation: hold it to what the
            # engine will really count for these requests.
            count = sum(self.engine.imms_at_target(r)[0] for r in requests[0]) * self.layout.num_layers
            if count != inc.expected:
                raise ConfigError(
                    f"the decoder expects {inc.expected} imms for request {req.request_id!r} but these "
                    f"writes carry {count}: the two sides disagree on the count rule"
                )
        except ConfigError as exc:
            self._incoming.pop(key, None)
            self._reply(
                inc.decoder, wire.Done(req.seq, wire.Status.REJECTED, True, 0, "ConfigError", str(exc))
            )
            self._failed += 1
            raise
        del self._incoming[key]
        job = PrefillJob(self, inc, src, requests)
        self._jobs[key] = job
        return job

    def _paged(
        self, layer: int, unit: WriteUnit, inc: _Incoming, src: Pages, dst: Pages
    ) -> PagedWriteRequest:
        own, theirs = unit.src, unit.dst
        return PagedWriteRequest(
            self._cache.regions[layer][own.tensor],
            src,
            own.stride,
            inc.decoder.descriptors[layer][theirs.tensor],
            dst,
            theirs.stride,
            unit.length,
            own.offset,
            theirs.offset,
            inc.imm,
            self.routing,
        )

    # --- writing -----------------------------------------------------------------------
    def _write_layer(self, job: PrefillJob, layer: int) -> bool:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ConfigError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < len(job._requests):
            raise ConfigError(f"layer {layer} is outside [0, {len(job._requests)})")
        with self._lock:
            if job._finished or job._cancelled or job._error is not None or job._abort_reason is not None:
                return False
            if job._written[layer]:
                raise ConfigError(f"layer {layer} of request {job.request.request_id!r} was written already")
            job._written[layer] = True
            requests = job._requests[layer]
            job._outstanding += len(requests)  # before submitting: a fast completion must not end the job
        for i, request in enumerate(requests):
            try:
                transfer = self.engine.submit(request)
            except BaseException as exc:
                with self._lock:
                    job._outstanding -= len(requests) - i  # these were never posted
                    if job._error is None:
                        job._error = exc
                    self._maybe_finish(job)
                raise
            self._watch(job, transfer)
        return True

    def _watch(self, job: PrefillJob, transfer: Transfer) -> None:
        def done(t: Transfer) -> None:
            self._transfer_done(job, t)

        def failed(_t: Transfer, exc: BaseException) -> None:
            self._transfer_failed(job, exc)

        transfer.on_done(done)
        transfer.on_error(failed)

    def _transfer_done(self, job: PrefillJob, transfer: Transfer) -> None:
        with self._lock:
            job._outstanding -= 1
            job._imms_sent += transfer.imms_at_target
            self._maybe_finish(job)

    def _transfer_failed(self, job: PrefillJob, exc: BaseException) -> None:
        with self._lock:
            job._outstanding -= 1
            job._exact = False  # some of its work requests may have been counted, some not
            if job._error is None:
                job._error = exc
            if isinstance(exc, PeerUnreachable):
                self._decoder_lost(job._incoming.decoder, exc)
            self._maybe_finish(job)

    def _abort(self, job: PrefillJob, reason: str) -> None:
        with self._lock:
            if job._finished or job._abort_reason is not None:
                return
            job._abort_reason = reason
            self._maybe_finish(job)

    def _maybe_finish(self, job: PrefillJob) -> None:
        """End the job once nothing it submitted is outstanding and nothing more will be (lock held)."""
        stopped = job._cancelled or job._error is not None or job._abort_reason is not None
        if job._finished or job._outstanding or not (stopped or job._written.all()):
            return
        job._finished = True
        req = job.request
        outcome: BaseException | None
        if job._error is not None:
            rejected = isinstance(job._error, ConfigError) and job._exact
            status = wire.Status.REJECTED if rejected else wire.Status.FAILED
            done = wire.Done(
                req.seq, status, job._exact, job._imms_sent, wire.error_name(job._error), str(job._error)
            )
            outcome = job._error
            self._failed += 1
        elif job._abort_reason is not None:
            done = wire.Done(
                req.seq, wire.Status.ABORTED, True, job._imms_sent, "RequestAborted", job._abort_reason
            )
            outcome = RequestAborted(f"request {req.request_id!r} aborted: {job._abort_reason}")
            self._failed += 1
        elif job._written.all():
            done = wire.Done(req.seq, wire.Status.OK, True, job._imms_sent)
            outcome = None
            self._completed += 1
        else:
            done = wire.Done(req.seq, wire.Status.CANCELLED, True, job._imms_sent, "RequestCancelled")
            outcome = RequestCancelled(f"request {req.request_id!r} was cancelled by its decoder")
            self._cancelled += 1
        key = (req.decoder.raw, req.seq)
        self._jobs.pop(key, None)
        job._incoming.decoder.finish(req.seq)
        self._reply(job._incoming.decoder, done)
        self._slots.release()
        self._lock.defer(job._future, outcome)

    # --- control messages --------------------------------------------------------------
    def _reply(self, decoder: _Decoder, msg: wire.Msg) -> None:
        if decoder.lost is not None or self.engine.closed:
            return
        try:
            sent = self.engine.submit_send(decoder.address, wire.encode(msg))
        except FabricError as exc:
            logger.warning("kvcache: could not answer decoder %s: %s", decoder.address, exc)
            return
        sent.on_error(lambda _t, exc: self._reply_failed(decoder, exc))

    def _reply_failed(self, decoder: _Decoder, exc: BaseException) -> None:
        if isinstance(exc, PeerUnreachable):
            with self._lock:
                self._decoder_lost(decoder, exc)
        else:
            logger.warning("kvcache: message to decoder %s failed: %s", decoder.address, exc)

    def _decoder_lost(self, decoder: _Decoder, exc: BaseException) -> None:
        """Drop the requests a dead decoder left waiting; its running jobs fail on their own."""
        if decoder.lost is not None:
            return
        decoder.lost = exc
        logger.info("kvcache: decoder %s lost: %s", decoder.address, exc)
        for key in [k for k, inc in self._incoming.items() if inc.decoder is decoder]:
            del self._incoming[key]

    def _serve(self) -> None:
        while not self._closed:
            try:
                got = wire.next_message(self.engine, self._poll, "prefiller")
            except EngineClosed as exc:
                self._engine_gone(exc)
                return
            if got is None:
                continue
            message, msg = got
            try:
                with self._lock:
                    if isinstance(msg, wire.Hello):
                        self._on_hello(message.peer, msg)
                    elif isinstance(msg, wire.Request):
                        self._on_request(message.peer, msg)
                    elif isinstance(msg, wire.Cancel):
                        self._on_cancel(message.peer, msg)
                    else:
                        logger.warning(
                            "kvcache: a prefiller got a %s from %s", type(msg).__name__, message.peer
                        )
            except Exception:
                logger.exception("kvcache: handling %s from %s failed", type(msg).__name__, message.peer)

    def _on_hello(self, peer: DomainAddress, hello: wire.Hello) -> None:
        caps = self.engine.capabilities
        layout = hello.layout
        error = ""
        try:
            self.layout.check_compatible(layout)
            per = layout.tensors_per_layer
            if len(hello.descriptors) != layout.num_layers * per:
                raise ConfigError(
                    f"{len(hello.descriptors)} descriptors for {layout.num_layers} layers of {per}"
                )
            for d in hello.descriptors:
                if len(d.nics) != caps.num_nics:
                    raise ConfigError(
                        f"the decoder's memory has {len(d.nics)} NIC keys, this prefill has "
                        f"{caps.num_nics} NICs: both sides must use the same NIC count"
                    )
                if not d.writable or d.length < layout.tensor_nbytes:
                    raise ConfigError("a decoder descriptor is read-only or smaller than its layer tensor")
        except ConfigError as exc:
            error = str(exc)
        if error:
            logger.warning("kvcache: refused decoder %s: %s", peer, error)
        else:
            descs = tuple(
                hello.descriptors[i * layout.tensors_per_layer : (i + 1) * layout.tensors_per_layer]
                for i in range(layout.num_layers)
            )
            old = self._decoders.get(peer.raw)
            dec = _Decoder(peer, layout, descs, write_units(self.layout, layout))
            if old is not None:  # a decoder reconnecting keeps its request history
                dec.finished, dec.finished_set, dec.tombstones = (
                    old.finished,
                    old.finished_set,
                    old.tombstones,
                )
            self._decoders[peer.raw] = dec
        tmp = _Decoder(peer, layout, (), ())
        self._reply(tmp, wire.Ack(not error, caps.num_nics, caps.max_msg_size, self.layout, error))

    def _on_request(self, peer: DomainAddress, msg: wire.Request) -> None:
        dec = self._decoders.get(peer.raw)
        if dec is None:
            tmp = _Decoder(peer, self.layout, (), ())
            self._reply(
                tmp, wire.Done(msg.seq, wire.Status.REJECTED, True, 0, "ConfigError", "connect first")
            )
            return
        if dec.tombstones.pop(msg.seq, None) is not None:  # its CANCEL overtook it
            dec.finish(msg.seq)
            self._reply(dec, wire.Done(msg.seq, wire.Status.CANCELLED, True, 0, "RequestCancelled"))
            return
        problem = ""
        if msg.pages.size == 0:
            problem = "no pages to write"
        elif int(msg.pages.min()) < 0 or int(msg.pages.max()) >= dec.layout.num_blocks:
            problem = f"destination pages outside [0, {dec.layout.num_blocks})"
        elif np.unique(msg.pages).size != msg.pages.size:
            problem = "a destination page is named twice"
        elif self._closed:
            problem = "the prefill is closing"
        if problem:
            dec.finish(msg.seq)
            self._reply(dec, wire.Done(msg.seq, wire.Status.REJECTED, True, 0, "ConfigError", problem))
            return
        request = DecodeRequest(msg.request_id, peer, msg.seq, msg.skip + int(msg.pages.size), msg.skip)
        key = (peer.raw, msg.seq)
        self._incoming[key] = _Incoming(request, dec, msg.imm, msg.expected, msg.pages)
        self._queue.append(key)
        self._arrived.notify_all()

    def _on_cancel(self, peer: DomainAddress, msg: wire.Cancel) -> None:
        dec = self._decoders.get(peer.raw)
        if dec is None or msg.seq in dec.finished_set:
            return
        key = (peer.raw, msg.seq)
        job = self._jobs.get(key)
        if job is not None:
            job._cancelled = True
            self._maybe_finish(job)
            return
        if self._incoming.pop(key, None) is not None:
            dec.finish(msg.seq)
            self._cancelled += 1
            self._reply(dec, wire.Done(msg.seq, wire.Status.CANCELLED, True, 0, "RequestCancelled"))
            return
        now = time.monotonic()
        self._cancelled += 1
        dec.tombstones[msg.seq] = now
        for seq, at in list(dec.tombstones.items()):
            if now - at > _TOMBSTONE_TTL_S:
                del dec.tombstones[seq]

    def _engine_gone(self, cause: EngineClosed) -> None:
        with self._lock:
            self._closed = True
            self._incoming.clear()
            for job in list(self._jobs.values()):
                if job._error is None:  # its writes are failed by the engine and end the job
                    job._error = engine_gone("the prefill's engine closed with this job in flight", cause)
                self._maybe_finish(job)
            self._arrived.notify_all()

    # --- state ---------------------------------------------------------------------------
    def stats(self) -> PrefillerStats:
        with self._lock:
            return PrefillerStats(
                waiting=len(self._incoming),
                inflight=len(self._jobs),
                completed=self._completed,
                cancelled=self._cancelled,
                failed=self._failed,
            )

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new work, tell waiting decoders, stop running jobs (their submitted writes
        still complete), stop the service thread and deregister the cache. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for inc in list(self._incoming.values()):
                inc.decoder.finish(inc.request.seq)
                self._reply(
                    inc.decoder,
                    wire.Done(
                        inc.request.seq, wire.Status.ABORTED, True, 0, "RequestAborted", "prefill closed"
                    ),
                )
            self._incoming.clear()
            for job in list(self._jobs.values()):
                if job._abort_reason is None:
                    job._abort_reason = "prefill closed"
                self._maybe_finish(job)
            self._arrived.notify_all()
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()) + self._poll)
        self._cache.close()

    def __enter__(self) -> KvPrefiller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<KvPrefiller {self.address} inflight={s.inflight}/{self.max_inflight} waiting={s.waiting}>"
