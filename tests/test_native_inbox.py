"""The imm inbox through which the CUDA IPC domain delivers its imms (fabric/imm_inbox.hpp),
across real processes: ``packages/fabric-core/tests/native/inbox.cpp``.

Three forked senders push (imm, count) records while the target drains; one gives its lane
back, one exits without doing so, one is SIGKILLed mid-stream. Every count a sender published
is counted once, with the sender's address, and every lane is free afterwards. A full lane
refuses a push and writes nothing; a full inbox refuses a sender with its reason; both take
traffic again once drained. Built plain, under ThreadSanitizer, and under ASan + UBSan.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "packages" / "fabric-core" / "tests" / "native" / "inbox.cpp"
INCLUDE = ROOT / "packages" / "fabric-core" / "src" / "fabric_core" / "include"


@pytest.mark.parametrize("sanitizer", [None, "thread", "address,undefined"])
def test_the_inbox_counts_every_published_imm_once_across_processes(
    tmp_path: Path, sanitizer: str | None
) -> None:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here (./dev test installs it)")
    out = tmp_path / "inbox"
    flags = ["-std=c++17", "-O1", "-g", "-pthread", "-I", str(INCLUDE)]
    if sanitizer:
        flags.append(f"-fsanitize={sanitizer}")
    subprocess.run([cxx, *flags, str(TARGET), "-o", str(out)], check=True, timeout=300)
    env = {
        "TSAN_OPTIONS": "halt_on_error=1",
        "ASAN_OPTIONS": "detect_leaks=1",
        "UBSAN_OPTIONS": "halt_on_error=1",
    }
    done = subprocess.run([str(out)], capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "inbox: ok" in done.stdout
    for k in range(3):
        assert f"sender {k}: published" in done.stdout
