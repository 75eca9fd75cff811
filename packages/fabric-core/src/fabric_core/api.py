"""The ``TransferEngine`` interface every backend implements, and the ``Backend`` class."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar

from .counters import CountWait, ImmCounter
from .device_counter import DeviceCounter
from .memory import RawMemory
from .models import (
    Capabilities,
    Device,
    DomainAddress,
    DomainInfo,
    MemoryRegion,
    MemoryRegionDescriptor,
    TopologyGroup,
)
from .ops import (
    BarrierRequest,
    ImmRequest,
    Message,
    PagedWriteRequest,
    PeerGroup,
    Request,
    Routing,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
    plan_request,
)
from .settings import FabricSettings
from .stats import NicStats, PeerStats, WaitStats
from .transfer import Transfer

__all__ = ["API_VERSION", "Backend", "EngineStats", "ProbeResult", "TransferEngine"]

API_VERSION = 1
"""Version of the backend-facing API; a backend built for another version is refused."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters an operator can watch."""

    submitted: int
    completed: int
    failed: int
    work_requests: int
    bytes_written: int
    imms_received: int
    callback_errors: int
    registrations: int
    retries: int = 0
    """Work requests retried on another NIC after theirs was lost (see the failure contract)."""
    nics: tuple[NicStats, ...] = ()
    """Per NIC of the group, in NIC order: which NICs carried how much."""
    peers: tuple[PeerStats, ...] = ()
    """Per peer written to, by its NIC 0 address."""
    counter_waits: WaitStats = field(default_factory=WaitStats)
    """Counter waits that ended, with their latency histogram."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Cheap answer to "can this backend run here?" with the reason when it cannot."""

    available: bool
    reason: str = ""


