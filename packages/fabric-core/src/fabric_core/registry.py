"""Backend discovery over the ``fabric.backends`` entry-point group, with install hints."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

from .api import API_VERSION, Backend, ProbeResult, TransferEngine
from .errors import BackendNotInstalled, BackendUnavailable, BackendVersionMismatch, ConfigError
from .models import TopologyGroup
from .settings import FabricSettings, load_settings

__all__ = [
    "AUTO_ORDER",
    "backend_version",
    "install_hint",
    "installed_backends",
    "load_backend",
    "open_engine",
]

logger = logging.getLogger(__name__)

GROUP = "fabric.backends"
AUTO_ORDER = ("efa", "verbs")
"""Backends ``backend="auto"`` tries, in order. The simulator is only chosen by name."""

_KNOWN = {"efa": "fabric-efa", "verbs": "fabric-verbs", "sim": "fabric-sim"}


def install_hint(name: str) -> str:
    dist = _KNOWN.get(name, f"fabric-{name}")
    return (
        f"pip install 'fabric-core[{name}]' (from a fabric clone: "
        f"pip install ./packages/fabric-core ./packages/{dist})"
    )


def installed_backends() -> dict[str, str]:
    """Backend name → ``module:Class`` of every installed backend."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


def load_backend(name: str) -> type[Backend]:
    """The backend class for ``name``; raises with an install hint or a version mismatch."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        if name not in _KNOWN:
            known = ", ".join(sorted(set(_KNOWN) | set(installed_backends())))
            raise ConfigError(f"unknown fabric backend {name!r}; known backends: {known}")
        raise BackendNotInstalled(name, install_hint(name))
    cls: Any = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailable(name, f"entry point {found[0].value} is not a fabric_core.Backend")
    if cls.api_version != API_VERSION:
        raise BackendVersionMismatch(name, cls.api_version, API_VERSION)
    return cls


def backend_version(cls: type[Backend]) -> str:
    try:
        return version(cls.distribution)
    except PackageNotFoundError:
        return "unknown"


def probe(name: str) -> ProbeResult:
    try:
        return load_backend(name).probe()
    except (BackendNotInstalled, BackendUnavailable) as exc:
        return ProbeResult(False, str(exc))


def select_backend(settings: FabricSettings) -> type[Backend]:
    """Resolve ``settings.backend`` ('auto' tries efa then verbs) to a runnable backend."""
    if settings.backend != "auto":
        cls = load_backend(settings.backend)
        result = cls.probe(settings)
        if not result.available:
            raise BackendUnavailable(settings.backend, result.reason)
        return cls
    reasons = []
    for name in AUTO_ORDER:
        try:
            cls = load_backend(name)
        except (BackendNotInstalled, BackendUnavailable) as exc:
            reasons.append(str(exc))
            continue
        result = cls.probe(settings)
        if result.available:
            return cls
        reasons.append(f"{name}: {result.reason}")
    raise BackendUnavailable(
        "auto",
        "no RDMA backend can run here (" + "; ".join(reasons) + "). "
        "For the in-process simulator pass backend='sim' or set FABRIC_BACKEND=sim.",
    )


def detect_topology(backend: str | None = None, **config: Any) -> list[TopologyGroup]:
    """The domain groups (GPU ↔ NICs ↔ CPUs) the selected backend sees on this machine."""
    if backend is not None:
        config["backend"] = backend
    settings = load_settings(**config)
    return select_backend(settings).detect_topology(settings)


def open_engine(backend: str | None = None, **config: Any) -> TransferEngine:
    """Open an engine. ``config`` keys are ``FabricSettings`` fields (``FABRIC_*`` variables
    give the defaults)."""
    if backend is not None:
        config["backend"] = backend
    settings = load_settings(**config)
    cls = select_backend(settings)
    logger.debug("opening fabric backend %s", cls.name)
    return cls.open(settings)
