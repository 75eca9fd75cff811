"""The ``fabric`` command: info, bench and demo through click's CliRunner (and one subprocess)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from fabric_core import FabricSettings, registry
from fabric_core.cli import main
from fabric_core.cli._util import format_size, parse_size
from fabric_core.cli.bench import DEFAULT_SIZES

LOGGERS = ("fabric_core", "fabric_sim")


@pytest.fixture(autouse=True)
def _clean_env_and_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No FABRIC_* variable of the caller leaks in; the CLI's logging set-up is undone."""
    for name in list(os.environ):
        if name.upper().startswith("FABRIC_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, levels = list(root.handlers), {n: logging.getLogger(n).level for n in LOGGERS}
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def bench_json(tmp_path: Path, *args: str) -> tuple[Result, dict[str, Any]]:
    path = tmp_path / "out" / "bench.json"
    result = run("bench", "--json", str(path), *args)
    assert result.exit_code == 0, result.output
    return result, json.loads(path.read_text())


# --- info ---------------------------------------------------------------------------------


def test_help_lists_every_command() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("info", "bench", "demo", "--log-level"):
        assert command in result.output


def test_info_json_lists_the_sim_backend_and_every_setting() -> None:
    result = run("info", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    sim = {b["name"]: b for b in doc["backends"]}["sim"]
    assert sim["installed"] and sim["available"], sim
    assert sim["distribution"] == "fabric-sim" and sim["version"] not in (None, "unknown")
    assert sim["capabilities"]["backend"] == "sim" and sim["capabilities"]["num_nics"] == 2
    assert [d["provider"] for d in sim["topology"][0]["domains"]] == ["sim", "sim"]
    for name in registry.AUTO_ORDER:  # no NIC here: unavailable, with the reason
        entry = {b["name"]: b for b in doc["backends"]}[name]
        assert not entry["available"]
        if not entry["installed"]:
            assert "pip install" in entry["reason"]
        else:  # installed, but no provider or device can run here
            assert any(
                why in entry["reason"] for why in ("fi_getinfo found no RDM endpoint", "no RDMA device found")
            )

    settings = {s["name"]: s for s in doc["settings"]}
    assert set(settings) == set(FabricSettings.model_fields)
    for name, field in FabricSettings.model_fields.items():
        entry = settings[name]
        assert entry["env"] == f"FABRIC_{name.upper()}"
        assert entry["description"] == field.description and entry["description"]
        assert entry["env_value"] is None and entry["value"] == entry["default"]
    assert doc["settings_error"] is None


def test_info_shows_environment_values_and_applies_them() -> None:
    result = run("info", "--json", "--backend", "sim", env={"FABRIC_NICS": "3", "FABRIC_SIM_LINK": "efa-p5"})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    settings = {s["name"]: s for s in doc["settings"]}
    assert settings["nics"]["env_value"] == "3" and settings["nics"]["value"] == 3
    assert settings["nics"]["default"] is None
    (sim,) = doc["backends"]
    assert sim["capabilities"]["num_nics"] == 3 and sim["capabilities"]["virtual_clock"] is True
    assert [d["link_speed_gbps"] for d in sim["topology"][0]["domains"]] == [100.0] * 3


def test_info_text_names_backends_and_settings() -> None:
    result = run("info")
    assert result.exit_code == 0, result.output
    assert "sim: available" in result.output
    assert (
        "verbs: not installed" in result.output or "verbs: UNAVAILABLE (no RDMA device found" in result.output
    )
    for name in FabricSettings.model_fields:
        assert f"FABRIC_{name.upper()}=" in result.output
    env_only = run("info", "--env")
    assert "Backends" not in env_only.output and "FABRIC_SIM_SEED=0  (default)" in env_only.output


def test_info_with_an_invalid_environment_still_reports_and_exits_1() -> None:
    result = run("info", "--json", env={"FABRIC_NICS": "lots"})
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert "nics" in doc["settings_error"] and "integer" in doc["settings_error"]
    assert {s["name"]: s for s in doc["settings"]}["nics"]["env_value"] == "lots"


def test_info_unknown_backend_is_a_usage_error() -> None:
    result = run("info", "--backend", "warp")
    assert result.exit_code == 2
    assert "unknown fabric backend 'warp'" in result.output and "sim" in result.output


def test_python_m_fabric_core_cli_info() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fabric_core.cli", "info", "--json", "--backend", "sim"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("FABRIC_")},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (sim,) = json.loads(proc.stdout)["backends"]
    assert sim["name"] == "sim" and sim["available"]


def test_importing_the_cli_does_not_import_the_simulator() -> None:
    code = "import sys, fabric_core.cli; assert 'fabric_sim' not in sys.modules, 'fabric_sim imported'"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr


# --- bench --------------------------------------------------------------------------------


def test_bench_quick_default_sweep_writes_one_positive_result_per_size(tmp_path: Path) -> None:
    result, doc = bench_json(tmp_path, "--backend", "sim", "--quick")
    assert [r["size"] for r in doc["results"]] == list(DEFAULT_SIZES)
    assert DEFAULT_SIZES[0] == 8 and DEFAULT_SIZES[-1] == 64 << 20
    for r in doc["results"]:
        for key in (
            "iters",
            "ops",
            "latency_us_p50",
            "latency_us_p99",
            "bandwidth_gbps",
            "ops_per_s",
            "sim_latency_us_p50",
            "sim_bandwidth_gbps",
        ):
            assert r[key] > 0, (r["size"], key, r[key])
        assert r["latency_us_p99"] >= r["latency_us_p50"]
        # the virtual clock of cx7-400g: never faster than 2 NICs x 400 Gbit/s
        assert r["sim_bandwidth_gbps"] <= 800.0 + 1e-6
    assert doc["results"][-1]["sim_bandwidth_gbps"] > 700  # 64 MiB saturates both NICs
    assert doc["backend"] == "sim" and doc["nics"] == 2 and doc["link"] == "cx7-400g" and doc["seed"] == 0
    assert doc["submit_cost_us"] > 0 and doc["sim_throughput_wrs_per_s"] > 0
    paged = doc["paged"]
    assert paged["pages"] == 256 and paged["page_bytes"] == 4096 and paged["imms_per_write"] == 256
    assert paged["pages_per_s"] > 0 and paged["sim_pages_per_s"] > 0 and paged["submit_cost_us"] > 0
    assert doc["host"]["python"] == sys.version.split()[0] and doc["host"]["cpu_count"]
    assert datetime.datetime.fromisoformat(doc["started"]).tzinfo is not None
    # the table: a header and one row per size
    assert "lat p50 us" in result.output and "sim Gbit/s" in result.output
    assert "64 MiB" in result.output and "submit cost" in result.output


def test_bench_without_link_model_reports_wall_clock_only(tmp_path: Path) -> None:
    result, doc = bench_json(tmp_path, "--backend", "sim", "--quick", "--sizes", "64,4K", "--link", "none")
    assert doc["link"] is None
    assert [r["size"] for r in doc["results"]] == [64, 4096]
    for r in doc["results"]:
        assert r["bandwidth_gbps"] > 0 and not any(k.startswith("sim_") for k in r)
    assert "sim_pages_per_s" not in doc["paged"]
    assert "sim lat" not in result.output


def test_bench_pages_sets_the_pages_of_each_paged_write(tmp_path: Path) -> None:
    _, doc = bench_json(tmp_path, "--backend", "sim", "--quick", "--sizes", "4K", "--pages", "40")
    assert doc["paged"]["pages"] == 40 and doc["paged"]["imms_per_write"] == 40


def test_bench_reports_which_nics_carried_the_bytes(tmp_path: Path) -> None:
    result, doc = bench_json(tmp_path, "--backend", "sim", "--quick", "--sizes", "64K", "--nics", "3")
    per_nic = doc["per_nic"]
    assert [n["nic"] for n in per_nic] == [0, 1, 2]
    assert all(n["bytes_written"] > 0 and n["work_requests"] > 0 for n in per_nic), per_nic
    assert all(n["errors"] == 0 and n["retries"] == 0 for n in per_nic)
    line = next(x for x in result.output.splitlines() if x.startswith("writer per NIC: "))
    assert line.count("NIC ") == 3 and "%" in line


def test_bench_options_size_filter_iters_nics_seed(tmp_path: Path) -> None:
    _, doc = bench_json(
        tmp_path,
        "--backend", "sim", "--sizes", "8,1K,64K,1M", "--min-size", "1K", "--max-size", "64KiB",
        "--iters", "5", "--nics", "3", "--seed", "7", "--link", "efa-p5",
    )  # fmt: skip
    assert [r["size"] for r in doc["results"]] == [1024, 65536]
    assert all(r["iters"] == 5 and r["ops"] == 5 for r in doc["results"])
    assert doc["nics"] == 3 and doc["seed"] == 7 and doc["link"] == "efa-p5" and doc["iters"] == 5
    assert all(r["sim_bandwidth_gbps"] <= 300.0 + 1e-6 for r in doc["results"])  # 3 NICs x 100 Gbit/s


def test_bench_settings_come_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    env = {"FABRIC_BACKEND": "sim", "FABRIC_NICS": "1", "FABRIC_SIM_SEED": "5", "FABRIC_SIM_LINK": "efa-p5en"}
    result = run("bench", "--quick", "--sizes", "4K", "--json", str(path), env=env)
    assert result.exit_code == 0, result.output
    doc = json.loads(path.read_text())
    assert (doc["backend"], doc["nics"], doc["seed"], doc["link"]) == ("sim", 1, 5, "efa-p5en")


def test_bench_auto_falls_back_to_the_simulator_with_a_notice() -> None:
    if any(registry.probe(name).available for name in registry.AUTO_ORDER):
        pytest.skip("an RDMA backend can run here")
    result = run("bench", "--quick", "--sizes", "8")
    assert result.exit_code == 0, result.output
    assert "falling back to the simulator" in result.stderr
    assert "backend sim" in result.stdout


@pytest.mark.usefixtures("misplaced_writes")
def test_bench_fails_loudly_when_bytes_land_in_the_wrong_place() -> None:
    result = run("bench", "--backend", "sim", "--quick", "--sizes", "4K")
    assert result.exit_code == 1
    assert "data check failed for a 4 KiB write" in result.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["bench", "--sizes", "12Q"], 2, "'12Q' is not a size"),
        (["bench", "--sizes", ","], 2, "give at least one size"),
        (
            ["bench", "--min-size", "1M", "--max-size", "4K"],
            2,
            "--min-size (1 MiB) exceeds --max-size (4 KiB)",
        ),
        (["bench", "--sizes", "8", "--min-size", "1K"], 2, "no size left to measure"),
        (["bench", "--sizes", "2G"], 2, "above the largest size"),
        (["bench", "--nics", "0"], 2, "Invalid value for '--nics'"),
        (["bench", "--iters", "0"], 2, "Invalid value for '--iters'"),
        (["bench", "--backend", "warp"], 2, "unknown fabric backend 'warp'"),
        (["bench", "--backend", "sim", "--link", "warp"], 2, "unknown link preset 'warp'; presets: cx7-400g"),
        (["bench", "--backend", "efa"], 1, "fabric backend 'efa' is not installed: pip install"),
        (["--log-level", "loud", "info"], 2, "Invalid value for '--log-level'"),
    ],
)
def test_invalid_options_exit_non_zero_with_a_clear_message(args: list[str], code: int, message: str) -> None:
    if args[-1] == "efa" and registry.installed_backends().get("efa"):
        pytest.skip("fabric-efa is installed here")
    result = run(*args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_bench_invalid_environment_is_reported() -> None:
    result = run("bench", "--quick", env={"FABRIC_SIM_CHUNK_BYTES": "0"})
    assert result.exit_code == 1
    assert "invalid fabric settings: sim_chunk_bytes" in result.output


# --- demo, logging, helpers ---------------------------------------------------------------


def test_demo_narrates_the_contract() -> None:
    result = run("demo")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "t.imms_at_target == 2" in out and "landed intact" in out
    assert "counted at the target:" in out and "Counts arrived in another order" in out
    assert "Every page in place: yes" in out
    assert "ConfigError: destination: bytes" in out and "ConfigError: imm 4294967296 is out of range" in out
    assert "TransferTimeout: counter wait timed out" in out
    assert "== 7. Close" in out


@pytest.mark.parametrize(
    ("args", "env", "level"),
    [
        ([], {}, logging.WARNING),
        (["--log-level", "debug"], {}, logging.DEBUG),
        ([], {"FABRIC_LOG_LEVEL": "INFO"}, logging.INFO),
        (["--log-level", "ERROR"], {"FABRIC_LOG_LEVEL": "INFO"}, logging.ERROR),
    ],
)
def test_log_level_option_and_environment(args: list[str], env: dict[str, str], level: int) -> None:
    result = run(*args, "info", "--env", env=env)
    assert result.exit_code == 0, result.output
    assert {logging.getLogger(n).level for n in LOGGERS} == {level}


def test_size_parsing_and_formatting() -> None:
    sizes = {"8": 8, "4K": 4096, "4kib": 4096, "64MiB": 64 << 20, "1G": 1 << 30, " 2 M ": 2 << 20}
    assert {text: parse_size(text) for text in sizes} == sizes
    for bad in ("", "0", "-1", "4X", "1.5M", "K"):
        with pytest.raises(ValueError):
            parse_size(bad)
    shown = {
        8: "8 B",
        4096: "4 KiB",
        1536: "1.5 KiB",
        64 << 20: "64 MiB",
        2 << 30: "2 GiB",
        1 << 62: "4 EiB",
        3 << 40: "3 TiB",
    }
    assert {n: format_size(n) for n in shown} == shown
