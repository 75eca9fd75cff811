"""``SimEngine``: a TransferEngine on a ``SimFabric``."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fabric_core.api import EngineStats, TransferEngine
from fabric_core.counters import CounterTable, ImmCounter
from fabric_core.errors import (
    CapabilityError,
    ConfigError,
    EngineClosed,
    PeerUnreachable,
    TransferTimeout,
)
from fabric_core.memory import memory_span
from fabric_core.models import (
    Capabilities,
    DomainAddress,
    DomainInfo,
    MemoryRegion,
    MemoryRegionDescriptor,
    NicKey,
)
from fabric_core.ops import Message, PeerGroup, Request, plan_request
from fabric_core.settings import FabricSettings
from fabric_core.transfer import CallbackDispatcher, Transfer

if TYPE_CHECKING:
    from .fabric import SimFabric, _Xfer

__all__ = ["SIM_MAX_MSG_SIZE", "SimEngine"]

SIM_MAX_MSG_SIZE = 1 << 30
"""Largest WR the simulated NIC accepts (as ConnectX's 1 GiB ``max_msg_sz``)."""

_handles = itertools.count(1)


@dataclass(eq=False)
class _Registration:
    handle: int
    ptr: int
    length: int
    rkeys: tuple[int, ...]
    region: MemoryRegion


class SimEngine(TransferEngine):
    """An engine with ``nics`` simulated NICs on ``fabric``."""

    def __init__(self, fabric: SimFabric, settings: FabricSettings, nics: int) -> None:
        if not 1 <= nics <= 64:
            raise ConfigError(f"nics must be in [1, 64], got {nics}")
        self._fabric = fabric
        self._settings = settings
        self._nics = nics
        self._max_msg = min(settings.max_msg_size or SIM_MAX_MSG_SIZE, SIM_MAX_MSG_SIZE)
        self._timeout = settings.timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._regs: dict[int, _Registration] = {}
        self._rkeys: dict[tuple[int, int], _Registration] = {}
        self._inflight: set[_Xfer] = set()
        self._messages: deque[Message] = deque()
        self._parked: deque[tuple[Message, _Xfer]] = deque()
        self._msg_cv = threading.Condition()
        self._groups = itertools.count(1)
        self._made_groups: set[int] = set()
        self._rotation = 0
        self._stat_submitted = self._stat_completed = self._stat_failed = 0
        self._stat_wrs = self._stat_bytes = 0
        self.engine_id = fabric.attach(self)
        self._keys = random.Random(fabric.seed * 1_000_003 + self.engine_id)
        self._dispatch = CallbackDispatcher(f"fabric-sim-cb-{fabric.fabric_id}.{self.engine_id}")
        self._counters = CounterTable(self._dispatch)
        self._addresses = tuple(fabric.address(self.engine_id, i) for i in range(nics))
        self._caps = Capabilities(
            backend="sim",
            num_nics=nics,
            max_msg_size=self._max_msg,
            max_send_size=settings.max_send_size,
            virtual_clock=fabric.link is not None,
        )
        speed = fabric.link.bandwidth_gbps if fabric.link is not None else None
        self._domains = tuple(
            DomainInfo(
                name=f"sim{self.engine_id}.{i}",
                provider="sim",
                link_speed_gbps=speed,
                max_msg_size=self._max_msg,
            )
            for i in range(nics)
        )

    # --- identity ----------------------------------------------------------------
    @property
    def fabric(self) -> SimFabric:
        return self._fabric

    @property
    def address(self) -> DomainAddress:
        return self._addresses[0]

    @property
    def addresses(self) -> tuple[DomainAddress, ...]:
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
        )

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed")

    # --- memory ------------------------------------------------------------------
    def register(self, memory: object, *, writable: bool | None = None) -> MemoryRegion:
        self._check_open()
        span = memory_span(memory)
        if span.device.kind != "cpu":
            raise CapabilityError(
                f"the simulator carries host memory only; {span.device} memory cannot be registered"
            )
        if writable and not span.writable:
            raise ConfigError("a read-only buffer cannot be registered for remote writes")
        can_write = span.writable if writable is None else writable
        handle = next(_handles)
        rkeys = tuple(self._keys.getrandbits(64) for _ in range(self._nics))
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
        reg = _Registration(handle, span.ptr, span.length, rkeys, region)
        with self._fabric._cv:
            self._regs[handle] = reg
            if can_write:
                for nic, key in enumerate(rkeys):
                    self._rkeys[(nic, key)] = reg
        return region

    def deregister(self, region: MemoryRegion) -> None:
        self._check_open()
        self._source(region)
        self._drop(self._regs[region.handle])

    def _drop(self, reg: _Registration) -> None:
        with self._fabric._cv:
            self._regs.pop(reg.handle, None)
            for nic, key in enumerate(reg.rkeys):
                self._rkeys.pop((nic, key), None)

    def _source(self, region: object) -> _Registration:
        if not isinstance(region, MemoryRegion):
            raise ConfigError(f"expected a MemoryRegion, got {type(region).__name__}")
        reg = self._regs.get(region.handle)
        if region._engine_id != id(self) or reg is None or reg.region is not region:
            raise ConfigError(
                "the MemoryRegion is not registered with this engine (deregistered, or another engine's)"
            )
        return reg

    # --- one-sided ----------------------------------------------------------------
    def submit(self, request: Request) -> Transfer:
        self._check_open()
        src = getattr(request, "src", None)
        src_ptr = self._source(src).ptr if src is not None else 0
        group = getattr(request, "group", None)
        if group is not None and (not isinstance(group, PeerGroup) or group.handle not in self._made_groups):
            raise ConfigError("the peer group was not made by this engine")
        plan = plan_request(request, self._nics, self._max_msg, self._rotation)
        transfer = Transfer(plan.imms_per_target, dispatcher=self._dispatch, default_timeout=self._timeout)
        with self._lock:
            self._rotation += 1
            self._stat_submitted += 1
        self._fabric.post(self, plan, transfer, src_ptr)
        return transfer

    def peer_group(self, peers: Sequence[DomainAddress | MemoryRegionDescriptor]) -> PeerGroup:
        self._check_open()
        resolved = []
        for p in peers:
            if isinstance(p, MemoryRegionDescriptor):
                p = p.peer
            if not isinstance(p, DomainAddress):
                raise ConfigError(f"peer groups take DomainAddress or descriptors, got {type(p).__name__}")
            with self._fabric._cv:
                self._fabric.resolve(p)
            resolved.append(p)
        if not resolved:
            raise ConfigError("a peer group needs at least one peer")
        handle = next(self._groups)
        self._made_groups.add(handle)
        return PeerGroup(handle, tuple(resolved), frozenset(p.raw for p in resolved))

    def counter(self, imm: int) -> ImmCounter:
        return self._counters.counter(imm, self._timeout)

    # --- two-sided ----------------------------------------------------------------
    def submit_send(self, peer: DomainAddress, data: bytes | bytearray | memoryview) -> Transfer:
        self._check_open()
        if not isinstance(peer, DomainAddress):
            raise ConfigError(f"peer must be a DomainAddress, got {type(peer).__name__}")
        payload = bytes(data)
        if len(payload) > self._caps.max_send_size:
            raise ConfigError(
                f"message of {len(payload)} bytes exceeds max_send_size {self._caps.max_send_size}: "
                "move bulk data with a one-sided write"
            )
        transfer = Transfer((0,), dispatcher=self._dispatch, default_timeout=self._timeout)
        with self._lock:
            self._stat_submitted += 1
        self._fabric.post_message(self, peer, payload, transfer)
        return transfer

    def _deliver(self, peer: DomainAddress, data: bytes, xfer: _Xfer) -> bool:
        """Land a message in a posted receive buffer; with all ``recv_depth`` buffers full,
        park it (the sender stays incomplete, as under receiver-not-ready back-off)."""
        with self._msg_cv:
            if len(self._messages) >= self._settings.recv_depth:
                self._parked.append((Message(peer, data), xfer))
                return False
            self._messages.append(Message(peer, data))
            self._msg_cv.notify()
            return True

    def recv(self, timeout: float | None = None) -> Message:
        self._check_open()
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._msg_cv:
            while not self._messages:
                left = deadline - time.monotonic()
                if self._closed:
                    raise EngineClosed("engine closed while waiting for a message")
                if left <= 0:
                    raise TransferTimeout(f"no control message within {limit:g} s")
                self._msg_cv.wait(left)
            msg = self._messages.popleft()
            parked = self._parked.popleft() if self._parked else None
            if parked is not None:
                self._messages.append(parked[0])
        if parked is not None:
            self._fabric.message_taken(parked[1])
        return msg

    # --- failure & lifecycle ------------------------------------------------------
    def _peer_lost(self, peer: bytes, exc: BaseException) -> None:
        lost = PeerUnreachable(f"peer {peer.hex()} is gone ({exc})", peer=peer.hex())
        self._counters.fail_peer(peer, lost)

    def _crash(self) -> None:
        """Die abruptly (fault injection): no drain, pending work abandoned."""
        self._shutdown(EngineClosed("engine crashed (fault injection)"), drain=False, timeout=0.0)

    def close(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        self._shutdown(EngineClosed("engine closed with this transfer in flight"), drain=True, timeout=limit)

    def _shutdown(self, exc: BaseException, *, drain: bool, timeout: float) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if drain:
            deadline = time.monotonic() + timeout
            while self._inflight and time.monotonic() < deadline:
                time.sleep(0.001)
        with self._fabric._cv:
            pending = list(self._inflight)
            self._inflight.clear()
        self._fabric.forget(pending)
        for x in pending:
            self._stat_failed += 1
            x.transfer._resolve(exc)
        self._counters.fail_all(exc)
        for reg in list(self._regs.values()):
            self._drop(reg)
        with self._msg_cv:
            parked = [x for _, x in self._parked]
            self._parked.clear()
            self._msg_cv.notify_all()
        for x in parked:
            self._fabric.message_taken(x, PeerUnreachable(f"peer {self.address} closed before receiving"))
        self._fabric.detach(self, exc)
        self._dispatch.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SimEngine {self.address} nics={self._nics} {state}>"
