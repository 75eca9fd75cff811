"""Predictions at cluster scale: the apps' real code on a recording simulator, its work
requests timed on a cluster model.

A prediction runs in two passes, as trace-driven network simulators do:

1. **Execution.** Every rank of the scenario gets a ``SimEngine`` on one ``SimFabric`` with
   ``record=True`` (and ``phantom=True`` where the buffers are too large to hold: meta
   tensors, a size and no bytes), and the real ``fabric_apps`` code runs its step: the plan,
   routing, page choice, imms and submissions are the app's own. The fabric records every
   work request posted (source and target rank, NIC, bytes), labelled by phase.
2. **Timing.** Each phase's work requests are timed on ``fabric_sim.cluster.FlowModel`` with
   the cluster preset's hardware facts: rank ``r`` is GPU ``r % gpus_per_node`` of node
   ``r // gpus_per_node``, NIC ``i`` of the engine is NIC ``i`` of that GPU, writes inside a
   node go over NVLink. A phase's work requests are ready at its start; where the app bounds
   what it has in flight (the weights sender's staging slots), a submission window holds the
   next one until one is acknowledged.

What the model leaves out is said by each scenario: GPU kernels (casts, quantisation, the
experts' compute, packing), host-side time between posts beyond the per-work-request cost,
and congestion inside the switch fabric (links are the only shared resources).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fabric_core.errors import ConfigError

from .cluster import ClusterSpec, FlowModel, Port, cluster_preset
from .fabric import PostedWr, SimFabric

__all__ = [
    "REFERENCE",
    "PhaseTiming",
    "Prediction",
    "kimi_k2_fleets",
    "predict_kv",
    "predict_moe",
    "predict_peak",
    "predict_rl",
    "time_phase",
]

_WHOLE = 1 << 50  # phantom writes move no bytes: no point cutting them into many chunks

REFERENCE: dict[str, dict[str, float]] = {
    # the reference system's published figures (anchor-pplx.md §5; seconds)
    "rl/kimi-k2/256->128": {"step_s": 1.3},
    "moe/cx7-400g/ep8": {"dispatch_s": 50.5e-6, "combine_s": 65.3e-6},
    "moe/cx7-400g/ep64": {"dispatch_s": 187.5e-6, "combine_s": 309.1e-6},
    "moe/efa-p5/ep8": {"dispatch_s": 49.7e-6, "combine_s": 64.2e-6},
    "moe/efa-p5/ep64": {"dispatch_s": 266.7e-6, "combine_s": 391.2e-6},
    "peak/cx7-400g": {"gbps": 400.0},
    "peak/efa-p5": {"gbps": 400.0},
}


@dataclass
class PhaseTiming:
    """One phase on the cluster model: when the last work request landed (``makespan_s``),
    when each rank had everything addressed to it (``rank_done_s``), and where the time went
    (``summary``: the busiest links, the work request that finished last)."""

    name: str
    makespan_s: float
    rank_done_s: list[float]
    work_requests: int
    bytes: int
    summary: dict[str, Any] = field(repr=False)

    @property
    def mean_rank_s(self) -> float:
        done = [t for t in self.rank_done_s if t > 0]
        return sum(done) / len(done) if done else 0.0


@dataclass
class Prediction:
    """A scenario's predicted times, its inputs and the reference figures it compares with."""

    scenario: str
    cluster: str
    nodes: int
    ranks: int
    params: dict[str, Any]
    phases: dict[str, PhaseTiming]
    reference: dict[str, float] | None
    leaves_out: list[str]
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name, phase in self.phases.items():
            out["phases"][name]["mean_rank_s"] = phase.mean_rank_s
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, default=str)


def _spec(cluster: str | ClusterSpec) -> ClusterSpec:
    return cluster if isinstance(cluster, ClusterSpec) else cluster_preset(cluster)


