"""Fixtures shared by the test modules of fabric-core."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fabric_sim
from fabric_core import WriteRequest


@pytest.fixture
def misplaced_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken backend: every simulated single write lands one byte past where it was asked to."""
    original = fabric_sim.SimEngine.submit

    def off_by_one(self: fabric_sim.SimEngine, request: Any, **kw: Any) -> Any:
        if isinstance(request, WriteRequest):
            request = dataclasses.replace(request, dst_offset=request.dst_offset + 1)
        return original(self, request, **kw)

    monkeypatch.setattr(fabric_sim.SimEngine, "submit", off_by_one)


NATIVE = Path(__file__).resolve().parent.parent / "packages" / "fabric-core" / "tests" / "native"
INCLUDE = (
    Path(__file__).resolve().parent.parent / "packages" / "fabric-core" / "src" / "fabric_core" / "include"
)
SANITIZER_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1",
    "ASAN_OPTIONS": "detect_leaks=1",
    "UBSAN_OPTIONS": "halt_on_error=1",
}


@pytest.fixture
def native_program(
    tmp_path: Path,
) -> Callable[[str, str | None], Callable[..., subprocess.CompletedProcess[str]]]:
    """Builds ``packages/fabric-core/tests/native/<name>.cpp`` against the engine core's headers
    (under ``-fsanitize=<sanitizer>`` if one is named) and returns a runner: it runs the
    program with the sanitizers set to stop at the first report, within ``timeout`` seconds,
    and returns what it printed (a non-zero exit is left to the test). Skips without g++."""

    def build(name: str, sanitizer: str | None = None) -> Callable[..., subprocess.CompletedProcess[str]]:
        cxx = shutil.which("g++")
        if cxx is None:
            pytest.skip("no g++ here (./dev test installs it)")
        out = tmp_path / name
        flags = ["-std=c++17", "-O1", "-g", "-pthread", "-I", str(INCLUDE)]
        if sanitizer:
            flags.append(f"-fsanitize={sanitizer}")
        subprocess.run([cxx, *flags, str(NATIVE / f"{name}.cpp"), "-o", str(out)], check=True, timeout=300)

        def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(out), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env=SANITIZER_ENV,
            )

        return run

    return build
