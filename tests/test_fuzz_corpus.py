"""The fuzzer's corpus and its past findings, replayed through the Python parsers (seconds).

``tests/fuzz/fuzz_descriptors.py`` (the ``fuzz`` nox session, atheris) grows the corpus;
every input here must give a round-tripping value or a ``ConfigError`` naming what is wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "fuzz"
sys.path.insert(0, str(HERE))
import fuzz_descriptors  # noqa: E402

INPUTS = sorted(p for d in ("corpus", "crashes") if (HERE / d).is_dir() for p in (HERE / d).iterdir())


def test_corpus_is_present_and_small() -> None:
    corpus = [p for p in INPUTS if p.parent.name == "corpus"]
    assert len(corpus) >= 20 and len(corpus) <= 1000
    assert all(p.stat().st_size <= 4096 for p in INPUTS)


@pytest.mark.parametrize("path", INPUTS, ids=[f"{p.parent.name}/{p.name}" for p in INPUTS])
def test_replay(path: Path) -> None:
    data = path.read_bytes()
    fuzz_descriptors.check(data)
    # and each input through every Python target, whatever its selector byte says
    for target in fuzz_descriptors.PYTHON_CHECKS:
        target(data[1:])


def test_seeds_are_in_the_corpus() -> None:
    for name, data in fuzz_descriptors.seeds().items():
        assert (HERE / "corpus" / f"seed-{name}").read_bytes() == data, name


def test_the_ragged_index_list_finding_is_a_config_error() -> None:
    """The fuzzer's first finding: a ragged page list made numpy raise a bare ValueError."""
    data = (HERE / "crashes" / "index-array-ragged-list").read_bytes()
    assert data[0] % fuzz_descriptors.PYTHON_TARGETS == 4
    fuzz_descriptors.check(data)
