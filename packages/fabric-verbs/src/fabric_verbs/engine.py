"""``VerbsEngine``: fabric's contract on libibverbs RC queue pairs through the C++ engine core."""

from __future__ import annotations

import logging
from typing import Any

from fabric_core.errors import BackendUnavailable, FabricError
from fabric_core.models import Capabilities, DomainInfo
from fabric_core.native import HEADER_BYTES, NativeEngine
from fabric_core.settings import FabricSettings

from . import _verbs
from .settings import VerbsSettings, load_verbs_settings

__all__ = ["RegistrationError", "VerbsEngine", "default_devices", "domain_details", "usable_devices"]

logger = logging.getLogger(__name__)


class RegistrationError(FabricError, RuntimeError):
    """The device refused to register memory (the message says why: the locked-memory limit,
    no DMA-BUF and no peer memory for CUDA memory, ...)."""


def usable_devices(devices: list[dict[str, Any]], port: int = 0) -> list[str]:
    """Names of the devices (``_verbs.list_devices()``) with an ACTIVE port (``port``, or any)."""
    out = []
    for d in devices:
        if d["error"]:
            continue
        if any(
            p["state"] in ("ACTIVE", "ACTIVE_DEFER") and (port == 0 or p["port"] == port) for p in d["ports"]
        ):
            out.append(str(d["name"]))
    return out


def default_devices(verbs: VerbsSettings) -> list[str]:
    """The devices an engine opens: ``FABRIC_VERBS_DEVICE``, else every usable one by name."""
    if verbs.devices:
        return list(verbs.devices)
    names = usable_devices(_verbs.list_devices(), verbs.port)
    if not names:
        problem = _verbs.probe([], verbs.port) or _verbs.NO_DEVICE
        raise BackendUnavailable("verbs", problem)
    return names


def domain_details(info: dict[str, Any]) -> dict[str, str | int | bool]:
    """What ``fabric info`` shows of one NIC besides its speed, NUMA node and PCI address."""
    return {
        "device": str(info["device"]),
        "port": int(info["port"]),
        "link_layer": str(info["link_layer"]),
        "gid_index": int(info["gid_index"]),
        "gid": str(info["gid"]),
        "gid_type": str(info["gid_type"]),
        "mtu": int(info["mtu"]),
        "max_msg_sz": int(info["max_msg_sz"]),
        "fw": str(info["fw_ver"]),
        "sq_depth": int(info["sq_depth"]),
        "imm_depth": int(info["imm_depth"]),
    }


class VerbsEngine(NativeEngine):
    """One domain group of ``settings.nics`` verbs domains (default: one per usable device)."""

    def __init__(self, settings: FabricSettings, verbs: VerbsSettings | None = None) -> None:
        verbs = verbs or load_verbs_settings()
        devices = default_devices(verbs)
        nics = settings.nics or len(devices)
        try:
            core = _verbs.Engine(
                devices,
                nics,
                settings.chaos_seed,
                -1 if settings.worker_cpu is None else settings.worker_cpu,
                settings.recv_depth,
                settings.max_send_size + HEADER_BYTES,
                verbs.options(),
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                "verbs", f"cannot open {nics} domain(s) on {', '.join(devices)}: {exc}"
            ) from exc
        infos: list[dict[str, Any]] = core.domain_info()
        max_msg = min(int(i["max_wr_bytes"]) for i in infos)
        max_msg = _verbs.max_wr_bytes(max_msg, settings.max_msg_size or 0)
        self.verbs_settings = verbs
        super().__init__(
            settings,
            core,
            Capabilities(
                backend="verbs",
                num_nics=nics,
                max_msg_size=max_msg,
                max_send_size=settings.max_send_size,
                cuda_memory=_verbs.cuda_driver(),
            ),
            [
                DomainInfo(
                    name=f"{info['device']}:{info['port']}#{i}",
                    provider="verbs",
                    link_speed_gbps=float(info["speed_gbps"]) or None,
                    numa_node=int(info["numa_node"]) if int(info["numa_node"]) >= 0 else None,
                    pci_bus_id=str(info["pci"]) or None,
                    max_msg_size=max_msg,
                    details=domain_details(info),
                )
                for i, info in enumerate(infos)
            ],
            where="verbs",
        )
        self._verbs_core = core

    def domain_stats(self) -> list[dict[str, int]]:
        """Per NIC: handshakes, QP errors, posted and signalled work requests, doorbells, the
        imm receive queue's low-water mark, registrations by kind."""
        return self._verbs_core.domain_stats()

    def _registration_error(self, exc: RuntimeError) -> BaseException | None:
        return RegistrationError(str(exc))