def _port(spec: ClusterSpec, rank: int, nic: int) -> Port:
    return Port(rank // spec.gpus_per_node, rank % spec.gpus_per_node, nic)


def time_phase(
    recorded: Sequence[PostedWr],
    rank_of: dict[int, int],
    spec: ClusterSpec,
    nodes: int,
    name: str,
    *,
    windows: dict[Hashable, int] | None = None,
    window_of: Callable[[PostedWr], Hashable | None] | None = None,
    quantum_s: float = 0.0,
    nvlink: bool = True,
    ready: dict[str, float] | None = None,
) -> PhaseTiming:
    """Time the work requests ``recorded`` under tag ``name`` (all ready at 0); ``rank_of``
    maps engine ids to ranks; ``window_of`` names each one's submission window (declared in
    ``windows`` with its limit) or None. ``ready`` instead takes every work request whose
    tag it names, ready at that tag's time (layers computed one after another, say). A
    rank's writes to itself are local copies: counted in the summary
    (``local_work_requests``, ``local_bytes``), not timed."""
    model = FlowModel(spec, nodes, quantum_s=quantum_s, nvlink=nvlink)
    for key, limit in (windows or {}).items():
        model.window(key, limit)
    wrs = []
    local = [0, 0]
    for p in recorded:
        if ready is None:
            if p.tag != name:
                continue
            at = 0.0
        elif p.tag in ready:
            at = ready[p.tag]
        else:
            continue
        src, dst = rank_of[p.src], rank_of[p.dst]
        if src == dst:  # a rank's write to itself is a copy in its own memory: no link
            local[0] += 1
            local[1] += p.nbytes
            continue
        win = window_of(p) if window_of is not None else None
        wr = model.write(
            _port(spec, src, p.nic), _port(spec, dst, p.nic), p.nbytes, at, window=win, tag=p.tag
        )
        wrs.append((dst, wr))
    model.run()
    ranks = max(rank_of.values()) + 1 if rank_of else 0
    done = [0.0] * ranks
    for dst, wr in wrs:
        done[dst] = max(done[dst], wr.done_s)
    summary = model.summary()
    summary["links"] = summary["links"][:8]
    summary["posting"] = summary["posting"][:8]
    summary["local_work_requests"], summary["local_bytes"] = local
    return PhaseTiming(name, model.makespan, done, len(wrs), sum(w.nbytes for _, w in wrs), summary)


def _nodes_for(spec: ClusterSpec, ranks: int) -> int:
    return -(-ranks // spec.gpus_per_node)


# --- MoE -----------------------------------------------------------------------------------------
def predict_moe(
    cluster: str | ClusterSpec,
    ep: int,
    *,
    tokens: int = 128,
    hidden: int = 7168,
    top_k: int = 8,
    experts: int = 256,
    seed: int = 0,
    check: bool = False,
    nvlink: bool = True,
    quantum_s: float = 0.25e-6,
) -> Prediction:
    """One decode step of ``MoeAllToAll`` (dispatch, then combine) at expert parallelism
    ``ep``: ``tokens`` per rank, each routed to ``top_k`` distinct experts of ``experts`` at
    random (seeded), hidden states in bf16. ``check=True`` also checks the combined output
    against the top-k weighted sum (identity experts). ``nvlink=False`` sends the writes
    inside a node through the NICs (fabric's engines today have no NVLink path).
    ``quantum_s``: the model's recompute quantum (a connection starts late by less than it)."""
    import torch

    from fabric_apps.moe import MoeAllToAll, MoeConfig

    spec = _spec(cluster)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 2:
        raise ConfigError(f"ep must be an int of at least 2, got {ep!r}")
    nodes = _nodes_for(spec, ep)
    t0 = time.monotonic()
    fabric = SimFabric(seed, record=True)
    engines = [fabric.open_engine(nics=spec.nics_per_gpu) for _ in range(ep)]
    layers: list[Any] = []
    try:
        rank_of = {e.engine_id: r for r, e in enumerate(engines)}
        for r, e in enumerate(engines):
            cfg = MoeConfig(ep, r, experts, hidden, top_k, tokens, dtype=torch.bfloat16)
            layers.append(MoeAllToAll(e, cfg, timeout=600.0))
        endpoints = [a.endpoint for a in layers]
        for a in layers:
            a.connect(endpoints)
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(ep)]
        idxs = [torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k] for _ in range(ep)]
        ws = [torch.rand(tokens, top_k, generator=g) for _ in range(ep)]
        fabric.record_tag = "dispatch"
        for a, x, i, w in zip(layers, xs, idxs, ws, strict=True):
            a.dispatch_send(x, i, w)
        results = [a.dispatch_recv() for a in layers]
        fabric.record_tag = "combine"
        for a, res in zip(layers, results, strict=True):
            out = a.expert_output_buffer(res.num_rows)
            out.copy_(res.tokens)  # identity experts
            a.combine_send(out)
        combined = [a.combine_recv() for a in layers]
        if check:
            for x, w, y in zip(xs, ws, combined, strict=True):
                want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
                if not torch.allclose(y.float(), want.float(), rtol=2e-2, atol=2e-2):
                    raise AssertionError("the combined output is not the top-k weighted sum")
        recorded = list(fabric.recorded or ())
    finally:
        for a in layers:
            a.close()
        for e in engines:
            e.close()
    phases = {
        name: time_phase(recorded, rank_of, spec, nodes, name, nvlink=nvlink, quantum_s=quantum_s)
        for name in ("dispatch", "combine")
    }
    ref = REFERENCE.get(f"moe/{spec.name}/ep{ep}")
    record = layers[0].config.record_bytes
    return Prediction(
        "moe",
        spec.name,
        nodes,
        ep,
        {"ep": ep, "tokens": tokens, "hidden": hidden, "top_k": top_k, "experts": experts, "seed": seed,
         "dtype": "bfloat16", "record_bytes": record, "nvlink": nvlink, "quantum_s": quantum_s},
        phases,
        ref,
        [
            "GPU kernels: routing, packing tokens into records, the experts, the weighted sum",
            "the host proxy between the GPU and the NIC (pplx: a CPU thread polling GDRCopy flags)",
            "dispatch carries bf16 hidden states; the reference dispatches fp8 with scales "
            f"(about half the bytes: {hidden + hidden // 128 * 4} instead of {record} per token)",
        ],
        time.monotonic() - t0,
    )  # fmt: skip


