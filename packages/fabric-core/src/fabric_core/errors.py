"""The error tree of fabric, ordered by cause.

``FabricError`` is the root. Caller mistakes are ``ConfigError`` (also a ``ValueError``)
and are raised synchronously before anything is posted. Failures of the network or of a
peer are ``TransportError`` subclasses and arrive asynchronously on a ``Transfer`` or a
counter wait.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BackendNotInstalled",
    "BackendUnavailable",
    "BackendVersionMismatch",
    "CapabilityError",
    "ConfigError",
    "EngineClosed",
    "EngineWedged",
    "FabricError",
    "PeerIncompatible",
    "PeerUnreachable",
    "RemoteAccessError",
    "TransferCancelled",
    "TransferTimeout",
    "TransportError",
]


def _rebuild(cls: type[FabricError], args: tuple[Any, ...], state: dict[str, Any]) -> FabricError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class FabricError(Exception):
    """Root of every error raised by fabric.

    Every fabric error pickles with its message and fields intact (errors cross process
    boundaries: worker pools, multi-process harnesses, RPC layers).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class BackendNotInstalled(FabricError, ImportError):
    """The named backend's distribution is not installed; ``hint`` says how to install it."""

    def __init__(self, backend: str, hint: str) -> None:
        super().__init__(f"fabric backend {backend!r} is not installed: {hint}")
        self.backend = backend
        self.hint = hint


class BackendUnavailable(FabricError):
    """The backend is installed but cannot run here (no device, no library, no permission)."""

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"fabric backend {backend!r} is unavailable: {reason}")
        self.backend = backend
        self.reason = reason


class BackendVersionMismatch(BackendUnavailable):
    """The backend was built against another version of the fabric-core API."""

    def __init__(self, backend: str, backend_api: int, core_api: int) -> None:
        super().__init__(
            backend,
            f"it implements fabric-core API version {backend_api}, this fabric-core "
            f"speaks version {core_api}; install matching versions of both",
        )
        self.backend_api = backend_api
        self.core_api = core_api


class CapabilityError(FabricError, NotImplementedError):
    """The backend cannot do what was asked (e.g. CUDA memory on a host-only provider)."""


class ConfigError(FabricError, ValueError):
    """Bad caller input: raised before anything is posted; the engine is unchanged."""


class EngineClosed(FabricError):
    """The engine was closed: the call was refused, or in-flight work was failed by close()."""


class EngineWedged(EngineClosed):
    """The engine closed itself: its progress stayed inside one provider call for
    ``liveness_timeout_s`` (``stalled_s`` says how long), so it could move nothing more.

    Compiled backends only. On shm a post to a peer killed while it held the queue lock the
    two share never returns, and neither does a poll that waits on a lock the dead peer held
    (libfabric 2.x). Every transfer and counter wait in flight fails with it; later calls
    raise it. The engine's registrations stay alive for good (the stuck call may still use
    them); open a new engine to go on.
    """

    def __init__(self, message: str, *, stalled_s: float = 0.0) -> None:
        super().__init__(message)
        self.stalled_s = stalled_s


class TransportError(FabricError):
    """An asynchronous failure reported by the transport.

    ``peer`` is the hex address of the remote engine involved (if known), ``nic`` the local
    NIC index and ``transfer_id`` the id of the failed transfer.
    """

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        nic: int | None = None,
        transfer_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.nic = nic
        self.transfer_id = transfer_id


class PeerUnreachable(TransportError):
    """The peer is gone (dead, closed, or never existed) or the route to it failed."""


class PeerIncompatible(PeerUnreachable):
    """The peer runs a fabric release whose control frames this engine cannot read, nor it
    this engine's (another wire protocol version): run one release on every engine of a job.

    A subclass of ``PeerUnreachable``: the peer is lost to this engine as a silent one would be,
    only sooner (about a second after it was first heard speaking another version), and the
    message names both versions."""


class RemoteAccessError(TransportError):
    """The target refused the access: stale or forged key, out-of-range or deregistered memory."""


class TransferTimeout(TransportError, TimeoutError):
    """A deadline passed. ``expected`` and ``received`` map each imm to its counts."""

    def __init__(
        self,
        message: str,
        *,
        expected: Mapping[int, int] | None = None,
        received: Mapping[int, int] | None = None,
        peer: str | None = None,
        nic: int | None = None,
        transfer_id: int | None = None,
    ) -> None:
        self.expected = dict(expected or {})
        self.received = dict(received or {})
        if self.expected:
            dump = ", ".join(
                f"imm {imm:#x}: expected {n}, received {self.received.get(imm, 0)}"
                for imm, n in sorted(self.expected.items())
            )
            message = f"{message} ({dump})"
        super().__init__(message, peer=peer, nic=nic, transfer_id=transfer_id)


class TransferCancelled(TransportError):
    """The transfer was cancelled (``Transfer.cancel``) before it completed."""
