"""The training side: each trainer rank writes its part of every step straight into the
destinations' registered parameter memory.

A ``WeightsSender`` is built once per trainer rank from the plan, its own buffer (its layout
in ``plan.source``) and every destination's descriptor; it turns its rows of the plan into
requests once:

* plain copies: one scatter per (destination, NIC), ``Pinned`` to that NIC, straight from the
  registered source buffer (every row is one work request, so one imm at the destination);
* cast rows: staging chunks. For each, the sender takes a slot of its staging pool (a
  registered buffer bounded by the watermark), casts the source elements into it with torch
  and writes the slot out; the slot returns to the pool when the write completes at the
  sender. Casting the next chunk overlaps the writes of the previous ones, and the plain
  copies are on the wire meanwhile.

``send_step(step)`` replays that with the step's imm and returns once every write has
completed at this side (the bytes are in place at the destinations, so the caller may
overwrite its buffer). Destinations are visited in an order rotated by the sender's rank, so
the trainers do not all start on the same inference rank. A destination that fails (lost,
refused access) fails only its own writes: the others still get every byte, and
``send_step`` raises ``StepFailed`` naming it. The sender never starts a step while a write of
an earlier one is still in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fabric_core.api import TransferEngine
from fabric_core.errors import ConfigError, EngineClosed, FabricError, TransferTimeout
from fabric_core.models import MemoryRegionDescriptor
from fabric_core.ops import PeerGroup, Pinned, ScatterRequest, ScatterTarget
from fabric_core.rendezvous import Store
from fabric_core.transfer import Transfer

from . import _torch
from ._staging import StagingPool
from .errors import step_error
from .plan import PlanOptions, TransferPlan
from .spec import FleetSpec

__all__ = ["SendReport", "WeightsSender"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
_SLOT_ALIGN = 256  # staging slots start at multiples of this: aligned for every dtype (and for DMA)
_PIECE_BYTES = 16 << 20
"""Plain copies go out in scatters of about this many bytes (at least one row), interleaved
across destinations: see ``WeightsSender._make_requests``."""


@dataclass(frozen=True, slots=True)
class SendReport:
    """What one ``send_step`` did at one sender."""

    step: int
    bytes: int
    """Bytes written (at the destinations' dtype)."""
    writes: int
    destinations: int
    staged_bytes: int
    """Bytes that went through the staging pool (cast)."""
    staging_high_water: int
    """Most staging bytes held at once during the step (at most the watermark)."""
    seconds: float


@dataclass(frozen=True, slots=True)
class _Chunk:
    dst: int
    nic: int
    src_offset: int
    src_length: int
    dst_offset: int
    length: int
    cast: int  # -1: same dtype (a packed chunk)
    stride: int  # packed: source bytes from one piece to the next (0: one contiguous piece)
    count: int  # pieces


class _Outcome:
    """Per-destination failures of one step (written from callback threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failed: dict[int, BaseException] = {}

    def fail(self, dst: int, exc: BaseException) -> None:
        with self._lock:
            self.failed.setdefault(dst, exc)

    def has_failed(self, dst: int) -> bool:
        with self._lock:
            return dst in self.failed


def _limit(timeout: float | None, default: float) -> float:
    limit = default if timeout is None else float(timeout)
    if not limit > 0:
        raise ConfigError(f"timeout must be positive, got {timeout!r}")
    return limit


def _pieces(rows: list[tuple[int, int, int]], limit: int) -> list[list[tuple[int, int, int]]]:
    """``rows`` (length first) cut into runs of at least one row and, past the first row,
    at most ``limit`` bytes."""
    out: list[list[tuple[int, int, int]]] = []
    size = 0
    for row in rows:
        if not out or (size + row[0] > limit and size > 0):
            out.append([])
            size = 0
        out[-1].append(row)
        size += row[0]
    return out


class WeightsSender:
    """Rank ``rank`` of the source fleet: writes its rows of ``plan`` every step.

    ``buffer`` is this rank's source buffer (``plan.source.layout(rank)``: a contiguous numpy
    array or torch tensor of at least ``nbytes``), registered here read-only.
    ``destinations[d]`` is destination rank ``d``'s descriptor. ``staging_bytes`` overrides the
    plan's staging watermark (it must still hold one chunk). ``timeout`` is the default
    deadline of ``send_step`` in seconds.
    """

    def __init__(
        self,
        engine: TransferEngine,
        plan: TransferPlan,
        rank: int,
        buffer: Any,
        destinations: Sequence[MemoryRegionDescriptor],
        *,
        staging_bytes: int | None = None,
        timeout: float | None = None,
    ) -> None:
        S, D = plan.source.world_size, plan.destination.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < S:
            raise ConfigError(f"source rank {rank!r} is outside [0, {S})")
        self.engine, self.plan, self.rank = engine, plan, rank
        self._timeout = _limit(timeout, DEFAULT_TIMEOUT_S)
        o = plan.options
        if engine.num_nics != o.num_nics:
            raise ConfigError(f"the plan routes over {o.num_nics} NICs, this engine has {engine.num_nics}")
        if engine.capabilities.max_msg_size < o.max_write_bytes:
            raise ConfigError(
                f"the plan's writes reach {o.max_write_bytes} bytes, above this engine's max_msg_size "
                f"{engine.capabilities.max_msg_size}: plan with max_write_bytes <= the senders' max_msg_size"
            )
        dests = tuple(destinations)
        if len(dests) != D:
            raise ConfigError(f"the plan has {D} destination ranks, {len(dests)} descriptors were given")
        for d, desc in enumerate(dests):
            if not isinstance(desc, MemoryRegionDescriptor):
                raise ConfigError(
                    f"destinations[{d}] must be a MemoryRegionDescriptor, got {type(desc).__name__}"
                )
            need = plan.destination.layout(d).nbytes
            if desc.length < need:
                raise ConfigError(
                    f"destination {d}'s registered buffer is {desc.length} bytes, its layout needs {need}"
                )
        self.destinations = dests
        layout = plan.source.layout(rank)
        self.region = engine.register(buffer, writable=False)
        self._pool: StagingPool | None = None
        try:
            if self.region.length < layout.nbytes:
                raise ConfigError(
                    f"source rank {rank}'s buffer is {self.region.length} bytes, "
                    f"its layout needs {layout.nbytes}"
                )
            self._build(buffer, o, staging_bytes)
        except BaseException:
            self._release()
            raise
        self._lock = threading.Lock()
        self._last_step = -1
        self._inflight: list[Transfer] = []
        self._closed = False

    def _build(self, buffer: Any, o: PlanOptions, staging_bytes: int | None) -> None:
        plan, rank = self.plan, self.rank
        D = plan.destination.world_size
        c = {k: v[plan.source_rows(rank)].tolist() for k, v in plan.columns.items()}
        src_len = plan.src_lengths()[plan.source_rows(rank)].tolist()
        n = len(c["length"])
        self.bytes_per_step = int(sum(c["length"]))
        self.writes_per_step = n
        staged = [k >= 0 or m > 1 for k, m in zip(c["cast"], c["count"], strict=True)]
        self.staged_per_step = int(sum(ln for ln, st in zip(c["length"], staged, strict=True) if st))
        self.destination_ranks = tuple(sorted(set(c["dst_rank"])))
        self._turn = {d: (d - rank) % D for d in range(D)}
        self._raw: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        chunks: list[_Chunk] = []
        for i in range(n):
            d, nic, cast = c["dst_rank"][i], c["nic"][i], c["cast"][i]
            if not staged[i]:
                self._raw.setdefault((d, nic), []).append(
                    (c["length"][i], c["src_offset"][i], c["dst_offset"][i])
                )
            else:
                chunks.append(
                    _Chunk(
                        d, nic, c["src_offset"][i], src_len[i], c["dst_offset"][i], c["length"][i], cast,
                        c["src_stride"][i], c["count"][i],
                    )
                )  # fmt: skip
        self._make_requests()
        # staged chunks interleaved across destinations: every destination's k-th chunk (in
        # this rank's rotation) before any destination's (k+1)-th, so the writes in flight (at
        # most the staging slots) spread over all this rank's destinations. One destination
        # at a time made ranks that feed the same few destinations (expert shards) start on
        # the same one and queue there: `fabric sim rl` predicted 8.7 s instead of 1.3 s for
        # a Kimi-K2 update at 256 -> 128 GPUs, with the receivers 15% busy.
        nth: dict[int, int] = {}
        keyed: list[tuple[tuple[int, int, int], _Chunk]] = []
        for ch in sorted(chunks, key=lambda ch: (ch.dst, ch.dst_offset)):
            k = nth.get(ch.dst, 0)
            nth[ch.dst] = k + 1
            keyed.append(((k, self._turn[ch.dst], ch.dst_offset), ch))
        self._chunks = [ch for _, ch in sorted(keyed, key=lambda kc: kc[0])]
        if self._chunks:
            self._bytes: Any = _torch.byte_view(buffer)
            self._dtypes = [(_torch.dtype(a), _torch.dtype(b)) for a, b in plan.casts]
            capacity = o.staging_bytes if staging_bytes is None else staging_bytes
            # slots as large as the largest chunk, each starting aligned for any dtype view (a
            # watermark too small for one aligned slot gets a single slot, at offset 0)
            largest = max(ch.length for ch in self._chunks)
            slot = -(-largest // _SLOT_ALIGN) * _SLOT_ALIGN
            if slot > int(capacity) >= largest:
                slot = int(capacity)
            self._pool = StagingPool(self.engine, int(capacity), slot, self._bytes.device)
            self._cuda = self._bytes.device.type == "cuda"

    def _make_requests(self) -> None:
        """The scatters of plain copies: per (destination, NIC), pieces of about
        ``_PIECE_BYTES``, submitted interleaved: every destination's k-th piece (in this
        rank's rotation) before any destination's (k+1)-th.

        The engine posts a NIC's work requests in submission order, so one scatter per
        destination fed the destinations one after another, and senders that began with the
        same destination queued there (on a network: incast). On shm a receiver holds its
        queue's lock while it copies and a sender posting to it waits inside the provider
        meanwhile. Measured: 2 -> 2 ranks, 1 GiB, on 2 cores 330 -> 278 ms; on 16 cores no
        change beyond the spread between runs."""
        self._group: PeerGroup | None = (
            self.engine.peer_group([self.destinations[d] for d in self.destination_ranks])
            if self.destination_ranks
            else None
        )
        imm0 = self.plan.imm(0, self.rank)
        keyed: list[tuple[tuple[int, int, int], int, ScatterRequest]] = []
        for (d, nic), rows in self._raw.items():
            desc = self.destinations[d]
            for k, piece in enumerate(_pieces(rows, _PIECE_BYTES)):
                targets = tuple(ScatterTarget(desc, ln, so, do) for ln, so, do in piece)
                req = ScatterRequest(self.region, targets, None, Pinned(nic), self._group)
                # the plan counts one imm per row; hold the engine's own count rule to it
                if self.engine.imms_at_target(replace(req, imm=imm0)) != (1,) * len(targets):
                    raise ConfigError(
                        f"this engine would split rows of the plan into more work requests than "
                        f"planned (destination {d}, NIC {nic}): the plan's max_write_bytes exceeds "
                        f"what it sends whole"
                    )
                keyed.append(((k, self._turn[d], nic), d, req))
        keyed.sort(key=lambda kdr: kdr[0])
        self._scatters = [(d, req) for _, d, req in keyed]

    def replace_destination(self, rank: int, descriptor: MemoryRegionDescriptor) -> None:
        """Destination ``rank`` came back (a restarted inference rank, a new registration):
        write to ``descriptor`` from the next step on. The plan does not change."""
        D = self.plan.destination.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < D:
            raise ConfigError(f"destination rank {rank!r} is outside [0, {D})")
        if not isinstance(descriptor, MemoryRegionDescriptor):
            raise ConfigError(f"descriptor must be a MemoryRegionDescriptor, got {type(descriptor).__name__}")
        if descriptor.length < self.plan.destination.layout(rank).nbytes:
            raise ConfigError(f"destination {rank}'s new buffer is smaller than its layout")
        with self._lock:
            dests = list(self.destinations)
            dests[rank] = descriptor
            old, self.destinations = self.destinations, tuple(dests)
            try:
                self._make_requests()
            except BaseException:
                self.destinations = old
                self._make_requests()
                raise

    # --- setup through a torch.distributed Store ------------------------------------------
    @classmethod
    def connect(
        cls,
        engine: TransferEngine,
        store: Store,
        *,
        rank: int,
        source: FleetSpec,
        buffer: Any,
        options: PlanOptions | None = None,
        prefix: str = "fabric-weights",
        timeout: float = DEFAULT_TIMEOUT_S,
        staging_bytes: int | None = None,
    ) -> WeightsSender:
        """Join the exchange under ``prefix`` in ``store`` (once), compute the plan and build
        the sender. Source rank 0 publishes the source spec and ``options``; every rank
        publishes its address and engine limits; the plan is computed by every rank from the
        gathered metadata and checked against source rank 0's digest."""
        from ._exchange import exchange

        ex = exchange(
            store,
            side="source",
            rank=rank,
            spec=source,
            engine=engine,
            options=options,
            descriptor=None,
            prefix=prefix,
            timeout=timeout,
        )
        return cls(
            engine, ex.plan, rank, buffer, ex.descriptors, staging_bytes=staging_bytes, timeout=timeout
        )

    # --- the step --------------------------------------------------------------------------
    @property
    def staging(self) -> StagingPool | None:
        """The staging pool (None when this rank casts nothing)."""
        return self._pool

    @property
    def last_step(self) -> int:
        return self._last_step

    def send_step(self, step: int, timeout: float | None = None) -> SendReport:
        """Write this rank's part of ``step`` and wait until every write completed here.

        Steps must increase. Raises ``StepFailed`` (``StepPeerLost``, ``StepTimeout``) naming
        the destinations whose writes failed; the other destinations got all their bytes.
        A step that timed out leaves its writes running: the next ``send_step`` first waits
        for them (within its own deadline) and raises ``StepTimeout`` without starting if they
        are still running.
        """
        limit = _limit(timeout, self._timeout)
        deadline = time.monotonic() + limit
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        with self._lock:
            if self._closed:
                raise EngineClosed("this WeightsSender is closed")
            if step <= self._last_step:
                raise ConfigError(f"step {step} is not after the last step sent ({self._last_step})")
            self._settle_previous(step, deadline)
            self._last_step = step
            return self._send(step, deadline)

    def _settle_previous(self, step: int, deadline: float) -> None:
        for t in self._inflight:
            try:
                t.exception(max(0.0, deadline - time.monotonic()))
            except TransferTimeout:
                raise step_error(
                    step=step,
                    side="source",
                    rank=self.rank,
                    failed={},
                    timeout=True,
                    note="writes of the previous step are still in flight; the step was not started",
                ) from None
        if self._pool is not None and not self._pool.wait_idle(deadline):
            raise step_error(
                step=step,
                side="source",
                rank=self.rank,
                failed={},
                timeout=True,
                note="the staging pool did not drain",
            )
        self._inflight = []

    def _send(self, step: int, deadline: float) -> SendReport:
        imm = self.plan.imm(step, self.rank)
        t0 = time.monotonic()
        outcome = _Outcome()
        transfers: list[tuple[int, Transfer]] = []
        try:
            for d, req in self._scatters:
                t = self.engine.submit(replace(req, imm=imm))
                t.on_error(self._on_error(outcome, d))
                transfers.append((d, t))
            if self._chunks:
                self._send_chunks(imm, deadline, outcome, transfers)
        finally:
            self._inflight = [t for _, t in transfers]
        for d, t in transfers:
            try:
                exc = t.exception(max(0.0, deadline - time.monotonic()))
            except TransferTimeout as timed_out:
                exc = timed_out
            if exc is not None:
                outcome.fail(d, exc)
        # staging slots are released by the transfers' callbacks, just after they complete:
        # the step is over once they are all back (the next step would wait for them anyway)
        if self._pool is not None and not outcome.failed:
            self._pool.wait_idle(deadline)
        high = self._pool.high_water if self._pool is not None else 0
        if outcome.failed:
            completed = tuple(d for d in self.destination_ranks if d not in outcome.failed)
            raise step_error(
                step=step, side="source", rank=self.rank, failed=outcome.failed, completed=completed
            )
        self._inflight = []
        return SendReport(
            step,
            self.bytes_per_step,
            self.writes_per_step,
            len(self.destination_ranks),
            self.staged_per_step,
            high,
            time.monotonic() - t0,
        )

    @staticmethod
    def _on_error(outcome: _Outcome, d: int) -> Callable[[Transfer, BaseException], None]:
        def failed(_t: Transfer, exc: BaseException) -> None:
            outcome.fail(d, exc)

        return failed

    def _send_chunks(
        self, imm: int, deadline: float, outcome: _Outcome, transfers: list[tuple[int, Transfer]]
    ) -> None:
        pool = self._pool
        assert pool is not None
        pool.reset_high_water()
        torch = _torch.module()
        for i, ch in enumerate(self._chunks):
            if outcome.has_failed(ch.dst):
                continue  # the destination failed: its remaining chunks are not worth casting
            offset = pool.acquire(ch.length, deadline)
            if offset is None:
                for late in self._chunks[i:]:
                    outcome.fail(late.dst, TransferTimeout("no staging slot freed up before the deadline"))
                return
            try:
                self._stage(ch, pool.buffer[offset : offset + ch.length])
                if self._cuda:
                    torch.cuda.current_stream(pool.buffer.device).synchronize()
                t = self.engine.submit_write(
                    pool.region,
                    offset,
                    ch.length,
                    self.destinations[ch.dst],
                    ch.dst_offset,
                    imm=imm,
                    routing=Pinned(ch.nic),
                )
            except BaseException:
                pool.release(offset, ch.length)
                raise
            t.on_done(self._release_slot(pool, offset, ch.length))
            t.on_error(self._release_failed(pool, offset, ch.length, outcome, ch.dst))
            transfers.append((ch.dst, t))

    def _stage(self, ch: _Chunk, slot: Any) -> None:
        """Cast and/or gather ``ch``'s source bytes into ``slot`` (its ``length`` bytes)."""
        torch = _torch.module()
        piece = ch.src_length // ch.count
        if ch.count > 1:  # the pieces, ``stride`` apart, as the rows of one 2-D view
            at = self._bytes.storage_offset() + ch.src_offset  # as_strided counts from the storage
            src = torch.as_strided(self._bytes, (ch.count, piece), (ch.stride, 1), at)
            dst = slot.view(ch.count, ch.length // ch.count)
        else:
            src = self._bytes[ch.src_offset : ch.src_offset + ch.src_length]
            dst = slot
        if ch.cast >= 0:
            src_dtype, dst_dtype = self._dtypes[ch.cast]
            src, dst = src.view(src_dtype), dst.view(dst_dtype)
        dst.copy_(src)

    @staticmethod
    def _release_slot(pool: StagingPool, offset: int, n: int) -> Callable[[Transfer], None]:
        def done(_t: Transfer) -> None:
            pool.release(offset, n)

        return done

    @staticmethod
    def _release_failed(
        pool: StagingPool, offset: int, n: int, outcome: _Outcome, d: int
    ) -> Callable[[Transfer, BaseException], None]:
        def failed(_t: Transfer, exc: BaseException) -> None:
            pool.release(offset, n)
            outcome.fail(d, exc)

        return failed

    # --- lifecycle ---------------------------------------------------------------------------
    def _release(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if not self.engine.closed:
            try:
                self.engine.deregister(self.region)
            except FabricError as exc:
                logger.debug("weights: deregistering the source buffer: %s", exc)

    def close(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout`` s) for writes in flight, then deregister. Idempotent; the
        engine stays open (it is the caller's)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            for t in self._inflight:
                try:
                    t.exception(max(0.0, deadline - time.monotonic()))
                except TransferTimeout:
                    logger.warning("weights: closing sender %d with a write still in flight", self.rank)
                    break
            self._release()

    def __enter__(self) -> WeightsSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<WeightsSender rank {self.rank}: {self.writes_per_step} writes, {self.bytes_per_step} bytes "
            f"to {len(self.destination_ranks)} destinations per step>"
        )
