"""Per-layer cache tensors checked against a layout and registered with an engine."""

from __future__ import annotations

import logging
from typing import Any

from fabric_core.api import TransferEngine
from fabric_core.errors import EngineClosed, FabricError
from fabric_core.models import MemoryRegion, MemoryRegionDescriptor

from .layout import KvLayout

__all__ = ["RegisteredCache"]

logger = logging.getLogger(__name__)


class RegisteredCache:
    """``layout.check(caches)``, then every tensor registered on every NIC of ``engine``.

    ``regions[layer][tensor]`` follows ``layout.tensor_names``; ``descriptors`` is the same,
    flattened layer by layer (the order of the HELLO message).
    """

    def __init__(self, engine: TransferEngine, layout: KvLayout, caches: Any) -> None:
        self.engine = engine
        self.layout = layout
        self.tensors = layout.check(caches)
        regions: list[tuple[MemoryRegion, ...]] = []
        try:
            for layer in self.tensors:
                regions.append(tuple(engine.register(t) for t in layer))
        except BaseException:
            for layer_regions in regions:
                for r in layer_regions:
                    engine.deregister(r)
            raise
        self.regions = tuple(regions)
        self.descriptors: tuple[MemoryRegionDescriptor, ...] = tuple(
            r.descriptor for layer_regions in self.regions for r in layer_regions
        )

    def close(self) -> None:
        """Deregister every tensor (nothing to do once the engine is closed)."""
        if self.engine.closed:
            return
        for layer_regions in self.regions:
            for r in layer_regions:
                try:
                    self.engine.deregister(r)
                except EngineClosed:
                    return
                except FabricError as exc:  # already withdrawn: nothing left to do for it
                    logger.debug("kvcache: deregistering a cache tensor: %s", exc)
