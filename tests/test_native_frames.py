"""The engine core's control-frame fuzz target, replayed (seconds).

``packages/fabric-core/tests/native/fuzz_frames.cpp`` feeds an engine frames from the network
(each input: records of raw frames from a process that may claim any sender) and checks after
each that the engine still serves an honest peer exactly: its fence is answered, its WriteImm
over both NICs lands byte for byte and is counted exactly twice. Built here as a plain replay
program (no libFuzzer, no sanitizer: ``nox -s sanitize`` replays the same under ASan and UBSan,
``nox -s fuzz`` grows the corpus under libFuzzer). Its setup also checks that a forged answer to
a fence not asked yet does not answer later fences.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "packages" / "fabric-core" / "tests" / "native" / "fuzz_frames.cpp"
INCLUDE = ROOT / "packages" / "fabric-core" / "src" / "fabric_core" / "include"
CORPUS = ROOT / "tests" / "fuzz" / "corpus-frames"
CRASHES = ROOT / "tests" / "fuzz" / "frame-crashes"


def _inputs() -> list[Path]:
    return sorted(p for d in (CORPUS, CRASHES) if d.is_dir() for p in d.iterdir() if p.is_file())


def test_the_frame_corpus_is_present_and_small() -> None:
    corpus = [p for p in _inputs() if p.parent == CORPUS]
    assert 20 <= len(corpus) <= 2000
    assert all(p.stat().st_size <= 4096 for p in _inputs())
    # seeded from a real exchange: one input of each frame kind the engine sends
    kinds = {int(m.group(1)) for p in corpus if (m := re.match(r"seed-\d+-type(\d+)$", p.name))}
    assert kinds == set(range(9)), kinds
    # and frames of another wire protocol (a ping, and the answer to one), and one of a build
    # from before the wire byte (Engine::got_foreign)
    names = {p.name for p in corpus}
    assert sum(n.endswith("-foreign") for n in names) == 2 and "seed-13-before-wire-byte" in names


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here (./dev test installs it)")
    out = tmp_path_factory.mktemp("native") / "fuzz_frames_replay"
    flags = ["-std=c++17", "-O1", "-DFABRIC_FUZZ_REPLAY", "-pthread", "-I", str(INCLUDE)]
    subprocess.run([cxx, *flags, str(TARGET), "-o", str(out)], check=True, timeout=300)
    return out


def test_no_control_frame_stops_the_engine_serving_honest_peers(replay: Path) -> None:
    inputs = _inputs()
    done = subprocess.run(
        [str(replay), *map(str, inputs)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{len(inputs)} inputs replayed" in done.stdout, done.stdout
