"""Exchange addresses and descriptors through a ``torch.distributed`` Store.

fabric has no rendezvous server of its own: launch with ``torchrun`` (or build a TCPStore or
FileStore yourself) and publish bytes through the store. Descriptors and addresses are plain
bytes, so any other side channel works as well.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Protocol

from .errors import ConfigError, PeerUnreachable
from .models import DomainAddress, MemoryRegionDescriptor

__all__ = ["Rendezvous", "Store"]


class Store(Protocol):
    """The part of ``torch.distributed.Store`` fabric uses."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


class Rendezvous:
    """Rank ``rank`` of ``world_size`` publishing and gathering bytes under ``prefix``."""

    def __init__(
        self, store: Store, *, rank: int, world_size: int, prefix: str = "fabric", timeout: float = 60.0
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside [0, {world_size})")
        if "/" in prefix:
            raise ConfigError("prefix must not contain '/'")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout = prefix, timeout

    @classmethod
    def from_env(cls, prefix: str = "fabric", timeout: float = 60.0) -> Rendezvous:
        """Join the store ``torchrun`` describes (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as exc:
            raise ConfigError(f"{exc.args[0]} is not set: launch with torchrun or pass a store") from None
        import importlib

        dist: Any = importlib.import_module("torch.distributed")
        store: Any = dist.TCPStore(
            host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        return cls(store, rank=rank, world_size=world, prefix=prefix, timeout=timeout)

    def _key(self, key: str, rank: int) -> str:
        if not key or "/" in key:
            raise ConfigError(f"key must be non-empty and without '/', got {key!r}")
        return f"{self.prefix}/{key}/{rank}"

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key, self.rank), bytes(value))

    def get(self, key: str, rank: int) -> bytes:
        """What ``rank`` published under ``key``; ``PeerUnreachable`` if it never does."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside [0, {self.world_size})")
        full = self._key(key, rank)
        try:
            self.store.wait([full], timedelta(seconds=self.timeout))
        except Exception as exc:  # the store raises its own error types on timeout
            raise PeerUnreachable(
                f"rank {rank} did not publish {key!r} within {self.timeout:g} s ({exc})"
            ) from exc
        return bytes(self.store.get(full))

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Publish ``value`` and return every rank's, in rank order."""
        self.publish(key, value)
        return [value if r == self.rank else self.get(key, r) for r in range(self.world_size)]

    def exchange_addresses(self, address: DomainAddress, key: str = "address") -> list[DomainAddress]:
        return [DomainAddress(raw=b) for b in self.all_gather(key, address.raw)]

    def exchange_descriptors(
        self, descriptor: MemoryRegionDescriptor, key: str = "descriptor"
    ) -> list[MemoryRegionDescriptor]:
        return [MemoryRegionDescriptor.from_bytes(b) for b in self.all_gather(key, descriptor.to_bytes())]
