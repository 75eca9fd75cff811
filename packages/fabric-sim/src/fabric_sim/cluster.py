"""Cluster-scale timing model for the simulator: max-min fair flows over NICs and NVLink.

A cluster is nodes x GPUs per node x NICs per GPU. Every NIC has a line rate per direction, a
one-way latency and a per-work-request cost (the host posting it and the NIC processing it,
one at a time per NIC); every GPU has an NVLink port with its own rate per direction and
latency for traffic inside its node. The parameters come from datasheets and public figures,
written once per preset in ``CLUSTERS``; they are never fitted to an experiment.

``FlowModel`` times work requests on such a cluster in virtual time. A work request from NIC
``(node, gpu, nic)`` to another node's NIC waits for its NIC to post it (``per_wr_s`` after the
previous one, serially), then its bytes flow at a rate shared max-min fairly with every other
flow in flight: each flow uses its source NIC's send direction and its target NIC's receive
direction, and the rates are the progressive-filling allocation (every flow gets its fair
share of its most contended resource, and no flow can gain without taking from one with less).
It completes ``latency_s`` after its last byte left. Inside a node, the same holds over the two
GPUs' NVLink ports. Rates are recomputed whenever a flow starts or ends, so the timeline is
exact for the model: small cases have closed-form answers (``tests``: one flow, flows sharing a
NIC, many small writes bounded by the per-request cost).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fabric_core.errors import ConfigError

__all__ = ["CLUSTERS", "ClusterSpec", "FlowModel", "Port", "WorkRequest", "cluster_preset"]


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A cluster's shape and its hardware facts (per direction where it says rate)."""

    name: str
    gpus_per_node: int
    nics_per_gpu: int
    nic_gbps: float
    """One NIC's line rate, per direction (Gbit/s)."""
    nic_latency_s: float
    """One-way latency of a small RDMA write through the fabric (NIC to NIC)."""
    per_wr_s: float
    """Cost of one work request at its NIC (posting and processing; one at a time per NIC)."""
    nvlink_gbps: float
    """One GPU's NVLink bandwidth, per direction (Gbit/s)."""
    nvlink_latency_s: float

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_gpu"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("nic_gbps", "nvlink_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive rate, got {value}")
        for name in ("nic_latency_s", "per_wr_s", "nvlink_latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a non-negative time, got {value}")

    @property
    def gpu_gbps(self) -> float:
        """One GPU's network bandwidth per direction: all its NICs together."""
        return self.nic_gbps * self.nics_per_gpu


# NVLink 4 (H100/H200 SXM): 900 GB/s per GPU, both directions together (NVIDIA datasheet):
# 450 GB/s = 3600 Gbit/s each way; a few hundred ns through NVSwitch.
_NVLINK4_GBPS, _NVLINK4_LATENCY_S = 3600.0, 0.5e-6
CLUSTERS: dict[str, ClusterSpec] = {
    # H100/H200 nodes of 8 GPUs, one ConnectX-7 NDR 400 Gb/s per GPU (datasheet); ~2 µs RDMA
    # write latency through one switch; ~5 ns per work request (datasheet message rates of
    # a few hundred million per second).
    "cx7-400g": ClusterSpec("cx7-400g", 8, 1, 400.0, 2.0e-6, 5e-9, _NVLINK4_GBPS, _NVLINK4_LATENCY_S),
    # AWS p5 (H100): 32 EFA v2 NICs of 100 Gb/s per node, 4 per GPU (AWS instance docs); SRD
    # small-message latency on the order of 15 µs, ~1 µs per work request (AWS EFA figures).
    "efa-p5": ClusterSpec("efa-p5", 8, 4, 100.0, 15e-6, 1e-6, _NVLINK4_GBPS, _NVLINK4_LATENCY_S),
    # AWS p5en (H200): 16 EFA v3 NICs of 200 Gb/s per node, 2 per GPU.
    "efa-p5en": ClusterSpec("efa-p5en", 8, 2, 200.0, 12e-6, 1e-6, _NVLINK4_GBPS, _NVLINK4_LATENCY_S),
}


def cluster_preset(name: str) -> ClusterSpec:
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown cluster preset {name!r}; presets: {', '.join(sorted(CLUSTERS))}"
        ) from None


@dataclass(frozen=True, slots=True, order=True)
class Port:
    """Where a work request starts or ends: NIC ``nic`` of GPU ``gpu`` on node ``node``."""

    node: int
    gpu: int
    nic: int = 0


@dataclass(eq=False, slots=True)
class WorkRequest:
    """One work request in a ``FlowModel``; its times are set by ``run()`` (virtual seconds)."""

    src: Port
    dst: Port
    nbytes: int
    ready_s: float
    posted_s: float = math.nan
    """When its NIC had posted it (its bytes start to flow)."""
    sent_s: float = math.nan
    """When its last byte left."""
    done_s: float = math.nan
    """When its last byte had landed at the target (``sent_s`` + latency)."""
    remaining: float = field(default=0.0, repr=False)
    rate: float = field(default=0.0, repr=False)
    resources: tuple[tuple[str, int, int, int], ...] = field(default=(), repr=False)


