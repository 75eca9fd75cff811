"""fabric-sim: the in-process simulator backend of fabric."""

from __future__ import annotations

import logging
import threading

from fabric_core.api import API_VERSION, Backend, ProbeResult
from fabric_core.errors import ConfigError
from fabric_core.models import Device, DomainInfo, TopologyGroup
from fabric_core.settings import FabricSettings

from .engine import SIM_MAX_MSG_SIZE, SimEngine
from .fabric import SimFabric
from .link import PRESETS, LinkModel, link_preset

__all__ = ["PRESETS", "LinkModel", "SimBackend", "SimEngine", "SimFabric", "default_fabric", "link_preset"]

logging.getLogger(__name__).addHandler(logging.NullHandler())

DEFAULT_NICS = 2
_lock = threading.Lock()
_default: SimFabric | None = None


def default_fabric(settings: FabricSettings) -> SimFabric:
    """The process-wide fabric that ``open_engine(backend="sim")`` engines share.

    It is made from the first engine's settings; while engines live on it, opening one with
    another seed, chunk size or link preset is refused rather than silently ignored.
    """
    global _default
    link = link_preset(settings.sim_link) if settings.sim_link else None
    want = (settings.sim_seed, settings.sim_chunk_bytes, link)
    with _lock:
        cur = _default
        if cur is not None and (cur.seed, cur.chunk_bytes, cur.link) != want:
            if cur.engines:
                raise ConfigError(
                    f"this process's simulated fabric runs with seed={cur.seed}, chunk_bytes="
                    f"{cur.chunk_bytes}, link={cur.link.name if cur.link else None}; close its "
                    "engines first or build a SimFabric of your own"
                )
            cur = None
        if cur is None:
            cur = _default = SimFabric(settings.sim_seed, chunk_bytes=settings.sim_chunk_bytes, link=link)
        return cur


class SimBackend(Backend):
    """Entry point ``sim`` of the ``fabric.backends`` group."""

    name = "sim"
    api_version = API_VERSION
    distribution = "fabric-sim"

    @classmethod
    def probe(cls, settings: FabricSettings | None = None) -> ProbeResult:
        return ProbeResult(True, "pure Python, always available")

    @classmethod
    def detect_topology(cls, settings: FabricSettings) -> list[TopologyGroup]:
        nics = settings.nics or DEFAULT_NICS
        max_msg = min(settings.max_msg_size or SIM_MAX_MSG_SIZE, SIM_MAX_MSG_SIZE)
        speed = link_preset(settings.sim_link).bandwidth_gbps if settings.sim_link else None
        domains = tuple(
            DomainInfo(name=f"sim.{i}", provider="sim", link_speed_gbps=speed, max_msg_size=max_msg)
            for i in range(nics)
        )
        return [TopologyGroup(device=Device(), domains=domains)]

    @classmethod
    def open(cls, settings: FabricSettings) -> SimEngine:
        return SimEngine(default_fabric(settings), settings, settings.nics or DEFAULT_NICS)
