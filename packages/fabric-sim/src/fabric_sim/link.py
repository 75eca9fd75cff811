"""Link model for the simulator's virtual clock.

Parameters are written once per preset from public hardware facts, in fabric_sim.cluster
(``CLUSTERS``); they are never fitted to an experiment. This is a per-NIC serialising model
for a pair of engines: each NIC sends and receives one work request at a time at its line
rate, after a fixed per-request cost, plus wire latency. The cluster-scale model (max-min
sharing between flows, NVLink) is ``fabric_sim.cluster.FlowModel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric_core.errors import ConfigError

from .cluster import CLUSTERS

__all__ = ["PRESETS", "LinkModel", "link_preset"]


@dataclass(frozen=True, slots=True)
class LinkModel:
    name: str
    bandwidth_gbps: float
    """Line rate of one NIC, per direction."""
    latency_s: float
    """One-way wire + switch latency of a small write."""
    per_op_s: float
    """NIC/host cost of posting one work request."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


# One NIC of each cluster preset (fabric_sim.cluster.CLUSTERS: the facts are written there).
PRESETS = {name: LinkModel(name, c.nic_gbps, c.nic_latency_s, c.per_wr_s) for name, c in CLUSTERS.items()}


def link_preset(name: str) -> LinkModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown link preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None
