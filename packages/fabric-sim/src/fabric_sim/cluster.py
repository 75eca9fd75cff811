"""Cluster-scale timing model for the simulator: max-min fair flows over NICs and NVLink.

A cluster is nodes x GPUs per node x NICs per GPU. Every NIC has a line rate per direction, a
one-way latency and a per-work-request cost (the host posting it and the NIC processing it,
one at a time per NIC); every GPU has an NVLink port with its own rate per direction and
latency for traffic inside its node. The parameters come from datasheets and public figures,
written once per preset in ``CLUSTERS``; they are never fitted to an experiment.

``FlowModel`` times work requests on such a cluster in virtual time. A work request from NIC
``(node, gpu, nic)`` to another node's NIC waits for its NIC to post it (``per_wr_s`` after the
previous one, serially), then joins its connection (the queue pair from its NIC to the
target's): a connection moves its work requests' bytes one after another, and the connections
with bytes to move share the links max-min fairly: each uses its source NIC's send direction
and its target NIC's receive direction, and the rates are the progressive-filling allocation
(every connection gets its fair share of its most contended link, and none can gain without
taking from one with less). A work request is done ``latency_s`` after its last byte left, and
its sender learns it ``latency_s`` later (which frees a slot of its submission window, if it
has one: a sender's staging slots). Inside a node, the same holds over the two GPUs' NVLink
ports, with NVLink's own per-write cost (none by default: GPU threads store directly).
Rates are recomputed whenever the set of busy connections changes, so the timeline is exact
for the model: small cases have closed-form answers (``tests``: one flow, flows sharing
a NIC, many small writes bounded by the per-request cost). The rates are computed with numpy
over all busy connections at once, and a work request that follows another on a busy
connection changes no rate, so hundreds of thousands of work requests over thousands of
connections take seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from fabric_core.errors import ConfigError

__all__ = [
    "CLUSTERS",
    "ClusterSpec",
    "FlowModel",
    "Port",
    "Resource",
    "WorkRequest",
    "cluster_preset",
    "water_fill",
]


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
    nvlink_per_wr_s: float = 0.0
    """Cost of one write over NVLink at its GPU (0: GPU threads store directly, no NIC work
    request; what the reference system's MoE kernels do inside a node)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_gpu"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("nic_gbps", "nvlink_gbps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive rate, got {value}")
        for name in ("nic_latency_s", "per_wr_s", "nvlink_latency_s", "nvlink_per_wr_s"):
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


Resource = tuple[str, int, int, int]
"""One direction of one link: ``("tx" | "rx" | "nvl-tx" | "nvl-rx", node, gpu, nic)``."""


@dataclass(eq=False, slots=True)
class WorkRequest:
    """One work request in a ``FlowModel``; its times are set by ``run()`` (virtual seconds)."""

    src: Port
    dst: Port
    nbytes: int
    ready_s: float
    window: Hashable | None = None
    """The submission window it counts against (``FlowModel.window``), if any."""
    tag: str = ""
    """A label for the breakdown (``FlowModel.summary`` reports each tag's span)."""
    submitted_s: float = math.nan
    """When it was handed to its NIC (``ready_s``, or later if its window was full)."""
    posted_s: float = math.nan
    """When its NIC had posted it: it joins its connection's queue."""
    sent_s: float = math.nan
    """When its last byte left."""
    done_s: float = math.nan
    """When its last byte had landed at the target (``sent_s`` + latency)."""
    acked_s: float = math.nan
    """When the sender learnt it (``done_s`` + latency): its window slot is free again."""
    resources: tuple[Resource, Resource] = field(default=(("", 0, 0, 0), ("", 0, 0, 0)), repr=False)
    conn: int = field(default=-1, repr=False)


def water_fill(uses: np.ndarray[Any, Any], capacity: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Max-min fair rates by progressive filling. ``uses[i]`` lists the resources (indices into
    ``capacity``) flow ``i`` crosses; every rate rises together until a resource is full, whose
    flows then keep that rate (all resources that fill at the same level at once)."""
    n = len(uses)
    rates = np.zeros(n)
    if n == 0:
        return rates
    left = np.asarray(capacity, dtype=float).copy()
    todo = np.ones(n, dtype=bool)
    size = len(left)
    while todo.any():
        count = np.bincount(uses[todo].ravel(), minlength=size)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(count > 0, left / np.maximum(count, 1), np.inf)
        level = float(share.min())
        tight = share <= level + abs(level) * 1e-12
        hit = todo & tight[uses].any(axis=1)
        rates[hit] = level
        todo &= ~hit
        left -= np.bincount(uses[hit].ravel(), minlength=size) * level
        np.maximum(left, 0.0, out=left)
    return rates


# queued event kinds, in the order they are taken at one instant (after the ends of work
# requests, which are kept per connection)
_ACK, _POST, _SUBMIT, _WAKE, _RECOMPUTE = range(5)


class FlowModel:
    """Work requests on a cluster, timed in virtual seconds (see the module docstring).

    Each (source port, target port) pair is one connection (a queue pair): its work requests
    move their bytes one after another, in posting order, and the connections in flight share
    the links max-min fairly. ``window(key, limit)`` bounds how many work requests of one
    window are submitted and not yet acknowledged (a sender's staging slots, say): the next
    one is submitted when one is acknowledged. ``nvlink=False`` sends writes inside a node
    through the NICs too (an engine without an NVLink path). ``quantum_s`` > 0 recomputes the rates at
    most once per quantum (a connection that starts in between waits for the next one, so a
    start is late by less than a quantum); 0 recomputes at every change (exact).
    """

    def __init__(self, spec: ClusterSpec, nodes: int, *, quantum_s: float = 0.0, nvlink: bool = True) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"nodes must be at least 1, got {nodes}")
        if not (math.isfinite(quantum_s) and quantum_s >= 0):
            raise ConfigError(f"quantum_s must be a non-negative time, got {quantum_s}")
        self.spec, self.nodes, self.quantum_s, self.nvlink = spec, nodes, quantum_s, nvlink
        self._wrs: list[WorkRequest] = []
        self._windows: dict[Hashable, int] = {}
        self._res: dict[Resource, int] = {}
        self.makespan = 0.0
        self.recomputes = 0

    def _check(self, port: Port) -> None:
        s = self.spec
        if not (
            0 <= port.node < self.nodes and 0 <= port.gpu < s.gpus_per_node and 0 <= port.nic < s.nics_per_gpu
        ):
            shape = f"{self.nodes} nodes x {s.gpus_per_node} GPUs x {s.nics_per_gpu} NICs"
            raise ConfigError(f"{port} is not in the cluster ({shape})")

    def window(self, key: Hashable, limit: int) -> None:
        """At most ``limit`` work requests of window ``key`` submitted and not acknowledged;
        they are submitted in the order they were added."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"a window's limit must be a positive int, got {limit!r}")
        self._windows[key] = limit

    def write(
        self,
        src: Port,
        dst: Port,
        nbytes: int,
        at_s: float = 0.0,
        *,
        window: Hashable | None = None,
        tag: str = "",
    ) -> WorkRequest:
        """Add a work request of ``nbytes`` from ``src`` to ``dst``, ready at ``at_s``. Inside a
        node (same ``node``, another GPU) it goes over NVLink (the ports' ``nic`` is ignored),
        or through the NICs (loopback through the switch) if the model has ``nvlink=False``."""
        self._check(src)
        self._check(dst)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ConfigError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if not (math.isfinite(at_s) and at_s >= 0):
            raise ConfigError(f"at_s must be a non-negative time, got {at_s}")
        if src.node == dst.node and src.gpu == dst.gpu:
            raise ConfigError(f"{src} and {dst} are the same GPU: nothing goes over the network")
        if window is not None and window not in self._windows:
            raise ConfigError(f"window {window!r} was not declared: call window(key, limit) first")
        res: tuple[Resource, Resource]
        if src.node == dst.node and self.nvlink:
            res = (("nvl-tx", src.node, src.gpu, 0), ("nvl-rx", dst.node, dst.gpu, 0))
        else:
            res = (("tx", src.node, src.gpu, src.nic), ("rx", dst.node, dst.gpu, dst.nic))
        for r in res:
            self._res.setdefault(r, len(self._res))
        wr = WorkRequest(src, dst, nbytes, at_s, window, tag, resources=res)
        self._wrs.append(wr)
        return wr

    def _capacity(self, resource: Resource) -> float:
        gbps = self.spec.nvlink_gbps if resource[0].startswith("nvl") else self.spec.nic_gbps
        return gbps * 1e9 / 8

    def _latency(self, wr: WorkRequest) -> float:
        return self.spec.nvlink_latency_s if wr.resources[0][0] == "nvl-tx" else self.spec.nic_latency_s

    @staticmethod
    def max_min_rates(flows: Sequence[Iterable[Resource]], capacity: dict[Resource, float]) -> list[float]:
        """The max-min fair rates (progressive filling) of ``flows``, each a set of resources it
        uses, over ``capacity`` per resource (bytes/s)."""
        index = {r: i for i, r in enumerate(capacity)}
        sets = [[index[r] for r in f] for f in flows]
        width = max((len(s) for s in sets), default=1)
        pad = len(index)  # a resource no flow fills: every flow crosses at least one real one
        uses = np.array([s + [pad] * (width - len(s)) for s in sets], dtype=np.int64).reshape(
            len(sets), width
        )
        cap = np.array([*capacity.values(), math.inf])
        return [float(r) for r in water_fill(uses, cap)]

    def run(self) -> float:
        """Time every work request added; returns when the last one is done (0 if none)."""
        wrs, spec = self._wrs, self.spec
        cap = np.array([self._capacity(r) for r in self._res])
        conns: dict[tuple[int, int], int] = {}
        for wr in wrs:
            key = (self._res[wr.resources[0]], self._res[wr.resources[1]])
            wr.conn = conns.setdefault(key, len(conns))
        uses = np.array(list(conns), dtype=np.int64).reshape(len(conns), 2)
        nconn = len(conns)
        queues: list[deque[WorkRequest]] = [deque() for _ in range(nconn)]
        head: list[WorkRequest | None] = [None] * nconn
        remaining = np.zeros(nconn)
        rate = np.zeros(nconn)
        since = np.zeros(nconn)
        finish = np.full(nconn, math.inf)
        busy = np.zeros(nconn, dtype=bool)
        nic_free: dict[Resource, float] = {}
        events: list[tuple[float, int, int, Any]] = []
        seq = itertools.count()
        # windows: their work requests in the order added, the next to submit, how many out
        order: dict[Hashable, list[WorkRequest]] = {k: [] for k in self._windows}
        nxt: dict[Hashable, int] = dict.fromkeys(self._windows, 0)
        out: dict[Hashable, int] = dict.fromkeys(self._windows, 0)
        for wr in wrs:
            if wr.window is None:
                heapq.heappush(events, (wr.ready_s, _SUBMIT, next(seq), wr))
            else:
                order[wr.window].append(wr)
        for win, todo in order.items():
            if todo:
                heapq.heappush(events, (todo[0].ready_s, _WAKE, next(seq), win))
        last = 0.0
        dirty = False
        next_recompute = 0.0
        recompute_queued = False
        self.recomputes = 0

        def submit(wr: WorkRequest, t: float) -> None:
            wr.submitted_s = t
            port = wr.resources[0]
            cost = spec.per_wr_s if port[0] == "tx" else spec.nvlink_per_wr_s
            wr.posted_s = max(t, nic_free.get(port, 0.0)) + cost
            nic_free[port] = wr.posted_s
            heapq.heappush(events, (wr.posted_s, _POST, next(seq), wr))

        def fill(key: Hashable, t: float) -> None:
            todo, limit = order[key], self._windows[key]
            while nxt[key] < len(todo) and out[key] < limit:
                wr = todo[nxt[key]]
                if wr.ready_s > t:
                    heapq.heappush(events, (wr.ready_s, _WAKE, next(seq), key))
                    return
                nxt[key] += 1
                out[key] += 1
                submit(wr, t)

        def complete(wr: WorkRequest, t: float) -> None:
            nonlocal last
            wr.sent_s = t
            wr.done_s = t + self._latency(wr)
            wr.acked_s = wr.done_s + self._latency(wr)
            last = max(last, wr.done_s)
            if wr.window is not None:
                heapq.heappush(events, (wr.acked_s, _ACK, next(seq), wr.window))

        def start_next(c: int, t: float) -> None:
            nonlocal dirty
            q = queues[c]
            while q:
                wr = q.popleft()
                if wr.nbytes == 0:  # an imm only: nothing to share, it follows the queue
                    complete(wr, t)
                    continue
                head[c] = wr
                remaining[c], since[c] = float(wr.nbytes), t
                if busy[c]:  # the same connection goes on at its rate
                    finish[c] = t + wr.nbytes / rate[c] if rate[c] > 0 else math.inf
                else:
                    busy[c] = True
                    rate[c], finish[c] = 0.0, math.inf
                    dirty = True
                return
            head[c] = None
            if busy[c]:
                busy[c] = False
                rate[c], finish[c] = 0.0, math.inf
                dirty = True

        def recompute(t: float) -> None:
            ids = np.flatnonzero(busy)
            if len(ids) == 0:
                return
            self.recomputes += 1
            remaining[ids] = np.maximum(remaining[ids] - rate[ids] * (t - since[ids]), 0.0)
            since[ids] = t
            rate[ids] = water_fill(uses[ids], cap)
            finish[ids] = t + remaining[ids] / rate[ids]

        # the next event: the earliest queued one, or the earliest end of a connection's
        # current work request at its rate (``finish``, kept per connection in numpy)
        while True:
            c_next = int(np.argmin(finish)) if nconn else 0
            t_fin = float(finish[c_next]) if nconn else math.inf
            t = min(events[0][0] if events else math.inf, t_fin)
            if t == math.inf:
                break
            while t_fin <= t:  # every connection whose work request ends now
                done = head[c_next]
                assert done is not None
                complete(done, t)
                head[c_next] = None
                start_next(c_next, t)
                c_next = int(np.argmin(finish))
                t_fin = float(finish[c_next])
            while events and events[0][0] == t:
                _, kind, _, item = heapq.heappop(events)
                if kind == _SUBMIT:
                    submit(item, t)
                elif kind == _WAKE:
                    fill(item, t)
                elif kind == _ACK:
                    out[item] -= 1
                    fill(item, t)
                elif kind == _POST:
                    c = item.conn
                    queues[c].append(item)
                    if head[c] is None:
                        start_next(c, t)
                else:  # _RECOMPUTE
                    recompute_queued = False
            if dirty:
                if self.quantum_s > 0 and t < next_recompute:
                    if not recompute_queued:
                        heapq.heappush(events, (next_recompute, _RECOMPUTE, next(seq), None))
                        recompute_queued = True
                else:
                    recompute(t)
                    dirty = False
                    next_recompute = t + self.quantum_s
        self.makespan = last
        return last

    def summary(self) -> dict[str, Any]:
        """Where the time went, after ``run()``: the busiest links (bytes over capacity, the
        least time they need), the busiest posting ports (work requests times the per-request
        cost), each tag's span, and the work request that finished last."""
        wrs = self._wrs
        if not wrs:
            return {
                "makespan_s": 0.0,
                "work_requests": 0,
                "bytes": 0,
                "links": [],
                "posting": [],
                "tags": {},
                "last": None,
            }
        carried: dict[Resource, int] = {}
        posted: dict[Resource, int] = {}
        tags: dict[str, list[float]] = {}
        for wr in wrs:
            for r in wr.resources:
                carried[r] = carried.get(r, 0) + wr.nbytes
            posted[wr.resources[0]] = posted.get(wr.resources[0], 0) + 1
            span = tags.setdefault(wr.tag, [math.inf, 0.0, 0, 0])
            span[0] = min(span[0], wr.ready_s)
            span[1] = max(span[1], wr.done_s)
            span[2] += 1
            span[3] += wr.nbytes
        makespan = self.makespan
        links = sorted(
            (
                {
                    "link": "/".join(map(str, r)),
                    "bytes": n,
                    "busy_s": n / self._capacity(r),
                    "utilisation": n / self._capacity(r) / makespan if makespan > 0 else 0.0,
                }
                for r, n in carried.items()
            ),
            key=lambda d: -float(cast(float, d["busy_s"])),
        )
        spec = self.spec
        posting = sorted(
            (
                {
                    "port": "/".join(map(str, r)),
                    "work_requests": n,
                    "busy_s": n * (spec.per_wr_s if r[0] == "tx" else spec.nvlink_per_wr_s),
                }
                for r, n in posted.items()
            ),
            key=lambda d: (-float(cast(float, d["busy_s"])), -int(cast(int, d["work_requests"]))),
        )
        final = max(wrs, key=lambda w: w.done_s)
        return {
            "makespan_s": makespan,
            "work_requests": len(wrs),
            "bytes": sum(w.nbytes for w in wrs),
            "recomputes": self.recomputes,
            "links": links,
            "posting": posting,
            "tags": {
                k: {"start_s": v[0], "end_s": v[1], "work_requests": int(v[2]), "bytes": int(v[3])}
                for k, v in tags.items()
            },
            "last": {
                "src": [final.src.node, final.src.gpu, final.src.nic],
                "dst": [final.dst.node, final.dst.gpu, final.dst.nic],
                "nbytes": final.nbytes,
                "tag": final.tag,
                "ready_s": final.ready_s,
                "posted_s": final.posted_s,
                "done_s": final.done_s,
            },
        }