# --- RL weight update ----------------------------------------------------------------------------
def kimi_k2_fleets(
    train_gpus: int = 256, infer_gpus: int = 128, replica_gpus: int = 16, *, layers: int = 61
) -> tuple[Any, Any]:
    """Source (training, bf16) and destination (inference, fp8) fleets with Kimi-K2's shapes
    (DeepSeek-V3 architecture: hidden 7168, 61 layers of which the first is dense, MLA
    attention, 384 routed experts of intermediate 2048 plus one shared expert, vocabulary
    163840; about 1.03 T parameters). Training: the experts and embeddings in flat FSDP
    shards over every rank, the dense matrices and vectors gathered (held by every rank, as
    after FSDP's ``full_tensor``, which the reference system runs before sending). Inference:
    ``infer_gpus / replica_gpus`` replicas, each with the routed experts spread over its
    ranks (expert parallel) and every other matrix split by rows (tensor parallel); the
    matrices in fp8, embeddings, norms and the router in bf16. ``layers`` < 61 keeps the
    first ``layers`` layers (the dense one included) for small runs."""
    from fabric_apps.weights import (
        DType,
        ExpertPlacement,
        FleetSpec,
        FsdpShard,
        ParamSpec,
        Replicated,
        Sharding,
        tp_row,
    )

    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= 61:
        raise ConfigError(f"layers must be in [1, 61], got {layers!r}")
    if infer_gpus % replica_gpus:
        raise ConfigError(f"infer_gpus ({infer_gpus}) must be a multiple of replica_gpus ({replica_gpus})")
    hidden, vocab, experts, inter, dense_inter = 7168, 163840, 384, 2048, 18432
    heads, q_rank, kv_rank, nope, rope, v = 64, 1536, 512, 128, 64, 128
    replicas = infer_gpus // replica_gpus
    # (name, shape, kind): kind "mat" (fp8, TP rows), "exp" (fp8, experts), "vec" (bf16, copies),
    # "emb" (bf16, TP rows)
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("embed", (vocab, hidden), "emb"),
        ("lm_head", (vocab, hidden), "emb"),
        ("final_norm", (hidden,), "vec"),
    ]
    for i in range(layers):
        p = f"l{i}."
        shapes += [
            (p + "attn.q_a", (q_rank, hidden), "mat"),
            (p + "attn.q_a_norm", (q_rank,), "vec"),
            (p + "attn.q_b", (heads * (nope + rope), q_rank), "mat"),
            (p + "attn.kv_a", (kv_rank + rope, hidden), "mat"),
            (p + "attn.kv_a_norm", (kv_rank,), "vec"),
            (p + "attn.kv_b", (heads * (nope + v), kv_rank), "mat"),
            (p + "attn.o", (hidden, heads * v), "mat"),
            (p + "in_norm", (hidden,), "vec"),
            (p + "post_norm", (hidden,), "vec"),
        ]
        if i == 0:
            shapes += [
                (p + "mlp.gate", (dense_inter, hidden), "mat"),
                (p + "mlp.up", (dense_inter, hidden), "mat"),
                (p + "mlp.down", (hidden, dense_inter), "mat"),
            ]
        else:
            shapes += [
                (p + "router", (experts, hidden), "vec"),
                (p + "experts.gate", (experts, inter, hidden), "exp"),
                (p + "experts.up", (experts, inter, hidden), "exp"),
                (p + "experts.down", (experts, hidden, inter), "exp"),
                (p + "shared.gate", (inter, hidden), "mat"),
                (p + "shared.up", (inter, hidden), "mat"),
                (p + "shared.down", (hidden, inter), "mat"),
            ]
    placement = ExpertPlacement.contiguous(experts, infer_gpus, replicas=replicas)
    dest: dict[str, tuple[DType, Sharding]] = {
        "mat": ("float8_e4m3fn", tp_row(replicas)),
        "emb": ("bfloat16", tp_row(replicas)),
        "exp": ("float8_e4m3fn", placement),
        "vec": ("bfloat16", Replicated()),
    }
    # training: the routed experts and the embeddings stay flat FSDP shards (each rank's piece
    # is one contiguous run: whole experts, whole rows); the dense matrices and the vectors are
    # gathered first (the reference system's full_tensor), so every rank holds them and the
    # plan spreads their writes over all ranks
    src: dict[str, Sharding] = {
        "mat": Replicated(),
        "emb": FsdpShard(),
        "exp": FsdpShard(),
        "vec": Replicated(),
    }
    source = FleetSpec(train_gpus, tuple(ParamSpec(n, s, "bfloat16", src[k]) for n, s, k in shapes))
    destination = FleetSpec(infer_gpus, tuple(ParamSpec(n, s, dest[k][0], dest[k][1]) for n, s, k in shapes))
    return source, destination


