"""``EfaEngine``: fabric's contract on libfabric RDM endpoints through the C++ engine core."""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import time
from dataclasses import replace
from typing import Any

from fabric_core.api import EngineStats
from fabric_core.base import EngineBase, Registration
from fabric_core.counters import CounterTable, NativeCounterTable
from fabric_core.errors import (
    BackendUnavailable,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    RemoteAccessError,
    TransportError,
)
from fabric_core.memory import MemorySpan, index_array
from fabric_core.models import (
    Capabilities,
    DomainAddress,
    DomainInfo,
    MemoryRegion,
    MemoryRegionDescriptor,
)
from fabric_core.ops import (
    ImmRequest,
    Message,
    PagedWriteRequest,
    Pinned,
    Plan,
    Request,
    Routing,
    Sharded,
    ShardPeers,
    WriteRequest,
)
from fabric_core.settings import FabricSettings
from fabric_core.transfer import Transfer

from . import _efa

__all__ = ["EfaEngine"]

logger = logging.getLogger(__name__)

_engines = itertools.count(1)
# Endpoints closed in this process (kept by the compiled module, which the fast path reads).
# Writing to one of them would touch freed provider state (the shm provider crashes), so such
# writes fail with PeerUnreachable before posting. Only providers whose addresses name their
# process are guarded: a tcp address is a port, which another process may bind next, so a tcp
# address closed here says nothing about who owns it now. Peers that die in other processes
# are the liveness protocol's to detect.
_PROCESS_SCOPED = frozenset({"shm"})
_SHARDED = Sharded()
_ONE_NIC = Sharded(1)
_NO_IMMS = (0,)
_HEADER = struct.Struct("<B")  # length of the sender's address, then the address, then the data
# Status codes of fabric/engine.hpp
_STATUS: dict[int, type[TransportError]] = {1: PeerUnreachable, 2: RemoteAccessError, 3: TransportError}
_CLOSED = 4


_MR_MODES = {
    1 << 2: "local",
    1 << 3: "raw",
    1 << 4: "virt_addr",
    1 << 5: "allocated",
    1 << 6: "prov_key",
    1 << 7: "mmu_notify",
    1 << 8: "rma_event",
    1 << 9: "endpoint",
    1 << 10: "hmem",
}


def _details(info: dict[str, Any]) -> dict[str, str | int | bool]:
    """The provider's limits as ``fabric info`` shows them."""
    mode = int(info["mr_mode"])
    major, minor = _efa.libfabric_version()
    return {
        "libfabric": f"{major}.{minor}",
        "fabric": str(info["fabric"]),
        "mr_mode": "|".join(name for bit, name in _MR_MODES.items() if mode & bit) or "basic",
        "inject_bytes": int(info["inject_size"]),
        "tx_depth": int(info["tx_size"]),
        "cq_data_bytes": int(info["cq_data_size"]),
        "cuda_memory": bool(info["hmem"]),
    }


