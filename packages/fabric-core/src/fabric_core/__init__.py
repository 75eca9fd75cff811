"""fabric-core: the typed WriteImm / ImmCounter contract shared by every fabric backend."""

from __future__ import annotations

import logging

from .api import API_VERSION, Backend, EngineStats, ProbeResult, TransferEngine
from .counters import CountWait, Expectation, ImmCounter
from .device_counter import DeviceCounter
from .errors import (
    BackendNotInstalled,
    BackendUnavailable,
    BackendVersionMismatch,
    CapabilityError,
    ConfigError,
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
from .memory import RawMemory
from .models import (
    Capabilities,
    Device,
    DomainAddress,
    DomainInfo,
    MemoryRegion,
    MemoryRegionDescriptor,
    NicKey,
    TopologyGroup,
)
from .ops import (
    BarrierRequest,
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
    plan_request,
)
from .registry import detect_topology, installed_backends, load_backend, open_engine
from .rendezvous import Rendezvous
from .settings import FabricSettings, load_settings
from .stats import NicStats, PeerStats, WaitStats
from .transfer import Transfer

logging.getLogger(__name__).addHandler(logging.NullHandler())


def get_include() -> str:
    """Directory of the header-only C++ engine core (``#include <fabric/engine.hpp>``)."""
    import os

    return os.path.join(os.path.dirname(__file__), "include")


__all__ = [
    "API_VERSION",
    "Backend",
    "BackendNotInstalled",
    "BackendUnavailable",
    "BackendVersionMismatch",
    "BarrierRequest",
    "Capabilities",
    "CapabilityError",
    "ConfigError",
    "CountWait",
    "Device",
    "DeviceCounter",
    "DomainAddress",
    "DomainInfo",
    "EngineClosed",
    "EngineWedged",
    "EngineStats",
    "Expectation",
    "FabricError",
    "FabricSettings",
    "ImmCounter",
    "ImmRequest",
    "MemoryRegion",
    "MemoryRegionDescriptor",
    "Message",
    "NicKey",
    "NicStats",
    "PagedWriteRequest",
    "PeerStats",
    "PeerGroup",
    "PeerIncompatible",
    "PeerUnreachable",
    "Pinned",
    "Plan",
    "ProbeResult",
    "RawMemory",
    "RemoteAccessError",
    "Rendezvous",
    "Request",
    "Routing",
    "ScatterRequest",
    "ScatterTarget",
    "ShardPeers",
    "Sharded",
    "TopologyGroup",
    "Transfer",
    "TransferEngine",
    "TransferCancelled",
    "TransferTimeout",
    "TransportError",
    "WaitStats",
    "WriteRequest",
    "detect_topology",
    "get_include",
    "installed_backends",
    "load_backend",
    "load_settings",
    "open_engine",
    "plan_request",
]