class FlowModel:
    """Work requests on a cluster, timed in virtual seconds (see the module docstring)."""

    def __init__(self, spec: ClusterSpec, nodes: int) -> None:
        if nodes < 1:
            raise ConfigError(f"nodes must be at least 1, got {nodes}")
        self.spec, self.nodes = spec, nodes
        self._wrs: list[WorkRequest] = []

    def _check(self, port: Port) -> None:
        s = self.spec
        if not (
            0 <= port.node < self.nodes and 0 <= port.gpu < s.gpus_per_node and 0 <= port.nic < s.nics_per_gpu
        ):
            shape = f"{self.nodes} nodes x {s.gpus_per_node} GPUs x {s.nics_per_gpu} NICs"
            raise ConfigError(f"{port} is not in the cluster ({shape})")

    def write(self, src: Port, dst: Port, nbytes: int, at_s: float = 0.0) -> WorkRequest:
        """Add a work request of ``nbytes`` from ``src`` to ``dst``, ready at ``at_s``. Inside a
        node (same ``node``, another GPU) it goes over NVLink (the ports' ``nic`` is ignored)."""
        self._check(src)
        self._check(dst)
        if nbytes < 0:
            raise ConfigError(f"nbytes must be non-negative, got {nbytes}")
        if not (math.isfinite(at_s) and at_s >= 0):
            raise ConfigError(f"at_s must be a non-negative time, got {at_s}")
        if src.node == dst.node and src.gpu == dst.gpu:
            raise ConfigError(f"{src} and {dst} are the same GPU: nothing goes over the network")
        if src.node == dst.node:
            res = (("nvl-tx", src.node, src.gpu, 0), ("nvl-rx", dst.node, dst.gpu, 0))
        else:
            res = (("tx", src.node, src.gpu, src.nic), ("rx", dst.node, dst.gpu, dst.nic))
        wr = WorkRequest(src, dst, nbytes, at_s, remaining=float(nbytes), resources=res)
        self._wrs.append(wr)
        return wr

    def _capacity(self, resource: tuple[str, int, int, int]) -> float:
        gbps = self.spec.nvlink_gbps if resource[0].startswith("nvl") else self.spec.nic_gbps
        return gbps * 1e9 / 8

    def _latency(self, wr: WorkRequest) -> float:
        return self.spec.nvlink_latency_s if wr.src.node == wr.dst.node else self.spec.nic_latency_s

    @staticmethod
    def max_min_rates(
        flows: Sequence[Iterable[tuple[str, int, int, int]]], capacity: dict[tuple[str, int, int, int], float]
    ) -> list[float]:
        """The max-min fair rates (progressive filling) of ``flows``, each a set of resources it
        uses, over ``capacity`` per resource (bytes/s)."""
        uses = [tuple(f) for f in flows]
        rates = [0.0] * len(uses)
        left = dict(capacity)
        unfrozen = set(range(len(uses)))
        while unfrozen:
            count: dict[tuple[str, int, int, int], int] = {}
            for i in unfrozen:
                for r in uses[i]:
                    count[r] = count.get(r, 0) + 1
            bottleneck = min(count, key=lambda r: (left[r] / count[r], r))
            share = max(left[bottleneck] / count[bottleneck], 0.0)
            for i in [i for i in unfrozen if bottleneck in uses[i]]:
                rates[i] = share
                unfrozen.discard(i)
                for r in uses[i]:
                    left[r] -= share
        return rates

    def run(self) -> float:
        """Time every work request added; returns when the last one is done (0 if none)."""
        pending = sorted(self._wrs, key=lambda w: w.ready_s)
        # posting: per source NIC (or NVLink port), one work request at a time, in ready order
        nic_free: dict[tuple[str, int, int, int], float] = {}
        starts: list[tuple[float, int, WorkRequest]] = []
        for seq, wr in enumerate(pending):
            port = wr.resources[0]
            begin = max(wr.ready_s, nic_free.get(port, 0.0))
            wr.posted_s = begin + self.spec.per_wr_s
            nic_free[port] = wr.posted_s
            heapq.heappush(starts, (wr.posted_s, seq, wr))
        capacity: dict[tuple[str, int, int, int], float] = {}
        active: list[WorkRequest] = []
        now, last = 0.0, 0.0
        while starts or active:
            # the next event: a flow starting, or the first active flow to finish at its rate
            finish = min((now + w.remaining / w.rate for w in active if w.rate > 0), default=math.inf)
            start = starts[0][0] if starts else math.inf
            t = min(start, finish)
            for w in active:
                w.remaining = max(w.remaining - w.rate * (t - now), 0.0)
            now = t
            done = [w for w in active if w.remaining <= 1e-9 * max(w.nbytes, 1)]
            for w in done:
                w.sent_s = now
                w.done_s = now + self._latency(w)
                last = max(last, w.done_s)
                active.remove(w)
            while starts and starts[0][0] <= now:
                _, _, w = heapq.heappop(starts)
                if w.nbytes == 0:  # an imm only: nothing to share
                    w.sent_s = now
                    w.done_s = now + self._latency(w)
                    last = max(last, w.done_s)
                    continue
                for r in w.resources:
                    capacity.setdefault(r, self._capacity(r))
                active.append(w)
            rates = self.max_min_rates([w.resources for w in active], capacity)
            for w, rate in zip(active, rates, strict=True):
                w.rate = rate
        return last
