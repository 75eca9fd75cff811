"""Link model for the simulator's virtual clock.

Parameters are written once per preset from public hardware facts; they are never fitted to
an experiment. The cluster-scale model (NVLink, max-min sharing, host proxy costs) is the
simulator issue's; this one is a per-NIC serialising model: each NIC sends and receives one
work request at a time at its line rate, after a fixed per-request cost, plus wire latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric_core.errors import ConfigError

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


PRESETS = {
    # NVIDIA ConnectX-7, NDR 400 Gb/s per port (datasheet); ~2 µs RDMA write latency through
    # one switch; ~200 M messages/s per NIC (datasheet "up to 330-370 Mpps" full duplex).
    "cx7-400g": LinkModel("cx7-400g", 400.0, 2.0e-6, 5e-9),
    # AWS p5: EFA v2, 32 × 100 Gb/s = 4 × 100G per GPU (AWS instance docs); SRD small-message
    # latency is on the order of 15 µs (AWS EFA docs/blog figures).
    "efa-p5": LinkModel("efa-p5", 100.0, 15e-6, 1e-6),
    # AWS p5en: EFA v3, 16 × 200 Gb/s = 2 × 200G per GPU.
    "efa-p5en": LinkModel("efa-p5en", 200.0, 12e-6, 1e-6),
}


def link_preset(name: str) -> LinkModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown link preset {name!r}; presets: {', '.join(sorted(PRESETS))}") from None
