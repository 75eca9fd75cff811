"""The conformance harness of the simulator (also handy for users' own tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from fabric_core.api import TransferEngine
from fabric_core.errors import ConfigError
from fabric_core.testing import Harness

from .engine import SimEngine
from .fabric import SimFabric

__all__ = ["SimHarness"]


class SimHarness(Harness):
    """Engines on one private ``SimFabric`` seeded with ``seed``."""

    supports_faults = True
    supports_stall = True
    supports_nic_faults = True
    max_nics = 8

    def __init__(self, seed: int = 0, **fabric_args: Any) -> None:
        super().__init__()
        self.fabric = SimFabric(seed, **fabric_args)

    def _open(self, nics: int, config: dict[str, Any]) -> TransferEngine:
        return self.fabric.open_engine(nics, **config)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self.fabric.paused():
            yield

    def settle(self, timeout: float = 5.0) -> None:
        self.fabric.quiesce(timeout)

    def _sim(self, engine: TransferEngine) -> SimEngine:
        if not isinstance(engine, SimEngine) or engine.fabric is not self.fabric:
            raise ConfigError("not an engine of this harness")
        return engine

    def kill_peer(self, engine: TransferEngine) -> None:
        self.fabric.fail_peer(self._sim(engine))

    def kill_nic(self, engine: TransferEngine, nic: int) -> None:
        self.fabric.fail_nic(self._sim(engine), nic)

    def restore_nic(self, engine: TransferEngine, nic: int) -> None:
        self.fabric.restore_nic(self._sim(engine), nic)

    def stall_peer(self, engine: TransferEngine) -> None:
        self.fabric.stall_peer(self._sim(engine))

    def resume_peer(self, engine: TransferEngine) -> None:
        self.fabric.resume_peer(self._sim(engine))
