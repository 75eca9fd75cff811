"""RL weight updates across processes on fabric-efa: every trainer and inference rank is a
process with its own engine, meeting through a TCPStore. ``fabric_apps.weights.bench`` checks
every destination byte of every step, against the single-process torch reference reshard
(``content="reference"``: full tensors from the seed, cut with torch) or against the
deterministic pattern (the synthetic model); a difference raises ``RlBenchError``."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fabric_apps.weights import ExpertPlacement, FleetSpec, FsdpShard, ParamSpec, Replicated, TensorParallel
from fabric_apps.weights.bench import RlBenchSpec, run_rl_bench

SHM, TCP = "shm", "tcp;ofi_rxm"


def _fleets(src_world: int, dst_world: int) -> tuple[FleetSpec, FleetSpec]:
    """Every sharding on each side (replicated, FSDP with padding and HSDP replicas, TP rows
    and columns, expert placement with redundant experts) and casts float32 -> bfloat16 and
    bfloat16 -> float8."""
    e = 6
    dst_experts = ExpertPlacement(tuple(tuple((2 * r + k) % e for k in range(3)) for r in range(dst_world)))
    src = FleetSpec(
        src_world,
        (
            ParamSpec("embed", (24, 16), "float32", Replicated()),
            ParamSpec("qkv", (48, 32), "bfloat16", FsdpShard()),
            ParamSpec("o_proj", (32, 48), "bfloat16", TensorParallel(1)),
            ParamSpec("mlp_up", (40, 16), "bfloat16", FsdpShard()),
            ParamSpec("mlp_down", (17, 5), "float32", TensorParallel(0)),
            ParamSpec("experts", (e, 8, 4), "bfloat16", ExpertPlacement.contiguous(e, src_world)),
            ParamSpec("router", (6, 10), "float32", FsdpShard(replicas=2 if src_world % 2 == 0 else 1)),
        ),
    )
    dst = FleetSpec(
        dst_world,
        (
            ParamSpec("embed", (24, 16), "bfloat16", TensorParallel(0)),
            ParamSpec("qkv", (48, 32), "bfloat16", TensorParallel(0)),
            ParamSpec("o_proj", (32, 48), "float8_e4m3fn", TensorParallel(0)),
            ParamSpec("mlp_up", (40, 16), "bfloat16", TensorParallel(1)),
            ParamSpec("mlp_down", (17, 5), "float32", FsdpShard()),
            ParamSpec("experts", (e, 8, 4), "bfloat16", dst_experts),
            ParamSpec("router", (6, 10), "float32", Replicated()),
        ),
        align=64,
    )
    return src, dst


@pytest.mark.parametrize(
    ("trainers", "inference", "provider", "nics"),
    [(3, 2, SHM, 1), (2, 2, SHM, 2), (2, 3, TCP, 1)],
)
def test_updates_across_processes_equal_the_torch_reshard(
    trainers: int, inference: int, provider: str, nics: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_EFA_PROVIDER", provider)
    monkeypatch.setenv("FI_TCP_IFACE", "lo")
    src, dst = _fleets(trainers, inference)
    spec = RlBenchSpec(
        backend="efa",
        trainers=trainers,
        inference=inference,
        source=src,
        destination=dst,
        content="reference",
        steps=2,
        warmup=1,
        staging_bytes=4096,
        timeout=60.0,
        engine_options={"nics": nics},
    )
    result = run_rl_bench(spec)
    assert len(result.step_seconds) == 2 and all(t > 0 for t in result.step_seconds)
    assert result.plan.casts and result.plan.packed_bytes > 0  # casts and packed columns both ran
    assert sum(d["bytes"] for d in result.destinations) == result.plan.total_bytes
    assert result.staging_high_water <= 4096
    written = [sum(s["nic_bytes_written"]) for s in result.sources]  # three steps
    assert written == [3 * b for b in result.plan.balance().bytes_per_source]


def test_the_synthetic_model_across_processes_with_a_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_EFA_PROVIDER", SHM)
    spec = RlBenchSpec(
        backend="efa",
        trainers=4,
        inference=2,
        model_bytes=8 << 20,
        layers=2,
        experts=4,
        vocab=1024,
        cast="float8_e4m3fn",
        steps=2,
        warmup=1,
        staging_bytes=1 << 20,
        timeout=60.0,
        sender_nice=2,  # the trainers at nice 2 (the receivers, doing the copies, at ours)
    )
    result = run_rl_bench(spec)
    doc = result.to_json()
    assert doc["checked_steps"] == 3 and doc["plan"]["staged_bytes"] > 0
    assert doc["measured"]["nice_per_source"] == [2, 2, 2, 2]
    assert doc["staging"]["high_water"] <= 1 << 20
    assert doc["measured"]["bytes_per_destination"] == doc["plan"]["bytes_per_destination"]
