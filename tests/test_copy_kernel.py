"""The copy-list kernel the CUDA IPC domain launches (fabric/cuda_copy_kernel.hpp) is the PTX
of fabric/cuda_copy_kernel.cu: the header records the source's SHA-256, and a source changed
without regenerating the header (packages/fabric-core/scripts/embed_copy_kernel.py) fails
here. The PTX must stay loadable by old drivers (ISA 7.0, sm_70) and declare the entry point
and parameters the domain passes (a segment pointer and a count)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

INCLUDE = (
    Path(__file__).resolve().parent.parent / "packages" / "fabric-core" / "src" / "fabric_core" / "include"
)


def test_the_embedded_ptx_is_the_sources() -> None:
    source = (INCLUDE / "fabric" / "cuda_copy_kernel.cu").read_text()
    header = (INCLUDE / "fabric" / "cuda_copy_kernel.hpp").read_text()
    recorded = re.search(r'kCopyKernelSourceSha256 = "([0-9a-f]{64})"', header)
    assert recorded is not None
    assert recorded.group(1) == hashlib.sha256(source.encode()).hexdigest(), (
        "cuda_copy_kernel.cu changed: run packages/fabric-core/scripts/embed_copy_kernel.py"
    )
    ptx = re.search(r'R"PTX\((.*)\)PTX"', header, re.S)
    assert ptx is not None
    text = ptx.group(1)
    assert re.search(r"^\.version 7\.0$", text, re.M)
    assert re.search(r"^\.target sm_70$", text, re.M)
    entry = re.search(r"\.visible \.entry fabric_copy_list\(\s*(.*?)\)", text, re.S)
    assert entry is not None
    params = re.findall(r"\.param \.(\w+)", entry.group(1))
    assert params == ["u64", "u32"]  # const FabricSeg* segs, unsigned n
    assert 'kCopyKernelName = "fabric_copy_list"' in header