class TransferEngine(ABC):
    """One per process (per domain group): registers memory and moves bytes one-sidedly.

    Nothing is ordered: not NICs, not the work requests of one transfer, not transfers.
    The only completion signal at the target is the count of an imm (``counter(imm)``).
    """

    # --- identity -----------------------------------------------------------------
    @property
    @abstractmethod
    def address(self) -> DomainAddress:
        """Main address (NIC 0) of this engine: what peers send control messages to."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @property
    @abstractmethod
    def domains(self) -> tuple[DomainInfo, ...]:
        """The NICs of this engine's group, in NIC-index order."""

    @property
    def addresses(self) -> tuple[DomainAddress, ...]:
        """Every NIC's address, in NIC order (``address`` is the first)."""
        return (self.address,)

    @property
    def num_nics(self) -> int:
        return self.capabilities.num_nics

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def stats(self) -> EngineStats: ...

    # --- memory -------------------------------------------------------------------
    @abstractmethod
    def register(self, memory: object, *, writable: bool | None = None) -> MemoryRegion:
        """Register a buffer-protocol object, numpy array, torch tensor or ``RawMemory``
        on every NIC of the group. ``writable=False`` refuses remote writes into it."""

    def register_ptr(self, ptr: int, length: int, device: Device | str = "cpu") -> MemoryRegion:
        """Register raw memory; the caller keeps it alive until ``deregister``."""
        return self.register(RawMemory(ptr, length, Device.parse(device)))

    @abstractmethod
    def deregister(self, region: MemoryRegion) -> None:
        """Withdraw a registration. This is the fence against late writes: once it returns, no
        remote write lands in that memory through this registration (later ones fail at the
        writer with ``RemoteAccessError``), whatever the writers' state."""

    def rekey(self, region: MemoryRegion) -> MemoryRegion:
        """Revoke ``region``'s descriptor and register the same memory anew (new keys).

        From the moment it returns, a write made with the old descriptor fails at the writer
        and changes nothing; the returned region is what to hand to writers from now on. A
        write a peer already had under way may still finish: ``fence`` waits for those.
        """
        fresh = self.register(RawMemory(region.ptr, region.length, region.device), writable=region.writable)
        fresh._keepalive = region._keepalive
        self.deregister(region)
        return fresh

    @abstractmethod
    def fence(
        self, peers: Sequence[DomainAddress | MemoryRegionDescriptor], *, timeout: float | None = None
    ) -> None:
        """Wait until every write each of ``peers`` posted to this engine before the call has
        been processed here: landed, or refused by the keys, on every NIC (and every write
        this engine had under way to them has been reported).

        After ``rekey`` (or ``deregister``) and ``fence``, nothing a peer wrote with the old
        keys lands any more: the memory may be reused (the KV-cache decoder does this before
        it hands out pages of an abandoned request again). A peer that does not confirm within
        ``timeout`` (the engine default if None) raises ``PeerUnreachable`` naming it: do not
        reuse the memory then (a stopped peer may still send the rest of a write it had under
        way when it resumes).
        """

    @abstractmethod
    def dump_state(self) -> dict[str, Any]:
        """What is outstanding, for hang diagnostics (``fabric info --pending``): in-flight
        transfers (id, age, peers, per-NIC work requests left), counter waiters (imm, counts
        expected vs received, the peer named) and the peers the engine tracks (last heard,
        probes, lost). Plain JSON-serialisable data; addresses are hex."""

    # --- one-sided ----------------------------------------------------------------
    @abstractmethod
    def submit(self, request: Request, *, timeout: float | None = None) -> Transfer:
        """Validate, then post ``request``. Bad input raises ``ConfigError`` and posts nothing.

        ``timeout`` is the transfer's deadline in seconds from now (``None``: the engine's
        ``timeout_s``; ``math.inf``: none): past it the transfer fails with
        ``TransferTimeout``, which names the peer, the NIC and what is still outstanding.
        """

    def imms_at_target(self, request: Request) -> tuple[int, ...]:
        """What each target of ``request`` would count, without posting it."""
        return plan_request(request, self.num_nics, self.capabilities.max_msg_size).imms_per_target

    def submit_write(
        self,
        src: MemoryRegion,
        src_offset: int,
        length: int,
        dst: MemoryRegionDescriptor,
        dst_offset: int = 0,
        *,
        imm: int | None = None,
        routing: Routing = Sharded(),
        timeout: float | None = None,
    ) -> Transfer:
        return self.submit(
            WriteRequest(src, src_offset, length, dst, dst_offset, imm, routing), timeout=timeout
        )

    def submit_paged_write(
        self,
        src: MemoryRegion,
        src_pages: Any,
        src_stride: int,
        dst: MemoryRegionDescriptor,
        dst_pages: Any,
        dst_stride: int,
        page_length: int,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        routing: Routing = Sharded(),
        timeout: float | None = None,
    ) -> Transfer:
        return self.submit(
            PagedWriteRequest(
                src,
                src_pages,
                src_stride,
                dst,
                dst_pages,
                dst_stride,
                page_length,
                src_offset,
                dst_offset,
                imm,
                routing,
            ),
            timeout=timeout,
        )

    def submit_scatter(
        self,
        src: MemoryRegion,
        targets: Sequence[ScatterTarget],
        *,
        imm: int | None = None,
        routing: Routing = ShardPeers(),
        group: PeerGroup | None = None,
        timeout: float | None = None,
    ) -> Transfer:
        return self.submit(ScatterRequest(src, tuple(targets), imm, routing, group), timeout=timeout)

    def submit_imm(
        self,
        dst: MemoryRegionDescriptor,
        imm: int,
        *,
        routing: Routing = Sharded(1),
        timeout: float | None = None,
    ) -> Transfer:
        return self.submit(ImmRequest(dst, imm, routing), timeout=timeout)

    def submit_barrier(
        self,
        dsts: Sequence[MemoryRegionDescriptor],
        imm: int,
        *,
        routing: Routing = ShardPeers(),
        timeout: float | None = None,
    ) -> Transfer:
        return self.submit(BarrierRequest(tuple(dsts), imm, routing), timeout=timeout)

    @abstractmethod
    def peer_group(self, peers: Sequence[DomainAddress | MemoryRegionDescriptor]) -> PeerGroup:
        """Resolve peers once for repeated scatters (address vectors, connections)."""

    # --- counters -----------------------------------------------------------------
    @abstractmethod
    def counter(self, imm: int) -> ImmCounter:
        """The counter of ``imm`` at this engine (counting since engine start)."""

    @abstractmethod
    def wait_counts(self, waits: Sequence[CountWait], timeout: float | None = None) -> None:
        """Wait on several counters at once: block until each ``(imm, n)`` or ``(imm, n,
        peer)`` of ``waits`` has ``n`` counts, then consume them all together (entries with
        the same imm each take their own ``n``). On any error nothing is consumed: counts of
        entries already satisfied are given back. An entry naming ``peer`` fails the whole
        wait with ``PeerUnreachable`` as soon as that peer is found dead (at once if it
        already is), whatever the other entries wait for; at the deadline ``TransferTimeout``
        lists the entries still short (expected vs received). ``timeout`` as for
        ``ImmCounter.wait``; an empty ``waits`` returns at once. Cheaper than one wait per
        counter, and than ``expect`` callbacks: one blocking call, woken by the engine."""

    @abstractmethod
    def device_counter(self, imm: int, *, peer: DomainAddress | None = None) -> DeviceCounter:
        """A GPU-side view of ``imm``'s counter: CUDA streams wait for its arrivals with no
        host round trip (see ``fabric_core.device_counter``). ``peer``: the peer the imms come
        from; its loss releases the GPU waits and fails the counter. One per imm per engine;
        ``CapabilityError`` without a CUDA driver and GPU."""

    # --- two-sided control messages -----------------------------------------------
    @abstractmethod
    def submit_send(
        self, peer: DomainAddress, data: bytes | bytearray | memoryview, *, timeout: float | None = None
    ) -> Transfer:
        """Send a small message (at most ``capabilities.max_send_size`` bytes) to ``peer``;
        ``timeout`` as for ``submit``."""

    @abstractmethod
    def recv(self, timeout: float | None = None) -> Message:
        """Next control message (any peer); ``TransferTimeout`` at the deadline."""

    async def recv_async(self, timeout: float | None = None) -> Message:
        return await asyncio.to_thread(self.recv, timeout)

    # --- lifecycle ----------------------------------------------------------------
    @abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Drain in-flight work up to ``timeout`` s, fail the rest with ``EngineClosed``,
        deregister memory and join threads. Idempotent."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Backend(ABC):
    """A backend distribution's entry point (group ``fabric.backends``)."""

    name: ClassVar[str]
    api_version: ClassVar[int]
    distribution: ClassVar[str]

    @classmethod
    @abstractmethod
    def probe(cls, settings: FabricSettings | None = None) -> ProbeResult:
        """Cheap check of library and device presence (for ``settings``, else the
        environment's); never raises."""

    @classmethod
    @abstractmethod
    def detect_topology(cls, settings: FabricSettings) -> list[TopologyGroup]:
        """Domain groups this machine offers (GPU ↔ NICs ↔ CPUs)."""

    @classmethod
    @abstractmethod
    def open(cls, settings: FabricSettings) -> TransferEngine:
        """Open an engine; raises ``BackendUnavailable`` when it cannot run here."""
