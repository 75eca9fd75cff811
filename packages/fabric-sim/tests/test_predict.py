"""Predictions at cluster scale (fabric_sim.predict): phantom regions, recorded work requests,
their timing on the cluster model, and the apps' real code at small scale (exact counts and
bytes; the timing checked against the links' lower bound)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fabric_core import ConfigError, ImmRequest
from fabric_sim import SimFabric
from fabric_sim.cluster import cluster_preset
from fabric_sim.fabric import PostedWr
from fabric_sim.predict import (
    kimi_k2_fleets,
    predict_kv,
    predict_moe,
    predict_peak,
    predict_rl,
    report,
    time_phase,
)

torch = pytest.importorskip("torch")

T = 30.0


def test_a_phantom_fabric_registers_meta_tensors_and_moves_no_bytes() -> None:
    fabric = SimFabric(1, phantom=True, record=True)
    a, b = fabric.open_engine(nics=2), fabric.open_engine(nics=2)
    try:
        big = 1 << 40  # a TiB each: only a size
        src = a.register(torch.empty(big, dtype=torch.uint8, device="meta"))
        dst = b.register(torch.empty(big, dtype=torch.uint8, device="meta"), writable=True)
        real = a.register(np.arange(64, dtype=np.uint8))
        counter = b.counter(7)
        fabric.record_tag = "phase-1"
        a.submit_write(src, big - 4096, 4096, dst.descriptor, 0, imm=7).wait(T)
        a.submit_write(real, 0, 64, dst.descriptor, big - 64, imm=7).wait(T)
        counter.wait(2, timeout=T)
        assert [(p.src, p.dst, p.nbytes, p.tag) for p in fabric.recorded or ()] == [
            (a.engine_id, b.engine_id, 4096, "phase-1"),
            (a.engine_id, b.engine_id, 64, "phase-1"),
        ]
        assert src.ptr >= 1 << 60 and dst.ptr >= 1 << 60  # never a real address
        with pytest.raises(ConfigError, match="exceed the region"):
            a.submit_write(src, 0, 16, dst.descriptor, big - 8)
    finally:
        a.close()
        b.close()


def test_only_a_phantom_fabric_takes_a_meta_tensor() -> None:
    fabric = SimFabric(2)
    e = fabric.open_engine(nics=1)
    try:
        with pytest.raises(ConfigError, match="meta tensor has no memory"):
            e.register(torch.empty(64, dtype=torch.uint8, device="meta"))
    finally:
        e.close()


def test_recording_is_off_by_default_and_lists_every_work_request_of_a_plan() -> None:
    assert SimFabric(3).recorded is None
    fabric = SimFabric(3, record=True)
    a, b = fabric.open_engine(nics=2), fabric.open_engine(nics=2)
    try:
        buf = np.zeros(1 << 16, dtype=np.uint8)
        src, dst = a.register(buf), b.register(np.zeros(1 << 16, dtype=np.uint8), writable=True)
        pages = np.arange(8)
        a.submit_paged_write(src, pages, 512, dst.descriptor, pages[::-1].copy(), 512, 512).wait(T)
        a.submit(ImmRequest(dst.descriptor, 5)).wait(T)
        rec = fabric.recorded or []
        assert len(rec) == 9 and sum(p.nbytes for p in rec) == 8 * 512
        assert {p.nic for p in rec} <= {0, 1}
    finally:
        a.close()
        b.close()


def test_time_phase_times_one_phase_and_counts_self_writes_as_local() -> None:
    spec = replace(cluster_preset("cx7-400g"), per_wr_s=0.0)
    n = 1 << 20
    recorded = [
        PostedWr(10, 11, 0, n, 0, "a"),  # rank 0 -> rank 8 (node 1)
        PostedWr(12, 11, 0, n, 0, "a"),  # rank 16 -> rank 8 (node 2)
        PostedWr(10, 10, 0, n, 0, "a"),  # rank 0 -> itself
        PostedWr(10, 11, 0, n, 0, "b"),  # another phase
    ]
    rank_of = {10: 0, 11: 8, 12: 16}
    ph = time_phase(recorded, rank_of, spec, 3, "a")
    rate = 400e9 / 8
    assert ph.work_requests == 2 and ph.bytes == 2 * n
    assert ph.makespan_s == pytest.approx(2 * n / rate + spec.nic_latency_s, abs=1e-12)
    assert ph.rank_done_s[8] == ph.makespan_s and ph.rank_done_s[0] == 0.0
    assert ph.mean_rank_s == ph.makespan_s
    assert ph.summary["local_work_requests"] == 1 and ph.summary["local_bytes"] == n


def test_peak_of_four_100g_efa_nics_is_one_400g_nic() -> None:
    efa = predict_peak("efa-p5", nbytes=256 << 20, writes=64)
    cx7 = predict_peak("cx7-400g", nbytes=256 << 20, writes=64)
    assert efa.extra["nics"] == 4 and cx7.extra["nics"] == 1
    # each NIC of the four carries a quarter
    busiest = efa.phases["write"].summary["links"]
    assert {link["bytes"] for link in busiest} == {64 << 20}
    for p in (efa, cx7):
        assert 0.99 * 400 < p.extra["gbps"] <= 400.0
    assert "aggregate" in report(efa)


def test_moe_runs_the_real_alltoall_and_times_every_write() -> None:
    spec = cluster_preset("cx7-400g")
    p = predict_moe(spec, 16, tokens=16, hidden=64, top_k=4, experts=32, seed=5, check=True)
    assert p.nodes == 2 and p.ranks == 16 and p.reference is None
    d, c = p.phases["dispatch"], p.phases["combine"]
    record = p.params["record_bytes"]
    # dispatch: one count record per ordered pair of ranks (16 x 15 over links), then whole
    # token records; combine: hidden rows (or an imm-only write) back to every origin
    assert d.summary["local_work_requests"] >= 16
    assert (d.bytes - 16 * 15 * 32) % record == 0
    assert c.bytes % (64 * 2) == 0
    for ph in (d, c):
        # no faster than its busiest link allows, and everything landed by the makespan
        bound = ph.summary["links"][0]["busy_s"]
        assert bound <= ph.makespan_s
        assert max(ph.rank_done_s) == pytest.approx(ph.makespan_s)
        assert ph.makespan_s < bound + 64 * 16 * spec.per_wr_s + 2 * spec.nic_latency_s + 1e-6
    text = report(p)
    assert "dispatch" in text and "combine" in text


def test_moe_without_nvlink_sends_inside_a_node_through_the_nics() -> None:
    kw = {"tokens": 8, "hidden": 64, "top_k": 2, "experts": 8, "seed": 1}
    nvl = predict_moe("cx7-400g", 8, **kw)
    nic = predict_moe("cx7-400g", 8, nvlink=False, **kw)
    assert nvl.nodes == nic.nodes == 1
    assert all(link["link"].startswith("nvl") for link in nvl.phases["dispatch"].summary["links"])
    assert all(not link["link"].startswith("nvl") for link in nic.phases["dispatch"].summary["links"])
    assert nic.phases["dispatch"].makespan_s > nvl.phases["dispatch"].makespan_s


def test_kimi_k2_fleets_hold_a_trillion_parameters() -> None:
    source, destination = kimi_k2_fleets()
    params = sum(p.numel for p in source.params)
    assert 1.02e12 < params < 1.04e12
    assert source.nbytes == 2 * params  # bf16
    fp8 = sum(p.numel for p in destination.params if p.dtype == "float8_e4m3fn")
    assert destination.nbytes == fp8 + 2 * (params - fp8)  # the matrices in fp8, the rest bf16
    assert fp8 / params > 0.99
    # every replica of 16 ranks holds one copy: 8 copies over the 128 inference ranks
    per_rank = [destination.layout(r).nbytes for r in range(16)]
    assert sum(per_rank) >= destination.nbytes
    with pytest.raises(ConfigError, match="layers"):
        kimi_k2_fleets(layers=0)
    with pytest.raises(ConfigError, match="multiple"):
        kimi_k2_fleets(infer_gpus=100)


def test_rl_runs_the_real_sender_and_receiver_over_phantom_buffers() -> None:
    p = predict_rl("cx7-400g", train_gpus=16, infer_gpus=8, replica_gpus=8, layers=2, staging_bytes=64 << 20)
    step = p.phases["step"]
    assert p.nodes == 3 and p.ranks == 24 and p.reference is None
    # every byte of the plan is a timed write: exact
    assert step.bytes == p.extra["plan_bytes"]
    # the destinations are the bottleneck: no faster than the most loaded one's line rate
    assert p.extra["bound_s"] <= step.makespan_s < 1.5 * p.extra["bound_s"] + 1e-3
    out = json.loads(p.to_json())
    assert out["phases"]["step"]["work_requests"] == step.work_requests


def test_kv_runs_the_real_prefill_and_decoder_layer_by_layer() -> None:
    spec = cluster_preset("cx7-400g")
    rate = spec.gpu_gbps * 1e9 / 8
    # every layer already computed: the transfer alone, each pair on its own NICs
    p = predict_kv(spec, pairs=2, tokens=1024)
    kv = p.phases["kv"]
    per_request = p.extra["bytes_per_request"]
    assert per_request == 16 * 61 * 64 * 576 * 2  # 16 pages x 61 layers x 72 KiB
    assert kv.bytes == 2 * per_request and kv.work_requests == 2 * 16 * 61
    assert per_request / rate < kv.makespan_s < per_request / rate + 16 * 61 * spec.per_wr_s + 1e-5
    # layers computed 1 ms apart: each layer's 1.2 MB is through long before the next, so the
    # decoder has everything one layer's transfer after the last layer was computed
    slow = predict_kv(spec, pairs=2, tokens=1024, layer_s=1e-3)
    layer = per_request / 61 / rate
    assert (
        layer < slow.extra["tail_after_last_layer_s"] < layer + 16 * spec.per_wr_s + spec.nic_latency_s + 1e-6
    )
    assert "after the last layer" in report(slow)
    with pytest.raises(ConfigError, match="pairs"):
        predict_kv(spec, pairs=0)


def test_the_cli_prints_and_writes_a_prediction(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fabric_core.cli import main

    runner = CliRunner()
    out = runner.invoke(
        main,
        ["sim", "peak", "--cluster", "efa-p5", "--mib", "64", "--json", str(tmp_path / "p.json"),
         "--plot", str(tmp_path / "p.png")],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "aggregate" in out.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["scenario"] == "peak" and data["extra"]["nics"] == 4
    out = runner.invoke(
        main,
        ["sim", "moe", "--ep", "4", "--tokens", "8", "--hidden", "32", "--top-k", "2", "--experts", "8",
         "--plot", str(tmp_path / "moe.png")],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert (tmp_path / "moe.png").stat().st_size > 1000
    assert "dispatch" in out.output
    out = runner.invoke(main, ["sim", "kv", "--pairs", "1", "--tokens", "256", "--layer-ms", "0.5"])
    assert out.exit_code == 0, out.output
    assert "after the last layer" in out.output
    small = ["--train-gpus", "16", "--infer-gpus", "8", "--replica-gpus", "8", "--layers", "2"]
    out = runner.invoke(main, ["sim", "rl", "--staging-mib", "64", *small])
    assert out.exit_code == 0, out.output
    assert "step:" in out.output
    out = runner.invoke(main, ["sim", "rl", "--infer-gpus", "100", "--layers", "2"])
    assert out.exit_code != 0 and "multiple" in out.output
    out = runner.invoke(
        main, ["sim", "moe", "--nodes", "1", "--tokens", "4", "--hidden", "16", "--experts", "16"]
    )
    assert out.exit_code == 0, out.output
    assert "8 ranks on 1 nodes" in out.output
    out = runner.invoke(main, ["sim", "moe", "--ep", "3", "--experts", "8"])
    assert out.exit_code != 0 and "divisible" in out.output