def predict_rl(
    cluster: str | ClusterSpec,
    *,
    train_gpus: int = 256,
    infer_gpus: int = 128,
    replica_gpus: int = 16,
    layers: int = 61,
    staging_bytes: int = 256 << 20,
    quantum_s: float = 10e-6,
    seed: int = 0,
) -> Prediction:
    """One RL weight update with Kimi-K2's shapes (``kimi_k2_fleets``): the real
    ``make_plan``, ``WeightsSender.send_step`` on every training rank and
    ``WeightsReceiver.wait_step`` on every inference rank, over phantom buffers. Training
    ranks take the first nodes, inference ranks the next ones. ``quantum_s``: the model's
    recompute quantum (each staged write starts late by less than it; measured on cx7-400g,
    1 µs and 10 µs predict the same step time within 0.1%)."""
    import torch

    from fabric_apps.weights import PlanOptions, WeightsReceiver, WeightsSender, make_plan

    spec = _spec(cluster)
    t0 = time.monotonic()
    source, destination = kimi_k2_fleets(train_gpus, infer_gpus, replica_gpus, layers=layers)
    options = PlanOptions(num_nics=spec.nics_per_gpu, staging_bytes=staging_bytes, max_write_bytes=1 << 30)
    plan = make_plan(source, destination, options)
    plan_s = time.monotonic() - t0
    train_nodes = _nodes_for(spec, train_gpus)
    nodes = train_nodes + _nodes_for(spec, infer_gpus)
    fabric = SimFabric(seed, phantom=True, record=True, chunk_bytes=_WHOLE)
    senders: list[Any] = []
    receivers: list[Any] = []
    engines = []
    try:
        rank_of: dict[int, int] = {}
        recv_engines = []
        for d in range(infer_gpus):
            e = fabric.open_engine(nics=spec.nics_per_gpu)
            engines.append(e)
            recv_engines.append(e)
            rank_of[e.engine_id] = train_nodes * spec.gpus_per_node + d
            buf = torch.empty(destination.layout(d).nbytes, dtype=torch.uint8, device="meta")
            receivers.append(WeightsReceiver(e, plan, d, buf, timeout=600.0))
        descriptors = [r.descriptor for r in receivers]
        for s in range(train_gpus):
            e = fabric.open_engine(nics=spec.nics_per_gpu)
            engines.append(e)
            rank_of[e.engine_id] = s
            buf = torch.empty(source.layout(s).nbytes, dtype=torch.uint8, device="meta")
            senders.append(WeightsSender(e, plan, s, buf, descriptors, timeout=600.0))
        fabric.record_tag = "step"
        exec_t0 = time.monotonic()
        for snd in senders:
            snd.send_step(0)
        for rcv in receivers:
            rcv.wait_step(0)
        exec_s = time.monotonic() - exec_t0
        recorded = list(fabric.recorded or ())
        # a staged write holds one of its sender's staging slots until it is acknowledged
        staged: dict[int, tuple[int, int, int]] = {}
        for snd in senders:
            pool = snd.staging
            if pool is not None:
                staged[snd.engine.engine_id] = (pool.region.ptr, pool.region.length, pool.slots)
    finally:
        for snd in senders:
            snd.close()
        for rcv in receivers:
            rcv.close()
        for e in engines:
            e.close()

    def window_of(p: PostedWr) -> Hashable | None:
        pool = staged.get(p.src)
        return p.src if pool is not None and pool[0] <= p.src_ptr < pool[0] + pool[1] else None

    windows: dict[Hashable, int] = {eid: pool[2] for eid, pool in staged.items()}
    t1 = time.monotonic()
    phase = time_phase(
        recorded, rank_of, spec, nodes, "step", windows=windows, window_of=window_of, quantum_s=quantum_s
    )
    time_s = time.monotonic() - t1
    per_dst = phase.rank_done_s[train_nodes * spec.gpus_per_node :]
    balance = plan.balance()
    most = max(balance.bytes_per_destination)
    line = spec.gpu_gbps * 1e9 / 8
    return Prediction(
        "rl",
        spec.name,
        nodes,
        train_gpus + infer_gpus,
        {
            "model": "kimi-k2-like",
            "layers": layers,
            "train_gpus": train_gpus,
            "infer_gpus": infer_gpus,
            "replica_gpus": replica_gpus,
            "staging_bytes": staging_bytes,
            "quantum_s": quantum_s,
            "source_bytes": source.nbytes,
            "destination_bytes": destination.nbytes,
        },
        {"step": phase},
        REFERENCE["rl/kimi-k2/256->128"] if (layers, train_gpus, infer_gpus) == (61, 256, 128) else None,
        [
            "GPU work before the write: FSDP all-gather (full_tensor), projection fusion, fp8 "
            "quantisation with block scales (the plan casts bf16 to fp8 element-wise; scales "
            "are not sent)",
            "the host copy of parameters offloaded to CPU, and the barrier between mesh groups",
        ],
        time.monotonic() - t0,
        {
            "plan_rows": len(plan),
            "plan_bytes": plan.total_bytes,
            "plan_s": plan_s,
            "execute_s": exec_s,
            "time_s": time_s,
            "destination_done_s": {"min": min(per_dst), "max": max(per_dst)},
            "most_bytes_to_one_destination": most,
            "bound_s": most / line,
            "source_imbalance": balance.source_imbalance,
            "destination_nic_imbalance": balance.destination_nic_imbalance,
        },
    )


