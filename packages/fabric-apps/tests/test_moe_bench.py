"""``fabric bench moe`` and ``fabric_apps.moe.bench`` on the simulator: the run, its report,
its refusal of bad specs, and a wrong answer failing loudly. (The multi-process runs on
fabric-efa are in packages/fabric-efa/tests/test_moe_processes.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import fabric_apps.moe.bench as bench_module
from fabric_apps.moe import MoeConfig
from fabric_apps.moe.bench import MoeBenchError, MoeBenchSpec, PhaseTimes, run_moe_bench
from fabric_apps.moe.workload import dispatch_mismatch, output_mismatch, random_inputs
from fabric_core.cli import main
from fabric_core.errors import ConfigError

SMALL = {"hidden": 32, "top_k": 2, "experts": 8, "steps": 2, "warmup": 1, "timeout": 30.0}


def test_sim_run_times_both_implementations_and_checks_every_step() -> None:
    spec = MoeBenchSpec(backend="sim", ranks=2, shapes=(("a", 1), ("b", 12)), routing="masked", **SMALL)
    result = run_moe_bench(spec)
    assert result.checked_steps == 3 and result.baseline_note is None
    for shape in ("a", "b"):
        assert set(result.times[shape]) == {"fabric", "baseline"}
        for phases in result.times[shape].values():
            assert set(phases) == {"dispatch", "combine"}
            assert all(len(t.seconds) == 2 and 0 < t.p50_us <= t.p99_us for t in phases.values())
        ratio = result.ratio(shape, "combine")
        assert ratio is not None and ratio > 0
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["kind"] == "moe" and doc["spec"]["shapes"] == {"a": 1, "b": 12}
    assert doc["shapes"]["b"]["tokens_per_rank"] == 12
    assert (
        doc["shapes"]["b"]["fabric"]["dispatch"]["p50_us"] == result.times["b"]["fabric"]["dispatch"].p50_us
    )


def test_a_wrong_combine_fails_the_run_naming_rank_step_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's experts return one wrong row from the second step on: the bench must stop
    with the rows that differ, not report a time (and not wait out the other rank)."""
    real = bench_module.apply_experts
    calls = [0]

    def off_by_one_row(res: Any, fn: Any) -> torch.Tensor:
        out = real(res, fn)
        if res.num_rows:  # skewed: only rank 0 owns experts, so only its calls count
            calls[0] += 1
            if calls[0] > 1:  # from its second step on, row 0 (its own token 0) is wrong
                out = out.clone()
                out[0] = -out[0] - 1
        return out

    monkeypatch.setattr(bench_module, "apply_experts", off_by_one_row)
    spec = MoeBenchSpec(backend="sim", ranks=2, shapes=(("s", 8),), baseline=False, routing="skewed", **SMALL)
    with pytest.raises(
        MoeBenchError,
        match=r"rank 0: rank 0 s step 1 \(fabric\): combined rows: 1 of 8 rows differ \(first: row 0\)",
    ):
        run_moe_bench(spec)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"ranks": 0}, "ranks must be >= 1"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"routing": "zipf"}, "routing must be one of uniform, skewed, masked"),
        ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
        ({"shapes": ()}, "shapes must name at least one shape"),
        ({"timeout": 0.0}, "timeout must be > 0"),
        (
            {"ranks": 3, "experts": 8},
            "contiguous placement needs num_experts (8) divisible by world_size (3)",
        ),
        ({"top_k": 9, "experts": 8}, "top_k 9 exceeds num_experts 8"),
    ],
)
def test_a_bad_spec_is_refused_before_anything_runs(kw: dict[str, Any], message: str) -> None:
    args = {"backend": "sim", **SMALL, **kw}
    with pytest.raises(ConfigError) as info:
        MoeBenchSpec(**args)
    assert message in str(info.value)


def test_phase_times_take_the_slower_rank_of_each_step() -> None:
    t = PhaseTimes.of([[1.0, 5.0, 3.0], [2.0, 4.0, 3.5]])
    assert t.seconds == [2.0, 5.0, 3.5]
    assert t.p50_us == 3.5e6 and t.p99_us == 5.0e6


