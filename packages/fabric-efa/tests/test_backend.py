"""The efa backend's probe, and what a user sees when libfabric or a provider is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fabric_core import registry
from fabric_core.errors import BackendUnavailable
from fabric_core.settings import load_settings
from fabric_efa import EfaBackend


def test_missing_libfabric_is_backend_unavailable_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what importing the compiled module does when libfabric.so.1 is absent: ImportError
    monkeypatch.setitem(sys.modules, "fabric_efa._efa", None)
    probe = EfaBackend.probe(load_settings(efa_provider="shm"))
    assert not probe.available and "apt-get install libfabric1" in probe.reason
    with pytest.raises(BackendUnavailable, match="apt-get install libfabric1"):
        registry.open_engine("efa", efa_provider="shm")


def test_missing_libfabric_in_a_fresh_process_leaves_the_simulator_usable() -> None:
    code = (
        "import sys; sys.modules['fabric_efa._efa'] = None\n"
        "from fabric_core import registry\n"
        "from fabric_core.errors import BackendUnavailable\n"
        "try:\n    registry.open_engine('efa')\n"
        "except BackendUnavailable as e:\n    print('unavailable:', e)\n"
        "registry.open_engine('sim').close(); print('sim ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "unavailable: fabric backend 'efa' is unavailable" in done.stdout and "sim ok" in done.stdout


def test_a_provider_that_is_not_here_is_unavailable_with_its_reason() -> None:
    probe = EfaBackend.probe(load_settings(efa_provider="no-such-provider"))
    assert not probe.available and "no-such-provider" in probe.reason
    with pytest.raises(BackendUnavailable, match="no-such-provider"):
        registry.open_engine("efa", efa_provider="no-such-provider")
