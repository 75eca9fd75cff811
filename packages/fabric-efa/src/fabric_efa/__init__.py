"""fabric-efa: the libfabric backend of fabric."""

from __future__ import annotations

import importlib
import logging

from fabric_core.api import API_VERSION, Backend, ProbeResult, TransferEngine
from fabric_core.errors import BackendUnavailable
from fabric_core.models import Device, TopologyGroup
from fabric_core.settings import FabricSettings

from ._signals import preserved

__all__ = ["EfaBackend"]

logging.getLogger(__name__).addHandler(logging.NullHandler())

# The first load of the compiled module (and of libfabric with it) happens here, with the
# process's signal handlers kept (see _signals). A missing libfabric is reported by _native().
with preserved():
    try:
        from . import _efa  # noqa: F401
    except ImportError:
        pass


def _native() -> object:
    try:
        with preserved():
            native = importlib.import_module(f"{__name__}._efa")  # honours sys.modules
    except ImportError as exc:  # the module exists but libfabric.so is missing or broken
        raise BackendUnavailable(
            "efa",
            f"the compiled module cannot load libfabric ({exc}); install it: sudo apt-get install libfabric1",
        ) from exc
    return native


class EfaBackend(Backend):
    """Entry point ``efa`` of the ``fabric.backends`` group."""

    name = "efa"
    api_version = API_VERSION
    distribution = "fabric-efa"

    @classmethod
    def probe(cls, settings: FabricSettings | None = None) -> ProbeResult:
        from fabric_core.errors import ConfigError
        from fabric_core.settings import load_settings

        try:
            native = _native()
            prov = (settings or load_settings()).efa_provider
        except (BackendUnavailable, ConfigError) as exc:
            return ProbeResult(False, str(exc))
        problem = native.probe(prov)  # type: ignore[attr-defined]
        return ProbeResult(problem is None, problem or f"provider {prov}")

    @classmethod
    def detect_topology(cls, settings: FabricSettings) -> list[TopologyGroup]:
        """Where the provider's domains are PCI devices (efa: one per EFA device), one group per
        GPU with the domains closest to it, then a host group with all of them (or the groups
        ``efa_topology`` names); elsewhere (shm, tcp) one host group: the engine's NICs."""
        import os

        from fabric_core.topology import build_groups

        from .engine import EfaEngine, domain_infos, pci_domains

        engine = EfaEngine(settings)
        try:
            opened = engine.domains
        finally:
            engine.close()
        provider = settings.efa_provider
        listed = _native().list_domains(provider)  # type: ignore[attr-defined]
        physical = pci_domains(listed)
        if not physical and settings.efa_topology is None:
            return [TopologyGroup(device=Device(), domains=opened)]
        infos = domain_infos(
            listed if settings.efa_topology is not None else physical, provider, opened[0].max_msg_size
        )
        return build_groups(
            infos,
            override=settings.efa_topology,
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            setting="FABRIC_EFA_TOPOLOGY",
            noun=f"a domain of provider {provider!r}",
        )

    @classmethod
    def open(cls, settings: FabricSettings) -> TransferEngine:
        result = cls.probe(settings)
        if not result.available:
            raise BackendUnavailable("efa", result.reason)
        from .engine import EfaEngine

        return EfaEngine(settings)
