"""Unit tests of fabric_core.settings: defaults, FABRIC_* variables, overrides, errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
from pydantic import ValidationError

from fabric_core import ConfigError, FabricSettings, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No FABRIC_* variable of the calling shell may leak into these tests."""
    for name in list(os.environ):
        if name.upper().startswith("FABRIC_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    s = load_settings()
    assert isinstance(s, FabricSettings)
    assert s.model_dump() == {
        "backend": "auto",
        "nics": None,
        "max_msg_size": None,
        "timeout_s": 60.0,
        "liveness_interval_s": 1.0,
        "liveness_timeout_s": 10.0,
        "queue_depth": None,
        "queue_bytes": None,
        "recv_depth": 64,
        "max_send_size": 65536,
        "chaos_seed": None,
        "log_level": "WARNING",
        "efa_provider": "efa",
        "efa_nic_addrs": None,
        "efa_domains": None,
        "efa_topology": None,
        "efa_cuda_ipc": True,
        "efa_delivery_markers": True,
        "efa_eager_max": 4096,
        "efa_list_pages": 4,
        "efa_strict_mr": False,
        "worker_cpu": None,
        "sim_seed": 0,
        "sim_chunk_bytes": 65536,
        "sim_link": None,
    }


def test_every_field_has_a_description() -> None:
    for name, info in FabricSettings.model_fields.items():
        assert info.description, name


@pytest.mark.parametrize(
    ("var", "text", "field", "value"),
    [
        ("FABRIC_BACKEND", "sim", "backend", "sim"),
        ("FABRIC_NICS", "4", "nics", 4),
        ("FABRIC_MAX_MSG_SIZE", "65536", "max_msg_size", 65536),
        ("FABRIC_TIMEOUT_S", "2.5", "timeout_s", 2.5),
        ("FABRIC_RECV_DEPTH", "128", "recv_depth", 128),
        ("FABRIC_MAX_SEND_SIZE", "4096", "max_send_size", 4096),
        ("FABRIC_CHAOS_SEED", "17", "chaos_seed", 17),
        ("FABRIC_LOG_LEVEL", "DEBUG", "log_level", "DEBUG"),
        ("FABRIC_EFA_CUDA_IPC", "false", "efa_cuda_ipc", False),
        ("FABRIC_EFA_DELIVERY_MARKERS", "0", "efa_delivery_markers", False),
        ("FABRIC_EFA_STRICT_MR", "1", "efa_strict_mr", True),
        ("FABRIC_EFA_EAGER_MAX", "0", "efa_eager_max", 0),
        ("FABRIC_EFA_LIST_PAGES", "1", "efa_list_pages", 1),
        (
            "FABRIC_EFA_DOMAINS",
            "rdmap16s27-rdm,rdmap32s27-rdm",
            "efa_domains",
            "rdmap16s27-rdm,rdmap32s27-rdm",
        ),
        ("FABRIC_EFA_TOPOLOGY", "cuda:0=rdmap16s27-rdm", "efa_topology", "cuda:0=rdmap16s27-rdm"),
        ("FABRIC_EFA_PROVIDER", "tcp;ofi_rxm", "efa_provider", "tcp;ofi_rxm"),
        ("FABRIC_WORKER_CPU", "1", "worker_cpu", 1),
        ("FABRIC_SIM_SEED", "99", "sim_seed", 99),
        ("FABRIC_SIM_CHUNK_BYTES", "512", "sim_chunk_bytes", 512),
        ("FABRIC_SIM_LINK", "efa-p5", "sim_link", "efa-p5"),
    ],
)
def test_env_var_is_read(
    monkeypatch: pytest.MonkeyPatch, var: str, text: str, field: str, value: object
) -> None:
    monkeypatch.setenv(var, text)
    s = load_settings()
    assert getattr(s, field) == value
    assert type(getattr(s, field)) is type(value)
    # Every other field keeps its default.
    defaults = FabricSettings.model_fields
    for name, info in defaults.items():
        if name != field:
            assert getattr(s, name) == info.default, name


def test_keyword_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_NICS", "4")
    monkeypatch.setenv("FABRIC_BACKEND", "efa")
    monkeypatch.setenv("FABRIC_TIMEOUT_S", "3")
    s = load_settings(nics=2, backend="sim")
    assert (s.nics, s.backend, s.timeout_s) == (2, "sim", 3.0)


def test_keyword_overrides() -> None:
    s = load_settings(backend="sim", nics=8, max_msg_size=64, timeout_s=0.25, sim_link=None, chaos_seed=0)
    assert (s.backend, s.nics, s.max_msg_size, s.timeout_s, s.sim_link, s.chaos_seed) == (
        "sim",
        8,
        64,
        0.25,
        None,
        0,
    )


def test_frozen() -> None:
    s = load_settings()
    with pytest.raises(ValidationError, match="frozen"):
        s.nics = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("nics", 0, "greater than or equal to 1"),
        ("nics", 65, "less than or equal to 64"),
        ("nics", "x", "valid integer"),
        ("max_msg_size", 63, "greater than or equal to 64"),
        ("timeout_s", 0, "greater than 0"),
        ("timeout_s", -1.0, "greater than 0"),
        ("queue_depth", -1, "greater than or equal to 0"),
        ("queue_depth", (1 << 20) + 1, "less than or equal to 1048576"),
        ("queue_bytes", -1, "greater than or equal to 0"),
        ("queue_bytes", (1 << 40) + 1, "less than or equal to 1099511627776"),
        ("recv_depth", 0, "greater than or equal to 1"),
        ("recv_depth", (1 << 16) + 1, "less than or equal to 65536"),
        ("max_send_size", 63, "greater than or equal to 64"),
        ("max_send_size", (1 << 24) + 1, "less than or equal to 16777216"),
        ("efa_eager_max", -1, "greater than or equal to 0"),
        ("efa_eager_max", 16385, "less than or equal to 16384"),
        ("efa_list_pages", 0, "greater than or equal to 1"),
        ("efa_list_pages", 9, "less than or equal to 8"),
        ("log_level", "TRACE", "'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
        ("sim_chunk_bytes", 0, "greater than or equal to 1"),
        ("sim_seed", "seed", "valid integer"),
        ("backend", 3, "valid string"),
    ],
)
def test_bad_keyword_value(field: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**{field: value})
    msg = str(info.value)
    assert msg.startswith(f"invalid fabric settings: {field}: ")
    assert fragment in msg
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize(
    ("var", "text", "field"),
    [
        ("FABRIC_NICS", "abc", "nics"),
        ("FABRIC_NICS", "0", "nics"),
        ("FABRIC_TIMEOUT_S", "soon", "timeout_s"),
        ("FABRIC_TIMEOUT_S", "-2", "timeout_s"),
        ("FABRIC_LOG_LEVEL", "LOUD", "log_level"),
        ("FABRIC_MAX_MSG_SIZE", "1", "max_msg_size"),
        ("FABRIC_RECV_DEPTH", "1e9", "recv_depth"),
    ],
)
def test_bad_env_value(monkeypatch: pytest.MonkeyPatch, var: str, text: str, field: str) -> None:
    monkeypatch.setenv(var, text)
    with pytest.raises(ConfigError, match=f"^invalid fabric settings: {field}: "):
        load_settings()


def test_several_problems_are_all_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(nics=0, timeout_s=0)
    msg = str(info.value)
    assert "nics: " in msg and "timeout_s: " in msg and "; " in msg


@pytest.mark.parametrize("name", ["nic", "bogus", "FABRIC_NICS", "backend_name"])
def test_unknown_keyword(name: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid fabric settings: {name}: Extra inputs are not permitted"):
        load_settings(**{name: 1})


def test_unknown_env_var_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_NOT_A_SETTING", "1")
    assert load_settings() == load_settings()
    assert not hasattr(load_settings(), "not_a_setting")
