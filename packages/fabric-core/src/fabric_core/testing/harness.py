"""What a backend gives the conformance suite: a way to open engines that reach each other,
and (optionally) a way to hold delivery and to inject faults."""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..api import TransferEngine
from ..errors import CapabilityError

__all__ = ["Harness"]


class Harness(ABC):
    """Subclass per backend and return it from a ``fabric_harness`` fixture.

    Capability flags (``supports_faults``, ``max_nics``, engine ``Capabilities``) decide what
    is skipped; the suite never looks at backend names.
    """

    supports_faults: bool = False
    """``kill_peer`` and ``kill_nic`` work."""
    supports_stall: bool = False
    supports_nic_faults: bool = False
    """``kill_nic`` and ``restore_nic`` work (a NIC lost under traffic, then back)."""
    """``stall_peer`` and ``resume_peer`` work (a peer alive but silent, as under SIGSTOP)."""
    max_nics: int = 1
    """Largest NIC count ``open_engine`` can give."""
    reports_remote_access_errors: bool = True
    """A write with a stale or forged key fails at the writer with ``RemoteAccessError`` (a
    transport may never report it: libfabric's shm leaves such a write incomplete, which
    fabric-efa avoids by checking the target's region table before posting)."""
    survives_refused_writes: bool = True
    """After the target refuses one of its writes (a stale or forged key), the writer goes on
    writing to every peer (libfabric 1.17's shm, given such a write, wedges the writer's
    endpoint: later writes to any peer never complete)."""
    detects_closed_peers: bool = True
    """A write to an engine that was closed fails with ``PeerUnreachable`` at the writer.
    A transport can be silent about it (libfabric's tcp provider, or any provider across
    processes); telling then needs a liveness protocol."""

    def __init__(self) -> None:
        self._engines: list[TransferEngine] = []

    @abstractmethod
    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine: ...

    def open_engine(self, nics: int = 1, **config: Any) -> TransferEngine:
        """An engine that can reach every other engine this harness opened."""
        engine = self._open(nics, config)
        self._engines.append(engine)
        return engine

    def alloc(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Zeroed host bytes that the harness's engines can register (a harness whose engines
        live in other processes hands out shared memory here)."""
        return np.zeros(nbytes, dtype=np.uint8)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold delivery while inside (no-op where the backend cannot)."""
        yield

    def settle(self, timeout: float = 5.0) -> None:
        """Wait until nothing is in flight (best effort where the backend cannot tell)."""
        time.sleep(min(timeout, 0.05))

    def kill_peer(self, engine: TransferEngine) -> None:
        """Make ``engine`` die as its process would: no drain, no goodbye."""
        raise CapabilityError("this harness cannot kill a peer")

    def kill_nic(self, engine: TransferEngine, nic: int) -> None:
        """Take NIC ``nic`` of ``engine`` down."""
        raise CapabilityError("this harness cannot kill a NIC")

    def restore_nic(self, engine: TransferEngine, nic: int) -> None:
        """Bring back a NIC ``kill_nic`` took down."""
        raise CapabilityError("this harness cannot kill a NIC")

    def stall_peer(self, engine: TransferEngine) -> None:
        """Make ``engine`` alive but silent, as a stopped process (SIGSTOP): nothing moves to
        or from it until ``resume_peer``."""
        raise CapabilityError("this harness cannot stall a peer")

    def resume_peer(self, engine: TransferEngine) -> None:
        """Let a stalled ``engine`` go on (what was held moves, late writes included)."""
        raise CapabilityError("this harness cannot stall a peer")

    def close(self) -> None:
        for engine in reversed(self._engines):
            engine.close(timeout=5.0)
        self._engines.clear()