def test_mismatch_helpers_name_the_difference() -> None:
    config = MoeConfig(2, 0, 8, 16, 2, 6)
    inputs = random_inputs(config, 3, [6, 6])
    x = inputs.xs[0]
    assert output_mismatch(x, x.clone()) is None
    y = x.clone()
    y[2, 5] = y[2, 5] + 1
    y[4, 0] = -y[4, 0] - 1
    assert output_mismatch(y, x) == "combined rows: 2 of 6 rows differ (first: row 2)"
    assert "torch.float32 (6, 16) against torch.bfloat16" in (output_mismatch(x.float(), x) or "")
    from fabric_apps.moe import reference_dispatch

    a, b = reference_dispatch(config, inputs.xs, inputs.idxs)
    assert dispatch_mismatch(a, a) is None
    assert (dispatch_mismatch(a, b) or "").startswith("experts (0, 1, 2, 3) != (4, 5, 6, 7)")


def test_random_inputs_kinds() -> None:
    config = MoeConfig(2, 0, 8, 4, 3, 5)
    uniform = random_inputs(config, 1, [5, 0])
    idx = uniform.idxs[0]
    assert idx.shape == (5, 3) and all(len(set(row.tolist())) == 3 for row in idx)
    assert uniform.xs[1].shape == (0, 4) and uniform.idxs[1].shape == (0, 3)
    assert torch.equal(random_inputs(config, 1, [5, 0]).idxs[0], idx)  # seeded
    skewed = random_inputs(config, 1, [4, 4], kind="skewed")
    assert all(torch.equal(i, torch.tensor([[0, 1, 2]] * 4)) for i in skewed.idxs)
    masked = random_inputs(config, 1, [5, 5], kind="masked")
    assert bool((masked.idxs[0][0] == -1).all())  # a token routed nowhere
    with pytest.raises(ConfigError, match="routing must be one of"):
        random_inputs(config, 1, [1, 1], kind="zipf")
    with pytest.raises(ConfigError, match="one token count per rank"):
        random_inputs(config, 1, [1])


# --- the command line ---------------------------------------------------------------------
def _run(*args: str) -> Any:
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def test_cli_moe_on_the_simulator_prints_the_table_and_writes_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r" / "moe.json", tmp_path / "r" / "moe.png"
    args = ["--backend", "sim", "--tokens", "6", "--hidden", "32", "--top-k", "2", "--experts", "8"]
    result = _run("moe", *args, "--steps", "2", "--warmup", "0", "--json", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert "backend sim, 2 ranks (threads of this process)" in result.output
    assert "every step checked bit for bit" in result.output
    assert "6 tokens: fabric / baseline at p50: dispatch" in result.output
    doc = json.loads(out.read_text())
    assert doc["spec"]["hidden"] == 32 and set(doc["shapes"]["6 tokens"]) >= {"fabric", "baseline"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_moe_without_baseline_reports_fabric_only(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    args = [
        "--backend",
        "sim",
        "--tokens",
        "3",
        "--hidden",
        "16",
        "--top-k",
        "1",
        "--experts",
        "4",
        "--ranks",
        "4",
    ]
    result = _run("moe", *args, "--steps", "1", "--warmup", "0", "--no-baseline", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "fabric / baseline" not in result.output
    doc = json.loads(out.read_text())
    assert set(doc["shapes"]["3 tokens"]) == {"fabric", "ratio_p50", "tokens_per_rank"}
    assert doc["shapes"]["3 tokens"]["ratio_p50"] == {"dispatch": None, "combine": None}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nics", "2", "moe"], "options before 'moe' belong to the point-to-point sweep (--nics)"),
        (["moe", "--shapes", "decode,warp"], "unknown shape 'warp'; shapes: decode, prefill"),
        (
            ["moe", "--backend", "sim", "--experts", "6", "--top-k", "2", "--ranks", "4"],
            "(6) divisible by world_size (4)",
        ),
        (["moe", "--backend", "warp"], "unknown fabric backend 'warp'"),
    ],
)
def test_cli_moe_refuses_bad_options_with_a_clear_message(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
