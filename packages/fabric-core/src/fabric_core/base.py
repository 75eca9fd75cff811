"""``EngineBase``: the Python bookkeeping every backend shares.

Registrations, validation before posting, the counter table, the callback dispatcher, control
message queueing, statistics and the close sequence are the same whatever moves the bytes. A
backend subclasses ``EngineBase`` and supplies the hooks that touch its transport.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from . import cuda, diagnostics
from .api import EngineStats, TransferEngine
from .counters import CounterTable, CountWait, ImmCounter, check_count_waits, check_imm, check_wait_timeout
from .device_counter import DeviceCounter
from .errors import (
    CapabilityError,
    ConfigError,
    EngineClosed,
    PeerIncompatible,
    PeerUnreachable,
    TransferCancelled,
    TransferTimeout,
)
from .memory import MemorySpan, memory_span
from .models import Capabilities, DomainAddress, DomainInfo, MemoryRegion, MemoryRegionDescriptor, NicKey
from .ops import Message, PeerGroup, Plan, Request, plan_request
from .settings import FabricSettings
from .stats import NicStats, PeerStats, stats_dict
from .transfer import CallbackDispatcher, Transfer

__all__ = ["EngineBase", "Registration"]

_handles = itertools.count(1)


@dataclass(eq=False)
class Registration:
    """A live registration: the region handed to the user and the backend's own token."""

    handle: int
    ptr: int
    length: int
    region: MemoryRegion
    token: object


