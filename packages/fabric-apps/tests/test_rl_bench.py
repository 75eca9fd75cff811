"""``fabric bench rl`` on the simulator: the synthetic model, both content checks, the
numbers the report rests on, and bad specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from weightsworld import mixed_fleets

from fabric_apps.weights import FsdpShard, TensorParallel
from fabric_apps.weights.bench import RlBenchResult, RlBenchSpec, plan_for, run_rl_bench, synthetic_model
from fabric_apps.weights.reference import Pattern
from fabric_core.cli.app import main
from fabric_core.errors import ConfigError


def test_the_synthetic_model_has_the_size_and_shardings_asked_for() -> None:
    src, dst = synthetic_model(256 << 20, 4, 2, layers=4, experts=4, cast="float8_e4m3fn")
    total = sum(p.nbytes for p in src.params)
    assert abs(total - (256 << 20)) / (256 << 20) < 0.1
    assert src.world_size == 4 and dst.world_size == 2
    assert isinstance(src["layers.0.attn.o_proj"].sharding, FsdpShard)
    o = dst["layers.0.attn.o_proj"]
    assert isinstance(o.sharding, TensorParallel) and o.sharding.dim == 1 and o.dtype == "float8_e4m3fn"
    assert dst["embed"].dtype == "bfloat16" and "layers.1.mlp.experts.w13" in dst
    assert "layers.0.mlp.experts.w13" not in dst  # even layers are dense


def test_a_run_on_the_simulator_lands_every_byte_of_every_step() -> None:
    spec = RlBenchSpec(
        backend="sim", trainers=3, inference=2, model_bytes=4 << 20, layers=2, experts=3, vocab=512,
        cast="float8_e4m3fn", steps=2, warmup=1, staging_bytes=256 << 10, timeout=60.0,
    )  # fmt: skip
    result = run_rl_bench(spec)
    assert result.plan == plan_for(spec, 2)  # the ranks' plan (2 simulated NICs) is the one --explain gives
    assert len(result.step_seconds) == 2 and result.median_s > 0
    assert result.bound_s is None and result.ratio is None  # no ceiling asked for
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["plan"]["staged_bytes"] > 0
    assert doc["measured"]["bytes_per_destination"] == doc["plan"]["bytes_per_destination"]
    per_source = [sum(x) for x in doc["measured"]["nic_bytes_written_per_source"]]
    assert per_source == [3 * b for b in doc["plan"]["bytes_per_source"]]  # three steps, warm-up included
    assert 0 < doc["staging"]["high_water"] <= 256 << 10
    # each timed step's timeline: the first trainer starts at 0, every trainer's writes are
    # complete and every fence passed by the step's end, which is the last fence
    assert len(doc["timeline_ms"]) == 2
    for step, tl in zip(result.step_seconds, doc["timeline_ms"], strict=True):
        assert min(tl["trainers_started"]) == 0.0 and len(tl["trainers_done"]) == 3
        assert all(d >= b for d, b in zip(tl["trainers_done"], tl["trainers_started"], strict=True))
        assert max(tl["inference_fenced"]) == pytest.approx(step * 1e3)


def test_the_reference_content_checks_against_the_torch_reshard() -> None:
    src, dst = mixed_fleets(3, 2)
    spec = RlBenchSpec(
        backend="sim", trainers=3, inference=2, source=src, destination=dst, content="reference",
        steps=1, warmup=0, staging_bytes=4096, timeout=60.0,
    )  # fmt: skip
    result = run_rl_bench(spec)
    assert result.plan.casts and len(result.step_seconds) == 1


def test_the_pattern_finds_a_wrong_byte() -> None:
    _src, dst = synthetic_model(1 << 20, 2, 2, layers=1, experts=2, vocab=64)
    pattern = Pattern(seed=3)
    layout = dst.layout(1)
    buf = layout.allocate()
    views = layout.views(buf)
    pattern.fill(views, dst, 1)
    assert pattern.mismatch(views, dst, 1) is None
    views["layers.0.attn.o_proj"].reshape(-1)[7] += 1
    problem = pattern.mismatch(views, dst, 1)
    assert problem is not None and "layers.0.attn.o_proj element 7" in problem
    # a piece shifted by one row reads as wrong too
    pattern.fill(views, dst, 1)
    qkv = views["layers.0.attn.qkv"]
    qkv[1:].copy_(qkv[:-1].clone())
    assert pattern.mismatch(views, dst, 1) is not None
    assert torch.isfinite(views["embed"].float()).all()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"trainers": 0}, "trainers"),
        ({"steps": 0}, "steps"),
        ({"content": "bytes"}, "content"),
        ({"cast": "int8"}, "cast"),
        ({"model_bytes": 10}, "model_bytes"),
        ({"timeout": 0.0}, "timeout"),
        ({"sender_nice": 20}, "sender_nice"),
        ({"sender_nice": -1}, "sender_nice"),
        ({"sender_nice": 5}, "threads"),  # the simulator's ranks are threads of this process
        ({"source": mixed_fleets(2, 2)[0]}, "both"),
        ({"trainers": 3, "source": mixed_fleets(2, 2)[0], "destination": mixed_fleets(2, 2)[1]}, "ranks"),
    ],
)
def test_bad_specs_are_config_errors(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RlBenchSpec(backend="sim", **kw)  # type: ignore[arg-type]


def test_the_command_explains_and_runs(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["bench", "rl", "--explain", "--model-gib", "0.01", "--trainers", "3"])
    assert out.exit_code == 0, out.output
    assert "3 source ranks -> 2 destination ranks" in out.output and "packed at the source" in out.output
    path = tmp_path / "rl.json"
    args = ["bench", "rl", "--backend", "sim", "--model-gib", "0.004", "--layers", "2", "--steps", "1"]
    out = runner.invoke(main, [*args, "--warmup", "0", "--json", str(path)])
    assert out.exit_code == 0, out.output
    assert "every step checked byte for byte" in out.output
    doc = json.loads(path.read_text())
    assert doc["kind"] == "rl" and len(doc["step_seconds"]) == 1


def test_the_bound_takes_the_best_ceiling_and_each_pair_count_is_reported() -> None:
    spec = RlBenchSpec(
        backend="sim", trainers=2, inference=2, model_bytes=1 << 20, layers=1, experts=2, vocab=64
    )
    plan = plan_for(spec)
    ceiling = {
        "provider": "shm",
        "runs": [
            {"1": {"262144": 4.0, "1048576": 5.0}, "2": {"262144": 3.0, "1048576": 2.5}},
            {"1": {"262144": 4.5, "1048576": 4.0}, "2": {"262144": 3.5, "1048576": 2.0}},
        ],
    }
    gb = plan.total_bytes / 1e9
    result = RlBenchResult(spec, plan, [gb / 2.0, gb / 2.5, gb / 1.0], [], [], ceiling, {}, 1.0)
    assert result.median_s == pytest.approx(gb / 2.0)
    assert result.ceiling_gbytes_per_s == 5.0  # the best run, pair count and size
    assert result.bound_s == pytest.approx(gb / 5.0)
    assert result.ratio == pytest.approx(2.5)
    assert result.ratio_by_pairs() == pytest.approx({"1": 2.5, "2": 1.75})
    # with runs of the update's own fan, the bound is theirs; the pairs stay reported
    fan = {**ceiling, "fan": "2:2", "fan_runs": [{"262144": 1.5, "1048576": 2.0}, {"262144": 2.5}]}
    result = RlBenchResult(spec, plan, [gb / 2.0], [], [], fan, {}, 1.0)
    assert result.ceiling_gbytes_per_s == 2.5 and result.pairs_gbytes_per_s == 5.0
    assert result.ratio == pytest.approx(1.25)
    assert result.ratio_by_pairs() == pytest.approx({"1": 2.5, "2": 1.75})
    assert result.to_json()["pairs_gbytes_per_s"] == 5.0