# --- KvCache ---------------------------------------------------------------------------------------
def predict_kv(
    cluster: str | ClusterSpec,
    *,
    pairs: int = 8,
    requests: int = 1,
    tokens: int = 8192,
    layer_s: float = 0.0,
    block_size: int = 64,
    quantum_s: float = 0.25e-6,
    seed: int = 0,
) -> Prediction:
    """Disaggregated prefill -> decode of DeepSeek-V3's MLA cache (61 layers, 576 bf16 values
    per token, ``block_size``-token pages): ``pairs`` prefill ranks (the first node) each
    feeding one decode rank (the next), ``requests`` sequences of ``tokens`` tokens per pair.
    The real ``KvDecoder.receive`` / ``KvPrefiller.begin`` / ``write_layer`` run over phantom
    caches; layer ``l``'s writes are ready when its compute ends, ``(l + 1) * layer_s`` after
    the start (0: every layer already computed, the transfer alone)."""
    import torch

    from fabric_apps.kvcache import KvDecoder, KvPrefiller, deepseek_v3

    spec = _spec(cluster)
    for name, value in (("pairs", pairs), ("requests", requests), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if not (layer_s >= 0 and math.isfinite(layer_s)):
        raise ConfigError(f"layer_s must be a non-negative time, got {layer_s!r}")
    t0 = time.monotonic()
    pages = -(-tokens // block_size)
    layout = deepseek_v3(pages * requests + 1, block_size=block_size)
    side = _nodes_for(spec, pairs)
    nodes = 2 * side
    fabric = SimFabric(seed, phantom=True, record=True, chunk_bytes=_WHOLE)
    apps: list[Any] = []
    engines = []
    rank_of: dict[int, int] = {}

    def caches() -> list[Any]:
        shape = layout.accepted_shapes()[0]
        return [torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(layout.num_layers)]

    try:
        decoders, prefills = [], []
        for i in range(pairs):
            pe, de = fabric.open_engine(nics=spec.nics_per_gpu), fabric.open_engine(nics=spec.nics_per_gpu)
            engines += [pe, de]
            rank_of[pe.engine_id] = i
            rank_of[de.engine_id] = side * spec.gpus_per_node + i
            prefills.append(KvPrefiller(pe, layout, caches(), max_inflight=requests, timeout=600.0))
            decoders.append(KvDecoder(de, layout, caches(), timeout=600.0))
            apps += [prefills[-1], decoders[-1]]
        for d, p in zip(decoders, prefills, strict=True):
            d.connect(p.address, timeout=60.0)
        handles = [
            d.receive(p.address, f"r{i}.{k}", pages)
            for i, (d, p) in enumerate(zip(decoders, prefills, strict=True))
            for k in range(requests)
        ]
        src = torch.arange(pages)  # the prefill's block table: its first pages
        jobs = [[p.begin(p.next_request(60.0), src, timeout=60.0) for _ in range(requests)] for p in prefills]
        for layer in range(layout.num_layers):
            fabric.record_tag = f"layer{layer}"
            for per_prefill in jobs:
                for job in per_prefill:
                    job.write_layer(layer)
        for h in handles:
            h.wait(600.0)
            h.release()
        recorded = list(fabric.recorded or ())
    finally:
        for app in reversed(apps):
            app.close(timeout=5.0)
        for e in engines:
            e.close()
    ready = {f"layer{layer}": (layer + 1) * layer_s for layer in range(layout.num_layers)}
    phase = time_phase(recorded, rank_of, spec, nodes, "kv", ready=ready, quantum_s=quantum_s)
    computed = layout.num_layers * layer_s
    per_request = pages * layout.page_bytes * layout.num_layers
    return Prediction(
        "kv",
        spec.name,
        nodes,
        2 * pairs,
        {
            "layout": "deepseek-v3 (MLA, bf16)",
            "pairs": pairs,
            "requests": requests,
            "tokens": tokens,
            "pages": pages,
            "block_size": block_size,
            "layer_s": layer_s,
            "quantum_s": quantum_s,
        },
        {"kv": phase},
        None,
        [
            "the prefill's compute (layer_s stands for it), the control messages that ask for "
            "the request before it starts (one round trip), and the decoder's own work",
        ],
        time.monotonic() - t0,
        {
            "bytes_per_request": per_request,
            "tail_after_last_layer_s": phase.makespan_s - computed,
            "line_rate_s": per_request * requests / (spec.gpu_gbps * 1e9 / 8),
        },
    )


# --- peak bandwidth --------------------------------------------------------------------------------
def predict_peak(cluster: str | ClusterSpec, *, nbytes: int = 1 << 30, writes: int = 256) -> Prediction:
    """One GPU writing ``nbytes`` to a GPU of another node in ``writes`` equal writes, spread
    over every NIC of the GPU (the engine's ``Sharded`` routing): the aggregate rate."""
    import numpy as np

    from fabric_core.ops import Sharded

    spec = _spec(cluster)
    if nbytes < writes:
        raise ConfigError(f"nbytes ({nbytes}) must be at least writes ({writes})")
    t0 = time.monotonic()
    fabric = SimFabric(0, phantom=True, record=True, chunk_bytes=_WHOLE)
    import torch

    a = fabric.open_engine(nics=spec.nics_per_gpu)
    b = fabric.open_engine(nics=spec.nics_per_gpu)
    try:
        src = a.register(torch.empty(nbytes, dtype=torch.uint8, device="meta"))
        dst = b.register(torch.empty(nbytes, dtype=torch.uint8, device="meta"), writable=True)
        fabric.record_tag = "write"
        size = nbytes // writes
        pages = np.arange(writes)
        a.submit_paged_write(src, pages, size, dst.descriptor, pages, size, size, routing=Sharded()).wait(60)
        recorded = list(fabric.recorded or ())
    finally:
        a.close()
        b.close()
    rank_of = {a.engine_id: 0, b.engine_id: spec.gpus_per_node}
    phase = time_phase(recorded, rank_of, spec, 2, "write")
    gbps = phase.bytes * 8 / phase.makespan_s / 1e9
    return Prediction(
        "peak",
        spec.name,
        2,
        2,
        {"nbytes": nbytes, "writes": writes},
        {"write": phase},
        REFERENCE.get(f"peak/{spec.name}"),
        ["the PCIe path between GPU and NIC (GPUDirect RDMA at line rate is assumed)"],
        time.monotonic() - t0,
        {"gbps": gbps, "line_gbps": spec.gpu_gbps, "nics": spec.nics_per_gpu},
    )


def _fmt_us(s: float) -> str:
    return f"{s * 1e6:.1f} µs" if s < 1e-2 else f"{s:.3f} s"


def report(pred: Prediction) -> str:
    """A few lines for a terminal: each phase against the reference, and where time went."""
    lines = [f"{pred.scenario} on {pred.cluster}: {pred.ranks} ranks on {pred.nodes} nodes "
             f"(model run in {pred.wall_s:.1f} s wall)"]  # fmt: skip
    for name, ph in pred.phases.items():
        ref = (pred.reference or {}).get(f"{name}_s")
        vs = f"  reference {_fmt_us(ref)} (ratio {ph.makespan_s / ref:.2f})" if ref else ""
        lines.append(
            f"  {name}: slowest rank {_fmt_us(ph.makespan_s)}, mean rank {_fmt_us(ph.mean_rank_s)}; "
            f"{ph.work_requests} work requests, {ph.bytes / 1e9:.3f} GB{vs}"
        )
        last = ph.summary.get("last")
        if last:
            lines.append(
                f"    last to land: {last['nbytes']} B from node/gpu/nic {'/'.join(map(str, last['src']))} "
                f"to {'/'.join(map(str, last['dst']))}, posted at {_fmt_us(last['posted_s'])}"
            )
        post = ph.summary["posting"][:1]
        if post and post[0]["busy_s"] > 0:
            lines.append(
                f"    busiest poster: {post[0]['port']}: {post[0]['work_requests']} work requests, "
                f"{_fmt_us(post[0]['busy_s'])} of per-request cost"
            )
        busiest = ph.summary["links"][:3]
        for link in busiest:
            lines.append(
                f"    busiest: {link['link']}: {link['bytes'] / 1e6:.1f} MB, busy {_fmt_us(link['busy_s'])} "
                f"({link['utilisation']:.0%} of the phase)"
            )
    if pred.scenario == "kv":
        lines.append(
            f"  after the last layer was computed: {_fmt_us(pred.extra['tail_after_last_layer_s'])}; "
            f"the whole cache at line rate: {_fmt_us(pred.extra['line_rate_s'])}"
        )
    if pred.reference and "gbps" in pred.reference:
        lines.append(f"  aggregate {pred.extra['gbps']:.1f} Gbit/s, reference {pred.reference['gbps']:.0f}")
    lines.append("  left out: " + "; ".join(pred.leaves_out))
    return "\n".join(lines)