class EfaEngine(EngineBase):
    """One domain group of ``settings.nics`` endpoints on ``settings.efa_provider``."""

    def __init__(self, settings: FabricSettings) -> None:
        nics = settings.nics or 1
        provider = settings.efa_provider
        header = 1 + 255
        try:
            self._core = _efa.Engine(
                provider,
                nics,
                settings.chaos_seed,
                -1 if settings.worker_cpu is None else settings.worker_cpu,
                settings.recv_depth,
                settings.max_send_size + header,
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                "efa", f"cannot open {nics} endpoint(s) on provider {provider!r}: {exc}"
            ) from exc
        info: dict[str, Any] = self._core.provider_info()
        self.provider_info = info
        max_msg = int(info["max_msg_size"]) or (1 << 30)
        max_msg = min(max_msg, 1 << 62, settings.max_msg_size or (1 << 62))
        addresses = [DomainAddress(raw=a) for a in self._core.addresses()]
        details = _details(info)
        self._guarded = str(info["provider"]) in _PROCESS_SCOPED
        for a in addresses:  # an address can be reused
            _efa.reopen_address(a.raw)
        self._inflight: dict[int, Transfer] = {}
        self._specs: dict[int, tuple[MemoryRegionDescriptor, tuple[list[bytes], list[int], int]]] = {}
        super().__init__(
            settings,
            Capabilities(
                backend="efa",
                num_nics=nics,
                max_msg_size=max_msg,
                max_send_size=settings.max_send_size,
                cuda_memory=False,
            ),
            addresses,
            [
                DomainInfo(
                    name=f"{info['domain']}#{i}",
                    provider=str(info["provider"]),
                    max_msg_size=max_msg,
                    details=details,
                )
                for i in range(nics)
            ],
            f"fabric-efa-cb-{next(_engines)}",
        )
        self._core.configure_fast(max_msg, Sharded, Pinned, ShardPeers, MemoryRegionDescriptor, self._guarded)
        self._header = _HEADER.pack(len(self.address.raw)) + self.address.raw
        self._stop = False
        self._completer = threading.Thread(target=self._complete, name="fabric-efa-completion", daemon=True)
        self._completer.start()

    # --- submit: planned in C++ when the request is plain, else by plan_request ---------
    def _fast(self, transfer: Transfer, imms: int) -> Transfer | None:
        if imms < 0:
            self._inflight.pop(transfer.id, None)
            return None
        transfer.imms_per_target = (imms,)
        return transfer

    def _new(self) -> Transfer:
        """A transfer entered in the in-flight table (one dict store: atomic under the GIL)."""
        transfer = Transfer(_NO_IMMS, dispatcher=self._dispatch, default_timeout=self._timeout)
        self._inflight[transfer.id] = transfer
        return transfer

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
    ) -> Transfer:
        t = self._new()
        done = self._fast(
            t, self._core.fast_write(t.id, src, src_offset, length, dst, dst_offset, imm, routing)
        )
        if done is not None:
            return done
        return super().submit(WriteRequest(src, src_offset, length, dst, dst_offset, imm, routing))

    def submit_imm(self, dst: MemoryRegionDescriptor, imm: int, *, routing: Routing = _ONE_NIC) -> Transfer:
        t = self._new()
        done = self._fast(t, self._core.fast_imm(t.id, dst, imm, routing))
        return done if done is not None else super().submit(ImmRequest(dst, imm, routing))

    def submit(self, request: Request) -> Transfer:
        kind = type(request)
        done: Transfer | None = None
        if kind is WriteRequest:
            r: Any = request
            t = self._new()
            done = self._fast(
                t,
                self._core.fast_write(
                    t.id, r.src, r.src_offset, r.length, r.dst, r.dst_offset, r.imm, r.routing
                ),
            )
        elif kind is PagedWriteRequest:
            done = self._fast_paged(request)  # type: ignore[arg-type]
        elif kind is ImmRequest:
            r = request
            t = self._new()
            done = self._fast(t, self._core.fast_imm(t.id, r.dst, r.imm, r.routing))
        return done if done is not None else super().submit(request)

    def _fast_paged(self, r: PagedWriteRequest) -> Transfer | None:
        try:
            src_pages, dst_pages = (
                index_array(r.src_pages, "src_pages"),
                index_array(r.dst_pages, "dst_pages"),
            )
        except FabricError:
            return None  # plan_request raises it, after the checks it makes first
        t = self._new()
        imms = self._core.fast_paged(
            t.id,
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
        )
        return self._fast(t, imms)

    def stats(self) -> EngineStats:
        core = self._core.stats()
        return replace(
            super().stats(),
            submitted=self._stat_submitted + self._core.fast_submitted(),
            work_requests=int(core["completed_wrs"]),
            bytes_written=int(core["bytes_written"]),
        )

    # --- completion path: one GIL acquisition per batch ------------------------------
    def _complete(self) -> None:
        pop = self._inflight.pop
        counters = self._native_counters
        while True:
            ok, failed, fired, messages = self._core.wait_batch(0.05)
            if fired:  # asyncio waits and expect callbacks the imms satisfied
                counters.fire_tokens(fired)
            for xfer_id in ok:
                transfer = pop(xfer_id, None)
                if transfer is not None:
                    self._stat_completed += 1
                    transfer._resolve(None)
            for xfer_id, status, message in failed:
                transfer = pop(xfer_id, None)
                if transfer is None:
                    continue
                self._stat_failed += 1
                exc: FabricError = (
                    EngineClosed(message)
                    if status == _CLOSED
                    else _STATUS.get(status, TransportError)(message, transfer_id=xfer_id)
                )
                transfer._resolve(exc)
            for raw in messages:
                (alen,) = _HEADER.unpack_from(raw)
                peer = DomainAddress(raw=raw[1 : 1 + alen])
                self._enqueue_message(Message(peer, raw[1 + alen :]))
            if self._stop and not ok and not failed and not fired and not messages:
                return

    # --- hooks -----------------------------------------------------------------------
    def _new_counter_table(self) -> CounterTable:
        # the worker counts imms into the C++ table; blocking waits wake from there
        self._native_counters = NativeCounterTable(self._core.counters(), self._dispatch)
        return self._native_counters

    def _backend_register(
        self, span: MemorySpan, writable: bool, handle: int
    ) -> tuple[tuple[int, ...], object]:
        token, keys = self._core.register_memory(span.ptr, span.length, writable)
        return tuple(keys), token

    def _backend_bound(self, reg: Registration) -> None:
        assert isinstance(reg.token, int)
        self._core.bind_region(reg.token, reg.handle, reg.region)

    def _backend_deregister(self, token: object) -> None:
        assert isinstance(token, int)
        self._core.deregister(token)

    def _gone(self, peer: bytes, transfer: Transfer) -> bool:
        """Fail ``transfer`` if ``peer`` is an endpoint closed in this process (guarded providers)."""
        if not _efa.is_closed(peer):
            return False
        self._stat_failed += 1
        transfer._resolve(
            PeerUnreachable(f"peer {peer.hex()} is closed", peer=peer.hex(), transfer_id=transfer.id)
        )
        return True

    def _backend_post(self, plan: Plan, transfer: Transfer, source: Registration | None) -> None:
        if self._guarded and any(self._gone(desc.peer.raw, transfer) for desc in plan.targets):
            return
        targets = [self._target_spec(desc) for desc in plan.targets]
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

    def _backend_send(self, peer: DomainAddress, payload: bytes, transfer: Transfer) -> None:
        if self._guarded and self._gone(peer.raw, transfer):
            return
        self._inflight[transfer.id] = transfer
        self._core.submit_send(transfer.id, peer.raw, self._header + payload)

    def _backend_check_peer(self, peer: DomainAddress) -> None:
        if self._guarded and _efa.is_closed(peer.raw):
            raise PeerUnreachable(f"peer {peer.raw.hex()} is closed", peer=peer.raw.hex())
        transfer = Transfer((0,), default_timeout=self._timeout)
        self._inflight[transfer.id] = transfer
        self._core.check_peer(transfer.id, peer.raw)
        try:
            transfer.wait()
        except PeerUnreachable as exc:
            raise PeerUnreachable(
                f"{peer} is not reachable on provider {self.provider_info['provider']}: {exc}",
                peer=peer.raw.hex(),
            ) from None

    def _backend_stop(self, exc: BaseException, drain: bool, timeout: float) -> None:
        if self._guarded:
            for a in self._addresses:
                _efa.close_address(a.raw)
        if drain:
            deadline = time.monotonic() + timeout
            while self._inflight and time.monotonic() < deadline:
                time.sleep(0.001)
        self._core.close()  # fails what is left with status "closed"
        self._stop = True
        self._completer.join()
        left = list(self._inflight.values())
        self._inflight.clear()
        for transfer in left:
            self._stat_failed += 1
            transfer._resolve(exc)

    def _backend_release(self, exc: BaseException) -> None:
        self._core.destroy()
