"""``NativeEngine``: the Python side every compiled backend shares.

A compiled backend's module exposes an engine built on fabric-core's C++ binding
(``fabric/pyengine.hpp``: the engine core, the submit fast path, the counter table, completion
batches). ``NativeEngine`` drives it: plain single writes, paged writes and imms go to the C++
fast path, anything else through ``plan_request`` (the specification) to ``submit_write``; a
completion thread takes each batch of completions with the GIL held once, resolves transfers
and runs the counter waiters the imms fired; the counter table is the C++ one
(``NativeCounterTable``). A backend subclass opens its compiled engine and says what is its
own: capabilities, domains, and (for providers whose addresses name their process) the table
of endpoints closed in this process.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import diagnostics
from .api import EngineStats
from .base import EngineBase, Registration
from .counters import CounterTable, NativeCounterTable
from .errors import (
    CapabilityError,
    EngineClosed,
    EngineWedged,
    FabricError,
    PeerIncompatible,
    PeerUnreachable,
    RemoteAccessError,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from .memory import MemorySpan, index_array
from .models import Capabilities, DomainAddress, DomainInfo, MemoryRegion, MemoryRegionDescriptor
from .ops import (
    ImmRequest,
    Message,
    PagedWriteRequest,
    PeerGroup,
    Pinned,
    Plan,
    Request,
    Routing,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
)
from .settings import FabricSettings
from .stats import NicStats, PeerStats
from .transfer import FRESH_FIELDS, Transfer, new_transfer

if TYPE_CHECKING:
    from ._native_api import NativeCoreApi as NativeCore

__all__ = ["HEADER_BYTES", "NativeEngine", "queue_limits"]

logger = logging.getLogger(__name__)

_SHARDED = Sharded()
_ONE_NIC = Sharded(1)
_SHARD_PEERS = ShardPeers()
_NO_IMMS = (0,)
_HEADER = struct.Struct("<B")  # length of the sender's address, then the address, then the data
HEADER_BYTES = 1 + 255
"""What a control message carries besides its payload (the sender's address)."""
# Status codes of fabric/engine.hpp
_INCOMPATIBLE = 8
_STATUS: dict[int, type[TransportError]] = {
    1: PeerUnreachable,
    2: RemoteAccessError,
    3: TransportError,
    5: TransferTimeout,
    6: TransferCancelled,
    _INCOMPATIBLE: PeerIncompatible,
}
_CLOSED = 4
_DRAIN_S = 0.002  # how long a waiter drains completions itself before sleeping on its event
_JOIN_MIN_S = 10.0
"""close() waits at least this long for the engine's threads (else what is left of its timeout):
a thread still inside the provider after it is stuck there. Generous: a false alarm leaks the
engine, and a worker on a loaded host can take a second to leave."""
_WEDGE_JOIN_S = 1.0
"""How long an engine closing itself (EngineWedged) still waits for the thread stuck in the
provider: it has been stuck for liveness_timeout_s already."""
_WEDGED: list[object] = []
"""Wedged engines' cores and registered regions, kept alive for good: the provider may still
use them (see ``_backend_stop``)."""
_completers = itertools.count(1)


@atexit.register
def _close_at_exit() -> None:
    """Close what is still open before the interpreter finalizes: a completion thread that is
    waiting in C++ (GIL released) when finalization starts is killed as it takes the GIL back,
    by an unwind through C++ frames that aborts the process (SIGABRT at exit)."""
    for engine in diagnostics.open_engines():
        if not isinstance(engine, NativeEngine):
            continue
        with contextlib.suppress(Exception):
            engine.close(timeout=1.0)


def queue_limits(settings: FabricSettings, depth: int, allowance: int) -> tuple[int, int]:
    """The queue depth and its byte allowance an engine takes (Engine::configure_queue): the
    settings' ``queue_depth`` and ``queue_bytes`` where they choose, else the backend's
    ``depth`` and ``allowance``."""
    return (
        depth if settings.queue_depth is None else settings.queue_depth,
        allowance if settings.queue_bytes is None else settings.queue_bytes,
    )


class StallWatch:
    """How long one progress step has been seen running, from looks at it (NativeEngine._watch).

    ``look(step, now)`` takes the engine's ``progress_since()`` (when its running step began;
    0: none runs) and a ``time.monotonic()`` reading, and returns the seconds this step has been
    watched running. Only time between looks counts, at most ``gap_s`` per look: a process
    stopped as a whole (SIGSTOP, a debugger, a host paused) resumes mid-step without having
    been stuck in it, and a longer gap says the watcher did not run either.
    """

    __slots__ = ("_last", "_seen", "_step", "gap_s")

    def __init__(self, gap_s: float = 0.25) -> None:
        self.gap_s = gap_s
        self._step = 0
        self._seen = 0.0
        self._last = 0.0

    def look(self, step: int, now: float) -> float:
        if step == 0 or step != self._step:
            self._step, self._seen = step, 0.0
        else:
            self._seen += min(max(0.0, now - self._last), self.gap_s)
        self._last = now
        return self._seen


class NativeEngine(EngineBase):
    """A ``TransferEngine`` over a compiled engine (``core``) that is already open.

    ``guarded``: the provider's addresses name their process (shm), so writes to an endpoint
    closed in this process must fail before posting; subclasses then implement
    ``_is_closed`` and ``_mark_closed``. ``where`` names the transport in error messages.
    ``queue_depth``: the backend's choice where ``settings.queue_depth`` makes none, and
    ``queue_bytes`` where ``settings.queue_bytes`` makes none (Engine::configure_queue).
    ``drain_max_pages``: a thread waiting on a paged transfer of host memory with more pages
    than this sleeps on it rather than draining (None: it always drains; see _fast_paged).
    """

    def __init__(
        self,
        settings: FabricSettings,
        core: NativeCore,
        capabilities: Capabilities,
        domains: Sequence[DomainInfo],
        *,
        guarded: bool = False,
        where: str = "",
        queue_depth: int = 256,
        queue_bytes: int = 0,
        drain_max_pages: int | None = None,
    ) -> None:
        self._core = core
        self._drain_max_pages = drain_max_pages
        self._guarded = guarded
        self._where = where or capabilities.backend
        addresses = [DomainAddress(raw=a) for a in core.addresses()]
        self._inflight: dict[int, Transfer] = {}
        self._drain_hook = self._drain_wait  # bound once: every transfer carries it
        self._specs: dict[int, tuple[MemoryRegionDescriptor, tuple[list[bytes], list[int], int]]] = {}
        n = next(_completers)
        super().__init__(settings, capabilities, addresses, domains, f"fabric-{capabilities.backend}-cb-{n}")
        core.configure_fast(
            capabilities.max_msg_size,
            Sharded,
            Pinned,
            ShardPeers,
            MemoryRegionDescriptor,
            ScatterTarget,
            guarded,
        )
        core.configure_transfers(
            new_transfer(_NO_IMMS, self._dispatch, self._timeout, self._drain_hook, self._cancel_hook),
            FRESH_FIELDS,
            self._inflight,
        )
        self._header = _HEADER.pack(len(self.address.raw)) + self.address.raw
        core.configure_liveness(settings.liveness_interval_s, settings.liveness_timeout_s, settings.timeout_s)
        self.queue_depth, self.queue_bytes = queue_limits(settings, queue_depth, queue_bytes)
        core.configure_queue(self.queue_depth, self.queue_bytes)
        self._stop = False
        # The stall watchdog (_watch): progress inside one provider call this long closes the
        # engine (EngineWedged); the liveness probes that would find the peer run on the very
        # thread that is stuck.
        self._stall_limit = settings.liveness_timeout_s
        self._wedge: EngineWedged | None = None
        self._stall = StallWatch()
        self._completer = threading.Thread(
            target=self._complete, name=f"fabric-{capabilities.backend}-completion-{n}", daemon=True
        )
        self._completer.start()

    # --- the closed-endpoint table of guarded providers (see __init__) ----------------
    def _is_closed(self, address: bytes) -> bool:
        return False

    def _mark_closed(self, address: bytes) -> None:
        """This engine's own endpoint closes (guarded providers record it)."""

    # --- submit: planned in C++ when the request is plain, else by plan_request ---------
    # The core's fast_* calls plan and submit a plain request and return its Transfer, made
    # in C++ as a copy of the prototype configure_transfers gave it (set in __init__) and
    # entered in the in-flight table; None: plan_request's path takes it (and raises what is
    # wrong with it).
    def submit_write(
        self,
        src: MemoryRegion,
        src_offset: int,
        length: int,
        dst: MemoryRegionDescriptor,
        dst_offset: int = 0,
        *,
        imm: int | None = None,
        routing: Routing = _SHARDED,
        timeout: float | None = None,
    ) -> Transfer:
        limit = -1.0 if timeout is None else self._deadline(timeout)
        done = self._core.fast_write(src, src_offset, length, dst, dst_offset, imm, routing, limit)
        if done is not None:
            return done
        return super().submit(
            WriteRequest(src, src_offset, length, dst, dst_offset, imm, routing), timeout=timeout
        )

    def submit_imm(
        self,
        dst: MemoryRegionDescriptor,
        imm: int,
        *,
        routing: Routing = _ONE_NIC,
        timeout: float | None = None,
    ) -> Transfer:
        limit = -1.0 if timeout is None else self._deadline(timeout)
        done = self._core.fast_imm(dst, imm, routing, limit)
        return done if done is not None else super().submit(ImmRequest(dst, imm, routing), timeout=timeout)

    def submit_scatter(
        self,
        src: MemoryRegion,
        targets: Sequence[ScatterTarget],
        *,
        imm: int | None = None,
        routing: Routing = _SHARD_PEERS,
        group: PeerGroup | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        limit = -1.0 if timeout is None else self._deadline(timeout)
        done = self._fast_scatter(src, targets, imm, routing, group, limit)
        if done is not None:
            return done
        return super().submit(ScatterRequest(src, tuple(targets), imm, routing, group), timeout=timeout)

    def _fast_scatter(
        self, src: object, targets: object, imm: object, routing: object, group: object, limit: float
    ) -> Transfer | None:
        if group is None:
            members: frozenset[bytes] | None = None
        elif type(group) is PeerGroup and group.handle in self._made_groups:
            members = group._members
        else:
            return None  # plan_request says what is wrong with it
        return self._core.fast_scatter(src, targets, imm, routing, members, limit)

    def submit(self, request: Request, *, timeout: float | None = None) -> Transfer:
        limit = -1.0 if timeout is None else self._deadline(timeout)
        kind = type(request)
        done: Transfer | None = None
        if kind is WriteRequest:
            r: Any = request
            done = self._core.fast_write(
                r.src, r.src_offset, r.length, r.dst, r.dst_offset, r.imm, r.routing, limit
            )
        elif kind is PagedWriteRequest:
            done = self._fast_paged(request, limit)  # type: ignore[arg-type]
        elif kind is ImmRequest:
            r = request
            done = self._core.fast_imm(r.dst, r.imm, r.routing, limit)
        elif kind is ScatterRequest:
            r = request
            done = self._fast_scatter(r.src, r.targets, r.imm, r.routing, r.group, limit)
        return done if done is not None else super().submit(request, timeout=timeout)

    def _fast_paged(self, r: PagedWriteRequest, limit: float) -> Transfer | None:
        try:
            src_pages, dst_pages = (
                index_array(r.src_pages, "src_pages"),
                index_array(r.dst_pages, "dst_pages"),
            )
        except FabricError:
            return None  # plan_request raises it, after the checks it makes first
        done = self._core.fast_paged(
            r.src,
            src_pages,
            r.src_stride,
            r.dst,
            dst_pages,
            r.dst_stride,
            r.page_length,
            r.src_offset,
            r.dst_offset,
            r.imm,
            r.routing,
            limit,
        )
        # A wait on a long paged transfer gains little by draining (it saves one hand-off from
        # the completion thread on a transfer of milliseconds) and, where the peer's CPU moves
        # the bytes on this very host (shm), its spinning takes CPU from that copy: the
        # backend says from how many pages the waiter sleeps instead (drain_max_pages).
        most = self._drain_max_pages
        if done is not None and most is not None and len(src_pages) > most and r.src.device.kind == "cpu":
            done._drain = None
        return done

    def stats(self) -> EngineStats:
        core = self._core.stats()
        return replace(
            super().stats(),
            submitted=self._stat_submitted + self._core.fast_submitted(),
            work_requests=int(core["completed_wrs"]),
            bytes_written=int(core["bytes_written"]),
            retries=int(core["retries"]),
        )

    def _nic_stats(self) -> tuple[NicStats, ...]:
        return tuple(NicStats(n, *row) for n, row in enumerate(self._core.nic_stats()))

    def _peer_stats(self) -> tuple[PeerStats, ...]:
        return tuple(PeerStats(DomainAddress(raw=raw), *row) for raw, *row in self._core.peer_stats())

    # --- completion path: one GIL acquisition per batch ------------------------------
    def _complete(self) -> None:
        while True:
            batch = self._next_batch()
            if not any(batch):
                if self._stop:
                    return
                self._watch()
                continue
            try:
                self._process(*batch)
            finally:
                self._core.batch_done()  # a thread draining may take completions again

    def _watch(self) -> None:
        """The completion thread found nothing to hand over: if the engine's progress has been
        inside one provider call for ``liveness_timeout_s``, close the engine (EngineWedged).

        Such a call may never return (on shm, a post to a peer killed holding its queue lock),
        and while it runs nothing else moves: no completion, no liveness probe, no deadline.
        Without this the engine's transfers would hang until their deadlines and new ones
        would queue behind the stuck call for ever. The close runs on a thread of its own (it
        joins this one), waits at most _WEDGE_JOIN_S more for the stuck thread, and keeps the
        registrations alive if it stays (see _backend_stop).
        """
        if self._wedge is not None or self._closed:
            return
        stalled = self._stall.look(self._core.progress_since(), time.monotonic())
        if stalled < self._stall_limit:
            return
        self._wedge = EngineWedged(
            f"the engine on {self._where} closed itself: its progress has been inside one "
            f"provider call for {stalled:.1f} s (liveness_timeout_s {self._stall_limit:g}), "
            "as when a peer on the same host died holding a lock the two share; open a new engine",
            stalled_s=stalled,
        )
        logger.error("fabric: %s", self._wedge)
        threading.Thread(
            target=self._shutdown,
            args=(self._wedge,),
            kwargs={"drain": False, "timeout": 0.0},
            name=f"{self._completer.name}-wedged",
            daemon=True,
        ).start()

    def _closed_error(self, message: str) -> EngineClosed:
        wedge = self._wedge
        if wedge is None:
            return super()._closed_error(message)
        return EngineWedged(f"{message}: {wedge}", stalled_s=wedge.stalled_s)

    def _check_open(self) -> None:
        if self._wedge is not None:  # from the moment it is found, before the close is done
            raise self._closed_error("this engine is closed")
        super()._check_open()

    def _next_batch(self) -> tuple[Any, ...]:
        """The completion thread's next batch (empty lists after 50 ms without one)."""
        return tuple(self._core.wait_batch(0.05))

    def _process(
        self,
        ok: list[int],
        failed: list[tuple[int, int, str, bytes, int]],
        fired: list[int],
        messages: list[bytes],
        lost: list[tuple[bytes, str, int]],
        revived: list[bytes],
    ) -> None:
        """Hand one batch of completions to Python (the completion thread, or a drainer)."""
        for peer in revived:  # heard from again: waits may name it
            self._counters.revive_peer(peer)
        for peer, why, status in lost:  # waits naming it fail now (its transfers fail below)
            logger.warning("fabric: peer %s lost on %s: %s", peer.hex(), self._where, why)
            self._peer_lost(peer, why, PeerIncompatible if status == _INCOMPATIBLE else PeerUnreachable)
        if fired:  # asyncio waits and expect callbacks the imms satisfied
            self._native_counters.fire_tokens(fired)
        pop = self._inflight.pop
        for xfer_id in ok:
            transfer = pop(xfer_id, None)
            if transfer is not None:
                self._stat_completed += 1
                transfer._resolve(None)
        for xfer_id, status, message, peer, nic in failed:
            transfer = pop(xfer_id, None)
            if transfer is None:
                continue
            self._stat_failed += 1
            exc: FabricError
            if status == _CLOSED:  # (EngineWedged once the engine closed itself stuck)
                exc = self._closed_error(message)
            else:
                where = f" (peer {peer.hex()}{f', NIC {nic}' if nic >= 0 else ''})" if peer else ""
                exc = _STATUS.get(status, TransportError)(
                    f"transfer {xfer_id}: {message}{where}",
                    transfer_id=xfer_id,
                    peer=peer.hex() if peer else None,
                    nic=nic if nic >= 0 else None,
                )
            transfer._resolve(exc)
        for raw in messages:
            # [address length][address][payload], as a peer sent it: never trusted. A frame
            # naming no address (a foreign sender) is dropped; it must not stop this thread.
            alen = raw[0] if raw else 0
            if alen == 0 or len(raw) < 1 + alen:
                logger.warning(
                    "fabric: dropped a malformed control message on %s (%d bytes)", self._where, len(raw)
                )
                continue
            self._enqueue_message(Message(DomainAddress(raw=raw[1 : 1 + alen]), raw[1 + alen :]))

    def _drain_wait(self, transfer: Transfer, deadline: float) -> None:
        """A thread waits on ``transfer``: for up to _DRAIN_S it runs the engine's progress and
        hands completions to Python itself, instead of sleeping until the completion thread
        wakes it (one thread switch and a GIL hand-off less per wait)."""
        end = min(deadline, time.monotonic() + _DRAIN_S)
        while not transfer._done and not self._stop:
            left = end - time.monotonic()
            if left <= 0:
                return
            batch = self._core.drain(left)
            if not any(batch):
                # time is up, or the completion thread took a batch (maybe with this
                # transfer's completion): wait for the transfer's event from here
                return
            self._process(*batch)

    # --- hooks -----------------------------------------------------------------------
    def _new_counter_table(self) -> CounterTable:
        # the worker counts imms into the C++ table; blocking waits wake from there
        self._native_counters = NativeCounterTable(self._core.counters(), self._dispatch)
        self._native_counters.on_lost_wait = self._core.probe_peer
        return self._native_counters

    def _backend_register(
        self, span: MemorySpan, writable: bool, handle: int
    ) -> tuple[tuple[int, ...], object]:
        try:
            token, keys = self._core.register_memory(span.ptr, span.length, writable)
        except RuntimeError as exc:
            if span.device.kind == "cuda":  # the transport cannot take this GPU memory
                why = f"cannot register {span.device} memory on {self._where}: {exc}"
                raise CapabilityError(why) from exc
            typed = self._registration_error(exc)
            if typed is None:
                raise
            raise typed from exc
        return tuple(keys), token

    def _registration_error(self, exc: RuntimeError) -> BaseException | None:
        """The typed error a failed host-memory registration raises instead of ``exc``
        (None: ``exc`` itself)."""
        return None

    def _backend_bound(self, reg: Registration) -> None:
        assert isinstance(reg.token, int)
        self._core.bind_region(reg.token, reg.handle, reg.region)

    def _backend_deregister(self, token: object) -> None:
        assert isinstance(token, int)
        self._core.deregister(token)

    def _gone(self, peer: bytes, transfer: Transfer) -> bool:
        """Fail ``transfer`` if ``peer`` is an endpoint closed in this process (guarded providers)."""
        if not self._is_closed(peer):
            return False
        self._stat_failed += 1
        transfer._resolve(
            PeerUnreachable(f"peer {peer.hex()} is closed", peer=peer.hex(), transfer_id=transfer.id)
        )
        return True

    def _backend_post(
        self, plan: Plan, transfer: Transfer, source: Registration | None, timeout: float
    ) -> None:
        if self._guarded and any(self._gone(desc.peer.raw, transfer) for desc in plan.targets):
            return
        targets = [self._target_spec(desc) for desc in plan.targets]
        transfer._drain = self._drain_hook
        self._inflight[transfer.id] = transfer
        self._core.submit_write(
            transfer.id,
            source.token if source is not None and isinstance(source.token, int) else 0,
            source.ptr if source is not None else 0,
            plan.nic,
            plan.target,
            plan.src_off,
            plan.dst_off,
            plan.length,
            -1 if plan.imm is None else plan.imm,
            targets,
            timeout,
        )

    def _target_spec(self, desc: MemoryRegionDescriptor) -> tuple[list[bytes], list[int], int]:
        """The C++ core's view of a descriptor, cached per descriptor object (a writer sends
        many requests to the same few descriptors)."""
        hit = self._specs.get(id(desc))
        if hit is not None and hit[0] is desc:
            return hit[1]
        spec = ([nic.address.raw for nic in desc.nics], [nic.rkey for nic in desc.nics], desc.ptr)
        if len(self._specs) >= 4096:
            self._specs.clear()
        self._specs[id(desc)] = (desc, spec)
        return spec

    def _backend_send(self, peer: DomainAddress, payload: bytes, transfer: Transfer, timeout: float) -> None:
        if self._guarded and self._gone(peer.raw, transfer):
            return
        transfer._drain = self._drain_hook
        self._inflight[transfer.id] = transfer
        self._core.submit_send(transfer.id, peer.raw, self._header + payload, timeout)

    def _backend_cancel(self, transfer: Transfer, timeout: float) -> tuple[bool, list[bytes]]:
        try:
            running, peers = self._core.cancel(transfer.id, timeout)
        except RuntimeError as exc:  # the progress lock stayed taken: a wedged engine (see close)
            raise TransportError(
                f"transfer {transfer.id} could not be cancelled on {self._where}: {exc}",
                transfer_id=transfer.id,
            ) from None
        if running:
            self._inflight.pop(transfer.id, None)  # resolved by _cancel; C++'s own report is moot
        return running, peers

    def _backend_fence(self, peers: list[bytes], timeout: float) -> list[bytes]:
        return self._core.fence(peers, timeout) if peers else []

    def _foreign_peers(self) -> dict[bytes, str]:
        return {f["address"]: str(f["wire"]) for f in self._core.dump_state().get("foreign_peers", [])}

    def _dump_core(self) -> dict[str, Any]:
        state = self._core.dump_state()
        for r in state.get("requests", []):
            r["peers"] = [p.hex() for p in r["peers"]]
        for p in state.get("peers", []):
            p["address"] = p["address"].hex()
        for c in state.get("access_checks", []):
            c["peer"] = c["peer"].hex()
        for f in state.get("foreign_peers", []):
            f["address"] = f["address"].hex()
        return state

    def _backend_check_peer(self, peer: DomainAddress) -> None:
        if self._guarded and self._is_closed(peer.raw):
            raise PeerUnreachable(f"peer {peer.raw.hex()} is closed", peer=peer.raw.hex())
        transfer = Transfer((0,), default_timeout=self._timeout)
        self._inflight[transfer.id] = transfer
        self._core.check_peer(transfer.id, peer.raw)
        try:
            transfer.wait()
        except PeerUnreachable as exc:
            raise PeerUnreachable(
                f"{peer} is not reachable on {self._where}: {exc}",
                peer=peer.raw.hex(),
            ) from None

    def _backend_stop(self, exc: BaseException, drain: bool, timeout: float) -> None:
        if self._guarded:
            for a in self._addresses:
                self._mark_closed(a.raw)
        deadline = time.monotonic() + timeout
        if drain:
            while self._inflight and time.monotonic() < deadline:
                time.sleep(0.001)
        # fails what is left with status "closed". A thread stuck inside the provider (on shm,
        # a post to a peer killed holding its queue lock never returns) is left behind after
        # the bound, and the engine with it: close() still returns, and the process can exit.
        bound = _WEDGE_JOIN_S if exc is self._wedge else max(_JOIN_MIN_S, deadline - time.monotonic())
        if not self._core.close(bound):
            # its registrations stay open at the provider: their memory must never be freed
            # (a late write would land in whatever took its place), so the regions are kept
            _WEDGED.append((self._core, [reg.region for reg in self._regs.values()]))
            logger.error(
                "fabric: closing the engine on %s: a thread is stuck inside the provider (a "
                "peer killed while holding a lock it shares, on shm); the engine's endpoints "
                "and registrations are left as they are, their memory kept (leaked), and its "
                "transfers fail",
                self._where,
            )
        self._stop = True
        self._completer.join()
        left = list(self._inflight.values())
        self._inflight.clear()
        for transfer in left:
            self._stat_failed += 1
            transfer._resolve(exc)

    def _backend_release(self, exc: BaseException) -> None:
        self._core.destroy()
