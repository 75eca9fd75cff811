"""``SimEngine``: a TransferEngine on a ``SimFabric``."""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fabric_core import cuda
from fabric_core.base import EngineBase, Registration
from fabric_core.errors import ConfigError, EngineClosed, PeerUnreachable
from fabric_core.memory import MemorySpan
from fabric_core.models import Capabilities, Device, DomainAddress, DomainInfo
from fabric_core.ops import Message, Plan
from fabric_core.reconcile import PowerSums
from fabric_core.settings import FabricSettings
from fabric_core.stats import NicStats, PeerStats, TrafficTally
from fabric_core.transfer import Transfer

if TYPE_CHECKING:
    from .fabric import _WR, SimFabric, _Xfer

__all__ = ["SIM_MAX_MSG_SIZE", "SimEngine"]

SIM_MAX_MSG_SIZE = 1 << 30
"""Largest WR the simulated NIC accepts (as ConnectX's 1 GiB ``max_msg_sz``)."""


@dataclass(eq=False)
class _SimKeys:
    """What the simulated NICs check a remote write against (as a NIC checks its memory
    region: the key, the range and the access rights)."""

    ptr: int
    length: int
    rkeys: tuple[int, ...]
    remote_write: bool


class SimEngine(EngineBase):
    """An engine with ``nics`` simulated NICs on ``fabric``."""

    _cuda_one_allocation = False  # copies go by address: expandable_segments' pieces are fine

    def __init__(self, fabric: SimFabric, settings: FabricSettings, nics: int) -> None:
        if not 1 <= nics <= 64:
            raise ConfigError(f"nics must be in [1, 64], got {nics}")
        self._fabric = fabric
        self._rkeys: dict[tuple[int, int], _SimKeys] = {}
        self._inflight: set[_Xfer] = set()
        self._parked: deque[tuple[Message, _Xfer]] = deque()
        # NIC loss (see SimFabric._reconcile), all under the fabric lock. Per path (peer engine
        # id, NIC): WRs in flight, WRs failed with the NIC awaiting reconciliation, power sums
        # of the imms this engine got through it (as a sender) and counted from it (target).
        self._path_busy: dict[tuple[int, int], int] = {}
        self._path_failed: dict[tuple[int, int], list[_WR]] = {}
        # WriteImms of ended transfers (cancelled, past their deadline) that failed on a path:
        # not retried, but they may have been counted, so its next reconciliation counts them
        # among the failed ones (imm -> how many)
        self._path_ghosts: dict[tuple[int, int], dict[int, int]] = {}
        self._tx_sums: dict[tuple[int, int], PowerSums] = {}
        self._rx_sums: dict[tuple[int, int], PowerSums] = {}
        self._traffic = TrafficTally(nics)  # stats(), under the fabric lock
        self.engine_id = fabric.attach(self)
        self._keys = random.Random(fabric.seed * 1_000_003 + self.engine_id)
        max_msg = min(settings.max_msg_size or SIM_MAX_MSG_SIZE, SIM_MAX_MSG_SIZE)
        speed = fabric.link.bandwidth_gbps if fabric.link is not None else None
        super().__init__(
            settings,
            Capabilities(
                backend="sim",
                num_nics=nics,
                max_msg_size=max_msg,
                max_send_size=settings.max_send_size,
                cuda_memory=cuda.available(),  # moved with device copies (cuda.copy)
                virtual_clock=fabric.link is not None,
            ),
            [fabric.address(self.engine_id, i) for i in range(nics)],
            [
                DomainInfo(
                    name=f"sim{self.engine_id}.{i}",
                    provider="sim",
                    link_speed_gbps=speed,
                    max_msg_size=max_msg,
                )
                for i in range(nics)
            ],
            f"fabric-sim-cb-{fabric.fabric_id}.{self.engine_id}",
        )

    @property
    def fabric(self) -> SimFabric:
        return self._fabric

    # --- hooks ---------------------------------------------------------------------
    # Read without the fabric lock (stats() may be called from a callback that runs under
    # it): each figure is read whole, a snapshot may straddle an event.
    def _nic_stats(self) -> tuple[NicStats, ...]:
        return self._traffic.nic_stats()

    def _peer_stats(self) -> tuple[PeerStats, ...]:
        fabric = self._fabric
        return self._traffic.peer_stats(lambda eid: fabric.address(eid, 0))

    def _memory_span(self, memory: object) -> MemorySpan:
        # a phantom fabric registers meta tensors: a size, an address no byte is ever read at
        if self._fabric.phantom and type(memory).__module__.startswith("torch"):
            t: Any = memory
            if t.device.type == "meta":
                nbytes = int(t.numel()) * int(t.element_size())
                if nbytes == 0:
                    raise ConfigError("cannot register an empty tensor")
                return MemorySpan(self._fabric.phantom_range(nbytes), nbytes, Device(), True, t)
        return super()._memory_span(memory)

    def _backend_register(
        self, span: MemorySpan, writable: bool, handle: int
    ) -> tuple[tuple[int, ...], object]:
        rkeys = tuple(self._keys.getrandbits(64) for _ in range(self._nics))
        keys = _SimKeys(span.ptr, span.length, rkeys, remote_write=writable)
        with self._fabric._cv:
            for nic, key in enumerate(keys.rkeys):
                self._rkeys[(nic, key)] = keys
        return keys.rkeys, keys

    def _backend_deregister(self, token: object) -> None:
        assert isinstance(token, _SimKeys)
        with self._fabric._cv:
            for nic, key in enumerate(token.rkeys):
                self._rkeys.pop((nic, key), None)

    def _backend_post(
        self, plan: Plan, transfer: Transfer, source: Registration | None, timeout: float
    ) -> None:
        if source is None:
            self._fabric.post(self, plan, transfer, 0, timeout)
        else:
            self._fabric.post(self, plan, transfer, source.ptr, timeout, source.region.device.kind == "cuda")

    def _backend_send(self, peer: DomainAddress, payload: bytes, transfer: Transfer, timeout: float) -> None:
        self._fabric.post_message(self, peer, payload, transfer, timeout)

    def _backend_cancel(self, transfer: Transfer, timeout: float) -> tuple[bool, list[bytes]]:
        with self._fabric._cv:
            xfer = next((x for x in self._inflight if x.transfer is transfer), None)
            if xfer is None or xfer.early:
                return False, []
            self._inflight.discard(xfer)
            xfer.left = -1  # its pending chunks become no-ops: nothing more of it lands now
            self._fabric._count_landed_imms(xfer)  # and what landed is counted now
        return True, []  # so no fence is needed

    def _dump_core(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._fabric._cv:
            xfers = sorted(self._inflight, key=lambda x: x.started)
            requests = [
                {
                    "id": x.transfer.id,
                    "age_s": now - x.started,
                    "deadline_in_s": None if math.isinf(x.deadline) else x.deadline - now,
                    "work_requests": x.total,
                    "outstanding": x.left,
                    "peers": [self._fabric.address(p, 0).raw.hex() for p in sorted(x.peers)],
                    "imm": x.imm,
                    "failed_early": x.early,
                }
                for x in xfers
            ]
            stalled = dict(self._fabric._stalled)
            peers = [
                {
                    "address": self._fabric.address(p, 0).raw.hex(),
                    "silent_s": now - since,
                    "lost": (self.engine_id, p) in self._fabric._lost,
                }
                for p, since in stalled.items()
                if p != self.engine_id
            ]
        return {"requests": requests, "peers": peers}

    def _backend_check_peer(self, peer: DomainAddress) -> None:
        with self._fabric._cv:
            self._fabric.resolve(peer)

    def _deliver(self, peer: DomainAddress, data: bytes, xfer: _Xfer) -> bool:
        """Land a message in a posted receive buffer; with all ``recv_depth`` buffers full,
        park it (the sender stays incomplete, as under receiver-not-ready back-off)."""
        with self._msg_cv:
            if len(self._messages) >= self._settings.recv_depth:
                self._parked.append((Message(peer, data), xfer))
                return False
        self._enqueue_message(Message(peer, data))
        return True

    def _message_taken(self) -> None:
        with self._msg_cv:
            parked = self._parked.popleft() if self._parked else None
            if parked is not None:
                self._messages.append(parked[0])
                self._msg_cv.notify()
        if parked is not None:
            self._fabric.message_taken(parked[1])

    def _crash(self) -> None:
        """Die abruptly (fault injection): no drain, pending work abandoned."""
        self._shutdown(EngineClosed("engine crashed (fault injection)"), drain=False, timeout=0.0)

    def _backend_stop(self, exc: BaseException, drain: bool, timeout: float) -> None:
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

    def _backend_release(self, exc: BaseException) -> None:
        with self._msg_cv:
            parked = [x for _, x in self._parked]
            self._parked.clear()
        for x in parked:
            self._fabric.message_taken(x, PeerUnreachable(f"peer {self.address} closed before receiving"))
        self._fabric.detach(self, exc)
