"""Unit tests of fabric_core.registry: discovery, install hints, version checks, auto selection."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint
from typing import Any, ClassVar

import numpy as np
import pytest

import fabric_core
import fabric_core.registry as registry
from fabric_core import (
    API_VERSION,
    Backend,
    BackendNotInstalled,
    BackendUnavailable,
    BackendVersionMismatch,
    ConfigError,
    FabricError,
    FabricSettings,
    ProbeResult,
    TopologyGroup,
    installed_backends,
    load_backend,
    open_engine,
)

OPENED: list[str] = []


class _FakeBackend(Backend):
    name: ClassVar[str] = "fake"
    api_version: ClassVar[int] = API_VERSION
    distribution: ClassVar[str] = "fabric-fake-not-a-distribution"
    available: ClassVar[bool] = True

    @classmethod
    def probe(cls, settings: FabricSettings | None = None) -> ProbeResult:
        return ProbeResult(cls.available, "" if cls.available else f"{cls.name}: no device here")

    @classmethod
    def detect_topology(cls, settings: FabricSettings) -> list[TopologyGroup]:
        return []

    @classmethod
    def open(cls, settings: FabricSettings) -> Any:
        OPENED.append(cls.name)
        return (cls.name, settings)


class FutureBackend(_FakeBackend):
    name = "future"
    api_version = API_VERSION + 1


class PastBackend(_FakeBackend):
    name = "past"
    api_version = API_VERSION - 1


class UpEfa(_FakeBackend):
    name = "efa"


class DownEfa(_FakeBackend):
    name = "efa"
    available = False


class UpVerbs(_FakeBackend):
    name = "verbs"


class DownVerbs(_FakeBackend):
    name = "verbs"
    available = False


class NotABackend:
    api_version = API_VERSION


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("FABRIC_"):
            monkeypatch.delenv(name)
    OPENED.clear()


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, **backends: str) -> None:
    """Replace the installed ``fabric.backends`` entry points by ``name=ClassName`` of this module."""
    eps = [EntryPoint(name=n, value=f"{__name__}:{cls}", group=registry.GROUP) for n, cls in backends.items()]

    def entry_points(*, group: str) -> list[EntryPoint]:
        assert group == "fabric.backends"
        return list(eps)

    monkeypatch.setattr(registry, "entry_points", entry_points)


# --------------------------------------------------------------------------- the real install


def test_sim_is_installed() -> None:
    assert installed_backends()["sim"] == "fabric_sim:SimBackend"
    # the compiled backends are installed by their own sessions, after these tests
    assert installed_backends().get("verbs", "fabric_verbs:VerbsBackend") == "fabric_verbs:VerbsBackend"


def test_load_sim() -> None:
    import fabric_sim

    cls = load_backend("sim")
    assert cls is fabric_sim.SimBackend
    assert issubclass(cls, Backend)
    assert cls.name == "sim" and cls.api_version == API_VERSION
    assert cls.probe() == ProbeResult(True, "pure Python, always available")
    assert registry.backend_version(cls) == "0.1.0"


def check_engine(engine: fabric_core.TransferEngine, nics: int) -> None:
    """The engine moves bytes and counts the imm (a loopback write)."""
    assert engine.capabilities.backend == "sim"
    assert engine.num_nics == nics and len(engine.domains) == nics
    src = np.arange(20000, dtype=np.uint32).view(np.uint8)[:20000].copy()
    dst = np.zeros(20000, np.uint8)
    rs, rd = engine.register(src), engine.register(dst)
    t = engine.submit_write(rs, 0, 20000, rd.descriptor, 0, imm=0x5151)
    t.wait(10)
    engine.counter(0x5151).wait(t.imms_at_target, timeout=10)
    assert engine.counter(0x5151).value == 0
    assert bytes(dst) == bytes(src)


def test_open_engine_sim() -> None:
    engine = open_engine(backend="sim")
    try:
        assert not engine.closed
        check_engine(engine, 2)
    finally:
        engine.close()
    assert engine.closed


def test_open_engine_sim_with_config() -> None:
    with open_engine(backend="sim", nics=4, timeout_s=5) as engine:
        check_engine(engine, 4)
    assert engine.closed


def test_open_engine_bad_config() -> None:
    with pytest.raises(ConfigError, match="nics: "):
        open_engine(backend="sim", nics=0)
    with pytest.raises(ConfigError, match="colour: Extra inputs are not permitted"):
        open_engine(backend="sim", colour="blue")


def test_env_var_selects_sim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_BACKEND", "sim")
    monkeypatch.setenv("FABRIC_NICS", "3")
    engine = open_engine()
    try:
        check_engine(engine, 3)
    finally:
        engine.close()


def test_auto_without_rdma_backends() -> None:
    with pytest.raises(BackendUnavailable) as info:
        open_engine()
    exc = info.value
    assert not isinstance(exc, BackendVersionMismatch)
    assert exc.backend == "auto"
    msg = str(exc)
    assert msg.startswith("fabric backend 'auto' is unavailable: no RDMA backend can run here")
    assert "backend='sim'" in msg and "FABRIC_BACKEND=sim" in msg
    # efa is named whether it is missing or installed without a usable provider
    assert "fabric backend 'efa' is not installed" in msg or "efa: fi_getinfo found no RDM endpoint" in msg
    # verbs likewise: missing, or installed on a host with no RDMA device
    assert "fabric backend 'verbs' is not installed" in msg or "verbs: no RDMA device found" in msg
    with pytest.raises(BackendUnavailable, match="FABRIC_BACKEND=sim"):
        open_engine(backend="auto")


@pytest.mark.parametrize("name", ["efa", "verbs"])
def test_known_backend_not_installed(name: str) -> None:
    if name in installed_backends():
        pytest.skip(f"fabric-{name} is installed here")
    with pytest.raises(BackendNotInstalled) as info:
        load_backend(name)
    exc = info.value
    assert isinstance(exc, ImportError) and isinstance(exc, FabricError)
    assert exc.backend == name
    assert exc.hint == (
        f"pip install 'fabric-core[{name}]' (from a fabric clone: "
        f"pip install ./packages/fabric-core ./packages/fabric-{name})"
    )
    assert str(exc) == f"fabric backend {name!r} is not installed: {exc.hint}"
    with pytest.raises(ImportError):
        open_engine(backend=name)


@pytest.mark.parametrize("name", ["nope", "", "SIM", "fabric-sim"])
def test_unknown_backend(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_backend(name)
    msg = str(info.value)
    assert msg == f"unknown fabric backend {name!r}; known backends: efa, sim, verbs"
    with pytest.raises(ConfigError, match="unknown fabric backend"):
        open_engine(backend=name)


# --------------------------------------------------------------------------- fake entry points


@pytest.mark.parametrize(
    ("ep_name", "cls", "api"),
    [("future", "FutureBackend", API_VERSION + 1), ("past", "PastBackend", API_VERSION - 1)],
)
def test_version_mismatch(monkeypatch: pytest.MonkeyPatch, ep_name: str, cls: str, api: int) -> None:
    fake_entry_points(monkeypatch, **{ep_name: cls})
    assert installed_backends() == {ep_name: f"{__name__}:{cls}"}
    with pytest.raises(BackendVersionMismatch) as info:
        load_backend(ep_name)
    exc = info.value
    assert isinstance(exc, BackendUnavailable)
    assert (exc.backend, exc.backend_api, exc.core_api) == (ep_name, api, API_VERSION)
    assert f"fabric-core API version {api}" in str(exc)
    assert f"speaks version {API_VERSION}" in str(exc)
    with pytest.raises(BackendVersionMismatch):
        open_engine(backend=ep_name)
    assert OPENED == []


def test_not_a_backend_class(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, odd="NotABackend")
    with pytest.raises(BackendUnavailable) as info:
        load_backend("odd")
    assert info.value.reason == f"entry point {__name__}:NotABackend is not a fabric_core.Backend"


def test_unknown_name_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, future="FutureBackend")
    with pytest.raises(ConfigError, match=r"known backends: efa, future, sim, verbs$"):
        load_backend("nope")


def test_named_backend_that_probes_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, efa="DownEfa")
    with pytest.raises(BackendUnavailable) as info:
        open_engine(backend="efa")
    assert info.value.backend == "efa"
    assert info.value.reason == "efa: no device here"
    assert OPENED == []


@pytest.mark.parametrize(
    ("backends", "chosen"),
    [
        ({"efa": "UpEfa", "verbs": "UpVerbs"}, "efa"),
        ({"efa": "DownEfa", "verbs": "UpVerbs"}, "verbs"),
        ({"verbs": "UpVerbs"}, "verbs"),
        ({"efa": "UpEfa"}, "efa"),
    ],
)
def test_auto_order(monkeypatch: pytest.MonkeyPatch, backends: dict[str, str], chosen: str) -> None:
    fake_entry_points(monkeypatch, **backends)
    name, settings = open_engine(timeout_s=7)  # type: ignore[misc]
    assert name == chosen
    assert [chosen] == OPENED
    assert isinstance(settings, FabricSettings) and settings.timeout_s == 7.0 and settings.backend == "auto"


def test_auto_all_down_gives_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, efa="DownEfa", verbs="DownVerbs", sim="UpEfa")
    with pytest.raises(BackendUnavailable) as info:
        open_engine()
    msg = str(info.value)
    assert "efa: efa: no device here" in msg and "verbs: verbs: no device here" in msg
    assert "backend='sim'" in msg
    assert OPENED == []  # the simulator is never picked by 'auto'


def test_probe_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, future="FutureBackend", efa="DownEfa")
    assert registry.probe("efa") == ProbeResult(False, "efa: no device here")
    res = registry.probe("future")
    assert res.available is False and f"API version {API_VERSION + 1}" in res.reason
    res = registry.probe("verbs")
    assert res.available is False and "is not installed" in res.reason
    assert registry.backend_version(UpEfa) == "unknown"