class EngineBase(TransferEngine):
    """Shared engine logic; subclasses implement the ``_backend_*`` hooks."""

    _cuda_one_allocation: ClassVar[bool] = True
    """The backend registers CUDA memory by its allocation (CUDA IPC handles, DMA-BUFs): a
    span across several (PyTorch's ``expandable_segments``) is refused at registration."""

    def __init__(
        self,
        settings: FabricSettings,
        capabilities: Capabilities,
        addresses: Sequence[DomainAddress],
        domains: Sequence[DomainInfo],
        thread_name: str,
    ) -> None:
        self._settings = settings
        self._caps = capabilities
        self._nics = capabilities.num_nics
        self._max_msg = capabilities.max_msg_size
        self._timeout = settings.timeout_s
        self._addresses = tuple(addresses)
        self._domains = tuple(domains)
        self._lock = threading.Lock()
        self._closed = False
        self._regs: dict[int, Registration] = {}
        self._device_counters: dict[int, DeviceCounter] = {}
        self._messages: deque[Message] = deque()
        self._msg_cv = threading.Condition()
        self._groups = itertools.count(1)
        self._made_groups: set[int] = set()
        self._rotation = 0
        self._stat_submitted = self._stat_completed = self._stat_failed = 0
        self._stat_wrs = self._stat_bytes = 0
        self._stat_retries = 0
        self._dispatch = CallbackDispatcher(thread_name)
        self._cancel_hook = self._cancel  # bound once: every transfer carries it
        self._counters = self._new_counter_table()
        diagnostics.track(self)

    # --- hooks ---------------------------------------------------------------------
    def _new_counter_table(self) -> CounterTable:
        """The imm counter table (compiled backends return a ``NativeCounterTable``)."""
        return CounterTable(self._dispatch)

    @abstractmethod
    def _backend_register(
        self, span: MemorySpan, writable: bool, handle: int
    ) -> tuple[tuple[int, ...], object]:
        """Register on every NIC; return one remote key per NIC and a token for deregistration."""

    @abstractmethod
    def _backend_deregister(self, token: object) -> None: ...

    @abstractmethod
    def _backend_post(
        self, plan: Plan, transfer: Transfer, source: Registration | None, timeout: float
    ) -> None:
        """Post the plan's work requests; complete ``transfer`` (``_resolve``) when all are done,
        or with ``TransferTimeout`` ``timeout`` seconds from now (``math.inf``: never)."""

    @abstractmethod
    def _backend_send(self, peer: DomainAddress, payload: bytes, transfer: Transfer, timeout: float) -> None:
        """Send ``payload``; ``timeout`` as for ``_backend_post``."""

    def _backend_cancel(self, transfer: Transfer, timeout: float) -> tuple[bool, list[bytes]]:
        """Stop ``transfer`` posting more work requests; whether it was running, and the peers
        it was writing to (``_cancel`` fences them unless the backend needs none: return no
        peers then). Within ``timeout``, or raise a ``TransportError`` having stopped nothing."""
        return False, []

    def _cancel(self, transfer: Transfer, timeout: float | None) -> bool:
        """``Transfer.cancel``: stop it, fail it with ``TransferCancelled``, fence its peers."""
        limit = self._deadline(timeout)
        running, peers = self._backend_cancel(transfer, limit)
        if not running:
            return False
        if transfer._resolve(TransferCancelled(f"transfer {transfer.id} cancelled", transfer_id=transfer.id)):
            with self._lock:
                self._stat_failed += 1
        left = self._backend_fence(peers, limit) if peers else []
        if left:
            raise PeerUnreachable(
                f"transfer {transfer.id} cancelled, but {len(left)} target(s) did not confirm within "
                f"{limit:g} s that nothing more of it can land: {', '.join(a.hex() for a in left)}",
                peer=left[0].hex(),
                transfer_id=transfer.id,
            )
        return True

    def _foreign_peers(self) -> dict[bytes, str]:
        """Peers heard speaking another wire protocol, and which (compiled engines): their
        control frames, fences' answers included, cannot be read here."""
        return {}

    def _backend_fence(self, peers: list[bytes], timeout: float) -> list[bytes]:
        """Wait (``fence``) for every write of ``peers`` posted before the call to be processed;
        return those that did not confirm. Nothing to wait for where every byte is checked
        against the keys as it lands (the simulator)."""
        return []

    def _dump_core(self) -> dict[str, Any]:
        """The backend's part of ``dump_state``: ``requests`` and ``peers`` (lists of dicts)."""
        return {"requests": [], "peers": []}

    @abstractmethod
    def _backend_check_peer(self, peer: DomainAddress) -> None:
        """Resolve a peer for a peer group; raise ``PeerUnreachable`` if it cannot be reached."""

    @abstractmethod
    def _backend_stop(self, exc: BaseException, drain: bool, timeout: float) -> None:
        """Drain (if asked, up to ``timeout`` s) and fail in-flight work with ``exc``."""

    def _backend_bound(self, reg: Registration) -> None:
        """A registration is complete: ``reg.region`` is the object handed to the user."""

    def _backend_release(self, exc: BaseException) -> None:
        """Last step of closing, after memory is deregistered (detach, join threads)."""

    def _message_taken(self) -> None:
        """A control message left the queue (backends that model receive buffers react)."""

    # --- identity ------------------------------------------------------------------
    @property
    def address(self) -> DomainAddress:
        return self._addresses[0]

    @property
    def addresses(self) -> tuple[DomainAddress, ...]:
        """Every NIC's address, in NIC order."""
        return self._addresses

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def domains(self) -> tuple[DomainInfo, ...]:
        return self._domains

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> EngineStats:
        return EngineStats(
            submitted=self._stat_submitted,
            completed=self._stat_completed,
            failed=self._stat_failed,
            work_requests=self._stat_wrs,
            bytes_written=self._stat_bytes,
            imms_received=self._counters.imms_received,
            callback_errors=self._dispatch.errors,
            registrations=len(self._regs),
            retries=self._stat_retries,
            nics=self._nic_stats(),
            peers=self._peer_stats(),
            counter_waits=self._counters.waits.snapshot(),
        )

    def _nic_stats(self) -> tuple[NicStats, ...]:
        """Per-NIC traffic (backends that count it override this)."""
        return ()

    def _peer_stats(self) -> tuple[PeerStats, ...]:
        """Per-peer traffic (backends that count it override this)."""
        return ()

    def _closed_error(self, message: str) -> EngineClosed:
        """What a call refused by this closed engine raises (a backend may say why it closed)."""
        return EngineClosed(message)

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error("this engine is closed")

    # --- memory --------------------------------------------------------------------
    def _memory_span(self, memory: object) -> MemorySpan:
        """What ``register`` registers (a backend may accept more, e.g. phantom memory)."""
        return memory_span(memory)

    def register(self, memory: object, *, writable: bool | None = None) -> MemoryRegion:
        self._check_open()
        span = self._memory_span(memory)
        if span.device.kind == "cuda":
            if not self._caps.cuda_memory:
                raise CapabilityError(
                    f"the {self._caps.backend} backend carries host memory only here; "
                    f"{span.device} memory cannot be registered"
                )
            # the driver's word, now: device memory of the device named, and (where the
            # backend needs it) one allocation, not expandable_segments' pieces
            cuda.check_device_span(
                span.ptr, span.length, span.device, one_allocation=self._cuda_one_allocation
            )
        if writable and not span.writable:
            raise ConfigError("a read-only buffer cannot be registered for remote writes")
        can_write = span.writable if writable is None else writable
        handle = next(_handles)
        rkeys, token = self._backend_register(span, can_write, handle)
        desc = MemoryRegionDescriptor(
            ptr=span.ptr,
            length=span.length,
            device=span.device,
            writable=can_write,
            nics=tuple(NicKey(address=a, rkey=k) for a, k in zip(self._addresses, rkeys, strict=True)),
        )
        region = MemoryRegion(
            handle=handle,
            ptr=span.ptr,
            length=span.length,
            device=span.device,
            writable=can_write,
            descriptor=desc,
        )
        region._keepalive = span.keepalive
        region._engine_id = id(self)
        reg = Registration(handle, span.ptr, span.length, region, token)
        self._regs[handle] = reg
        self._backend_bound(reg)
        return region

    def deregister(self, region: MemoryRegion) -> None:
        self._check_open()
        self._drop(self._source(region))

    def _drop(self, reg: Registration) -> None:
        if self._regs.pop(reg.handle, None) is not None:
            self._backend_deregister(reg.token)

    def _source(self, region: object) -> Registration:
        if not isinstance(region, MemoryRegion):
            raise ConfigError(f"expected a MemoryRegion, got {type(region).__name__}")
        reg = self._regs.get(region.handle)
        # this engine's table holds the very object it handed out: identity is the whole check
        if reg is None or reg.region is not region:
            raise ConfigError(
                "the MemoryRegion is not registered with this engine (deregistered, or another engine's)"
            )
        return reg

    # --- one-sided -----------------------------------------------------------------
    def _deadline(self, timeout: float | None) -> float:
        """A per-call transfer deadline, checked (None: the engine default)."""
        if timeout is None:
            return self._timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds (or math.inf), got {timeout!r}")
        return float(timeout)

    def submit(self, request: Request, *, timeout: float | None = None) -> Transfer:
        self._check_open()
        limit = self._deadline(timeout)
        src = getattr(request, "src", None)
        source = self._source(src) if src is not None else None
        group = getattr(request, "group", None)
        if group is not None and (not isinstance(group, PeerGroup) or group.handle not in self._made_groups):
            raise ConfigError("the peer group was not made by this engine")
        plan = plan_request(request, self._nics, self._max_msg, self._rotation)
        transfer = Transfer(plan.imms_per_target, dispatcher=self._dispatch, default_timeout=self._timeout)
        transfer._cancel = self._cancel_hook
        with self._lock:
            self._rotation += 1
            self._stat_submitted += 1
        self._backend_post(plan, transfer, source, limit)
        return transfer

    def peer_group(self, peers: Sequence[DomainAddress | MemoryRegionDescriptor]) -> PeerGroup:
        self._check_open()
        resolved = []
        for p in peers:
            if isinstance(p, MemoryRegionDescriptor):
                p = p.peer
            if not isinstance(p, DomainAddress):
                raise ConfigError(f"peer groups take DomainAddress or descriptors, got {type(p).__name__}")
            self._backend_check_peer(p)
            resolved.append(p)
        if not resolved:
            raise ConfigError("a peer group needs at least one peer")
        handle = next(self._groups)
        self._made_groups.add(handle)
        return PeerGroup(handle, tuple(resolved), frozenset(p.raw for p in resolved))

    def counter(self, imm: int) -> ImmCounter:
        return self._counters.counter(imm, self._timeout)

    def wait_counts(self, waits: Sequence[CountWait], timeout: float | None = None) -> None:
        self._check_open()
        wants = check_count_waits(waits)
        checked = check_wait_timeout(timeout)
        if not wants:
            return
        limit = self._timeout if checked is None else checked
        start, ok = time.monotonic(), False
        try:
            self._counters.wait_all(wants, limit)
            ok = True
        finally:
            self._counters.waits.record(time.monotonic() - start, ok)

    def device_counter(self, imm: int, *, peer: DomainAddress | None = None) -> DeviceCounter:
        self._check_open()
        imm = check_imm(imm)
        if peer is not None and not isinstance(peer, DomainAddress):
            raise ConfigError(f"peer must be a DomainAddress or None, got {type(peer).__name__}")
        if not cuda.available():
            raise CapabilityError(f"GPU-side waits need a CUDA GPU: {cuda.unavailable_reason()}")
        with self._lock:
            old = self._device_counters.get(imm)
            if old is not None and not old.closed:
                raise ConfigError(f"imm {imm} already has a device counter (close it first)")
        dc = DeviceCounter(self._counters, imm, self._timeout, peer)
        with self._lock:
            self._device_counters[imm] = dc
        return dc

    # --- two-sided -----------------------------------------------------------------
    def submit_send(
        self, peer: DomainAddress, data: bytes | bytearray | memoryview, *, timeout: float | None = None
    ) -> Transfer:
        self._check_open()
        limit = self._deadline(timeout)
        if not isinstance(peer, DomainAddress):
            raise ConfigError(f"peer must be a DomainAddress, got {type(peer).__name__}")
        payload = bytes(data)
        if len(payload) > self._caps.max_send_size:
            raise ConfigError(
                f"message of {len(payload)} bytes exceeds max_send_size {self._caps.max_send_size}: "
                "move bulk data with a one-sided write"
            )
        transfer = Transfer((0,), dispatcher=self._dispatch, default_timeout=self._timeout)
        transfer._cancel = self._cancel_hook
        with self._lock:
            self._stat_submitted += 1
        self._backend_send(peer, payload, transfer, limit)
        return transfer

    def _enqueue_message(self, message: Message) -> None:
        with self._msg_cv:
            self._messages.append(message)
            self._msg_cv.notify()

    def recv(self, timeout: float | None = None) -> Message:
        self._check_open()
        checked = check_wait_timeout(timeout)
        limit = self._timeout if checked is None else checked
        deadline = time.monotonic() + limit
        with self._msg_cv:
            while not self._messages:
                left = deadline - time.monotonic()
                if self._closed:
                    raise self._closed_error("engine closed while waiting for a message")
                if left <= 0:
                    raise TransferTimeout(f"no control message within {limit:g} s")
                self._msg_cv.wait(None if math.isinf(left) else left)
            msg = self._messages.popleft()
        self._message_taken()
        return msg

    # --- failure & lifecycle -------------------------------------------------------
    def fence(
        self, peers: Sequence[DomainAddress | MemoryRegionDescriptor], *, timeout: float | None = None
    ) -> None:
        self._check_open()
        limit = self._deadline(timeout)
        addresses: list[bytes] = []
        for p in peers:
            if isinstance(p, MemoryRegionDescriptor):
                p = p.peer
            if not isinstance(p, DomainAddress):
                raise ConfigError(f"fence takes DomainAddress or descriptors, got {type(p).__name__}")
            addresses.append(p.raw)
        left = self._backend_fence(addresses, limit)
        if left:
            names = ", ".join(a.hex() for a in left)
            foreign = self._foreign_peers()
            if all(a in foreign for a in left):
                speak = ", ".join(f"{a.hex()} {foreign[a]}" for a in left)
                raise PeerIncompatible(
                    f"fence: {len(left)} peer(s) speak another fabric release's wire protocol and "
                    f"cannot confirm ({speak}): run one fabric release on every engine of a job",
                    peer=left[0].hex(),
                )
            raise PeerUnreachable(
                f"fence: {len(left)} peer(s) did not confirm within {limit:g} s: {names}; what they "
                "had under way may still land: do not reuse the memory yet",
                peer=left[0].hex(),
            )

    def dump_state(self) -> dict[str, Any]:
        core = self._dump_core()
        stats = self.stats()
        return {
            "backend": self._caps.backend,
            "address": self.address.raw.hex(),
            "closed": self._closed,
            "requests": core.get("requests", []),
            "waiters": self._counters.pending(),
            "peers": core.get("peers", []),
            "stats": stats_dict(stats),
            **{k: v for k, v in core.items() if k not in ("requests", "peers")},
        }

    def _peer_lost(
        self, peer: bytes, exc: BaseException | str, kind: type[PeerUnreachable] = PeerUnreachable
    ) -> None:
        lost = kind(f"peer {peer.hex()} is gone ({exc})", peer=peer.hex())
        self._counters.fail_peer(peer, lost)

    def close(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        self._shutdown(EngineClosed("engine closed with this transfer in flight"), drain=True, timeout=limit)

    def _shutdown(self, exc: BaseException, *, drain: bool, timeout: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._backend_stop(exc, drain, timeout)
        self._counters.fail_all(exc)  # GPU waits are released too
        for dc in list(self._device_counters.values()):
            dc.close()
        for reg in list(self._regs.values()):
            self._drop(reg)
        with self._msg_cv:
            self._msg_cv.notify_all()
        self._backend_release(exc)
        self._dispatch.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.address} nics={self._nics} {state}>"
