"""Every test the normative docs name exists, and every contract table row names one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fabric_core.testing import TransferEngineConformance

ROOT = Path(__file__).resolve().parents[1]
CONCEPTS = sorted((ROOT / "docs" / "concepts").glob("*.md"))
NAME = re.compile(r"`(test_[a-z0-9_]+)(?:\[[^\]]*\])?`")


def _known_tests() -> set[str]:
    names = {n for n in dir(TransferEngineConformance) if n.startswith("test_")}
    for path in [*(ROOT / "tests").glob("test_*.py"), *(ROOT / "packages").glob("*/tests/test_*.py")]:
        tree = ast.parse(path.read_text())
        names |= {
            n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
        }
    return names


def test_concept_pages_exist() -> None:
    assert {p.name for p in CONCEPTS} >= {
        "ordering.md",
        "counting.md",
        "errors.md",
        "routing.md",
        "lifecycle.md",
    }


def test_every_named_test_exists() -> None:
    known = _known_tests()
    named = {m.group(1) for p in CONCEPTS for m in NAME.finditer(p.read_text())}
    assert named, "the concept pages name no test"
    assert named <= known, f"docs name tests that do not exist: {sorted(named - known)}"


def test_every_contract_row_names_a_test() -> None:
    for page in CONCEPTS:
        for line in page.read_text().splitlines():
            if line.startswith("|") and not line.startswith(("| Statement", "|---", "| Request")):
                cells = [c.strip() for c in line.strip("|").split("|")]
                if page.name != "routing.md":
                    assert NAME.search(cells[-1]), f"{page.name}: row without a proving test: {line}"


def test_every_conformance_test_is_cited() -> None:
    cited = {m.group(1) for p in CONCEPTS for m in NAME.finditer(p.read_text())}
    suite = {n for n in dir(TransferEngineConformance) if n.startswith("test_")}
    assert suite <= cited, f"conformance tests no contract statement cites: {sorted(suite - cited)}"
