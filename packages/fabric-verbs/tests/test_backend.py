"""The verbs backend's probe, settings and what a user sees where it cannot run.

This machine has no RDMA device (and no Soft-RoCE in its kernel): opening the backend must
raise ``BackendUnavailable`` with the reason and the fix, never fail obscurely. The tests that
assert the no-device text skip themselves on a host that has a device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fabric_core import registry
from fabric_core.errors import BackendUnavailable, ConfigError
from fabric_core.settings import load_settings
from fabric_verbs import INSTALL_HINT, VerbsBackend, _verbs, load_verbs_settings

NO_DEVICE = (
    "no RDMA device found (ibv_get_device_list returned none); on a host without an RDMA NIC, "
    "Soft-RoCE: sudo rdma link add rxe0 type rxe netdev eth0"
)


@pytest.fixture
def no_device() -> None:
    if _verbs.list_devices():
        pytest.skip("this host has an RDMA device")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}


def test_the_entry_point_is_installed() -> None:
    assert registry.installed_backends()["verbs"] == "fabric_verbs:VerbsBackend"
    assert registry.load_backend("verbs") is VerbsBackend


@pytest.mark.usefixtures("no_device")
def test_without_a_device_the_probe_says_why_and_how_to_get_one() -> None:
    probe = VerbsBackend.probe()
    assert not probe.available
    assert probe.reason.startswith(NO_DEVICE)
    assert _verbs.NO_DEVICE == NO_DEVICE


@pytest.mark.usefixtures("no_device")
def test_without_a_device_opening_raises_backend_unavailable_with_the_reason() -> None:
    with pytest.raises(BackendUnavailable, match="rdma link add rxe0 type rxe netdev eth0") as info:
        registry.open_engine("verbs")
    assert info.value.backend == "verbs" and info.value.reason.startswith(NO_DEVICE)
    with pytest.raises(BackendUnavailable, match="ibv_get_device_list returned none"):
        VerbsBackend.open(load_settings(backend="verbs"))
    with pytest.raises(BackendUnavailable, match="ibv_get_device_list returned none"):
        VerbsBackend.detect_topology(load_settings(backend="verbs"))


@pytest.mark.usefixtures("no_device")
def test_the_engine_itself_refuses_without_a_device() -> None:
    from fabric_verbs.engine import VerbsEngine

    with pytest.raises(BackendUnavailable, match="ibv_get_device_list returned none"):
        VerbsEngine(load_settings(backend="verbs"))
    with pytest.raises(RuntimeError, match="ibv_get_device_list returned none"):
        _verbs.Engine(["mlx5_0"], 1, None, -1, 8, 4096, {})


def test_missing_libibverbs_is_backend_unavailable_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what importing the compiled module does when libibverbs.so.1 is absent: ImportError
    monkeypatch.setitem(sys.modules, "fabric_verbs._verbs", None)
    probe = VerbsBackend.probe()
    assert not probe.available and INSTALL_HINT in probe.reason
    assert "apt-get install libibverbs1 ibverbs-providers" in probe.reason
    with pytest.raises(BackendUnavailable, match="apt-get install libibverbs1"):
        registry.open_engine("verbs")


def test_missing_libibverbs_in_a_fresh_process_leaves_the_simulator_usable() -> None:
    code = (
        "import sys; sys.modules['fabric_verbs._verbs'] = None\n"
        "from fabric_core import registry\n"
        "from fabric_core.errors import BackendUnavailable\n"
        "try:\n    registry.open_engine('verbs')\n"
        "except BackendUnavailable as e:\n    print('unavailable:', e)\n"
        "registry.open_engine('sim').close(); print('sim ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_clean_env()
    )
    assert done.returncode == 0, done.stderr
    assert "unavailable: fabric backend 'verbs' is unavailable: the compiled module" in done.stdout
    assert "sim ok" in done.stdout


def test_settings_come_from_fabric_verbs_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_VERBS_DEVICE", "mlx5_0, mlx5_3")
    monkeypatch.setenv("FABRIC_VERBS_PORT", "2")
    monkeypatch.setenv("FABRIC_VERBS_GID_INDEX", "3")
    monkeypatch.setenv("FABRIC_VERBS_IMM_DEPTH", "4096")
    s = load_verbs_settings()
    assert s.devices == ("mlx5_0", "mlx5_3") and (s.port, s.gid_index, s.imm_depth) == (2, 3, 4096)
    assert s.options()["port"] == 2 and s.options()["chain_max"] == 16
    # fabric-core's own settings ignore them (and stay valid)
    assert load_settings().backend == "auto"


def test_defaults_choose_no_port_and_no_gid_index() -> None:
    s = load_verbs_settings()
    assert (s.port, s.gid_index) == (0, -1)  # first ACTIVE port, RoCE v2 GID: never port 1 / GID 0
    assert s.devices == ()


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("FABRIC_VERBS_PORT", "-1", "FABRIC_VERBS_PORT"),
        ("FABRIC_VERBS_GID_INDEX", "x", "FABRIC_VERBS_GID_INDEX"),
        ("FABRIC_VERBS_CHAIN", "65", "FABRIC_VERBS_CHAIN"),
        ("FABRIC_VERBS_IMM_DEPTH", "1", "FABRIC_VERBS_IMM_DEPTH"),
    ],
)
def test_a_bad_setting_is_a_config_error_and_an_unavailable_probe(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, reason: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=reason):
        load_verbs_settings()
    probe = VerbsBackend.probe()
    assert not probe.available and reason in probe.reason


def test_unknown_engine_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown verbs option 'gid'"):
        _verbs.Engine(["mlx5_0"], 1, None, -1, 8, 4096, {"gid": 1})
    with pytest.raises(ValueError, match="chain_max = 65 is out of range"):
        _verbs.Engine(["mlx5_0"], 1, None, -1, 8, 4096, {"chain_max": 65})


@pytest.mark.usefixtures("no_device")
def test_fabric_info_reports_verbs_unavailable_with_the_reason() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fabric_core.cli", "info", "--backend", "verbs"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "verbs: UNAVAILABLE (no RDMA device found" in done.stdout
    assert "distribution fabric-verbs" in done.stdout


def test_the_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(devices: list[str], port: int) -> str | None:
        raise OSError("sysfs went away")

    monkeypatch.setattr(_verbs, "probe", boom)
    probe = VerbsBackend.probe()
    assert not probe.available and "sysfs went away" in probe.reason
