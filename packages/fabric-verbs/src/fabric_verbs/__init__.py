"""fabric-verbs: the libibverbs backend of fabric (ConnectX; any RC-capable verbs device)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from fabric_core.api import API_VERSION, Backend, ProbeResult, TransferEngine
from fabric_core.errors import BackendUnavailable, ConfigError
from fabric_core.models import DomainInfo, TopologyGroup
from fabric_core.settings import FabricSettings

from .settings import VerbsSettings, load_verbs_settings

__all__ = ["INSTALL_HINT", "VerbsBackend", "VerbsSettings", "load_verbs_settings"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
logger = logging.getLogger(__name__)

INSTALL_HINT = "sudo apt-get install libibverbs1 ibverbs-providers (RHEL/Fedora: sudo dnf install rdma-core)"


def _native() -> Any:
    """The compiled module; ``BackendUnavailable`` with the install hint when libibverbs is missing."""
    try:
        return importlib.import_module(f"{__name__}._verbs")  # honours sys.modules
    except ImportError as exc:  # the module exists but libibverbs.so.1 is missing or broken
        raise BackendUnavailable(
            "verbs", f"the compiled module cannot load libibverbs ({exc}); install it: {INSTALL_HINT}"
        ) from exc


def _gid_table(port: dict[str, Any]) -> str:
    return "; ".join(f"{g['index']} {g['gid']} ({g['type']})" for g in port["gids"]) or "empty"


def _domain_infos(native: Any, verbs: VerbsSettings, settings: FabricSettings) -> list[DomainInfo]:
    """One DomainInfo per usable device, with the port and GID an engine would use."""
    from .engine import usable_devices

    devices = {str(d["name"]): d for d in native.list_devices()}
    names = list(verbs.devices) or usable_devices(list(devices.values()), verbs.port)
    out = []
    for name in names:
        dev = devices.get(name)
        if dev is None:
            raise BackendUnavailable("verbs", f"no RDMA device named {name!r} (FABRIC_VERBS_DEVICE)")
        try:
            sel = native.select_port(name, verbs.port, verbs.gid_index)
        except RuntimeError as exc:
            logger.warning("verbs: %s is left out of the topology: %s", name, exc)
            continue
        port = next(p for p in dev["ports"] if p["port"] == sel["port"])
        max_msg = native.max_wr_bytes(int(sel["max_wr_bytes"]), settings.max_msg_size or 0)
        numa = int(dev["numa_node"])
        out.append(
            DomainInfo(
                name=f"{name}:{sel['port']}",
                provider="verbs",
                link_speed_gbps=float(port["speed_gbps"]) or None,
                numa_node=numa if numa >= 0 else None,
                pci_bus_id=str(dev["pci"]) or None,
                max_msg_size=max_msg,
                details={
                    "port": int(sel["port"]),
                    "state": str(port["state"]),
                    "link_layer": str(port["link_layer"]),
                    "gid_index": int(sel["gid_index"]),
                    "gid": str(sel["gid"]),
                    "gid_type": str(sel["gid_type"]),
                    "gids": _gid_table(port),
                    "mtu": int(port["mtu"]),
                    "max_msg_sz": int(port["max_msg_sz"]),
                    "lanes": int(port["lanes"]),
                    "fw": str(dev["fw_ver"]),
                    "node_guid": str(dev["node_guid"]),
                },
            )
        )
    return out


class VerbsBackend(Backend):
    """Entry point ``verbs`` of the ``fabric.backends`` group."""

    name = "verbs"
    api_version = API_VERSION
    distribution = "fabric-verbs"

    @classmethod
    def probe(cls, settings: FabricSettings | None = None) -> ProbeResult:
        try:
            native = _native()
            verbs = load_verbs_settings()
        except BackendUnavailable as exc:
            return ProbeResult(False, exc.reason)
        except ConfigError as exc:
            return ProbeResult(False, str(exc))
        try:
            problem = native.probe(list(verbs.devices), verbs.port)
        except Exception as exc:  # probe() never raises
            return ProbeResult(False, f"probing RDMA devices failed: {type(exc).__name__}: {exc}")
        if problem is not None:
            return ProbeResult(False, str(problem))
        from .engine import usable_devices

        names = list(verbs.devices) or usable_devices(native.list_devices(), verbs.port)
        return ProbeResult(True, f"RDMA device(s) {', '.join(names)}")

    @classmethod
    def detect_topology(cls, settings: FabricSettings) -> list[TopologyGroup]:
        import os

        from fabric_core.topology import build_groups

        native = _native()
        verbs = load_verbs_settings()
        problem = native.probe(list(verbs.devices), verbs.port)
        if problem is not None:
            raise BackendUnavailable("verbs", str(problem))
        domains = _domain_infos(native, verbs, settings)
        if not domains:
            raise BackendUnavailable("verbs", "no RDMA device has a usable port and GID (see the warnings)")
        return build_groups(domains, override=verbs.topology, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))

    @classmethod
    def open(cls, settings: FabricSettings) -> TransferEngine:
        result = cls.probe(settings)
        if not result.available:
            raise BackendUnavailable("verbs", result.reason)
        from .engine import VerbsEngine

        return VerbsEngine(settings)
