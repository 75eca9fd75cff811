"""Everything registrable: buffers, numpy arrays, torch tensors, raw pointers; and what is not."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from fabric_core import CapabilityError, ConfigError, RawMemory, detect_topology
from fabric_core.memory import memory_span
from fabric_sim import SimFabric


def test_spans_of_every_kind() -> None:
    arr = np.arange(16, dtype=np.float32)
    assert memory_span(arr).ptr == arr.ctypes.data and memory_span(arr).length == 64
    t = torch.arange(8, dtype=torch.int64)
    span = memory_span(t)
    assert (span.ptr, span.length, span.device.kind, span.writable) == (t.data_ptr(), 64, "cpu", True)
    ba = bytearray(b"abc")
    assert memory_span(ba).writable and memory_span(memoryview(ba)).length == 3
    assert not memory_span(b"abc").writable
    two_d = memoryview(np.zeros((4, 4), np.uint16))
    assert memory_span(two_d).length == 32
    raw = RawMemory(0x1000, 10, "cuda:3")
    assert memory_span(raw).device.index == 3


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        (torch.zeros(4, 4)[:, 1], "not contiguous"),
        (torch.zeros(0), "empty"),
        (np.zeros(0), "empty"),
        (RawMemory(0, 8), "non-null"),
        (RawMemory(8, 0), "positive"),
        (RawMemory((1 << 64) - 4, 8), "positive"),
        (RawMemory(8, 8, "tpu"), "unknown device"),
        (3.5, "cannot register float"),
    ],
)
def test_unregistrable(obj: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        memory_span(obj)


def test_write_into_torch_tensor_and_raw_pointer() -> None:
    fabric = SimFabric(3)
    a, b = fabric.open_engine(2), fabric.open_engine(2)
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros(1024, dtype=torch.int32)
    raw = (ctypes.c_uint8 * 4096)()
    mr_raw = b.register_ptr(ctypes.addressof(raw), 4096)
    smr, dmr = a.register(src), b.register(dst)
    t = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=1)
    t2 = a.submit_write(smr, 0, 4096, mr_raw.descriptor, 0, imm=2)
    b.counter(1).wait(t.imms_at_target, timeout=10)
    b.counter(2).wait(t2.imms_at_target, timeout=10)
    assert torch.equal(dst, src)
    assert bytes(raw) == src.numpy().tobytes()
    with pytest.raises(CapabilityError, match="host memory only"):
        b.register_ptr(0x10000, 64, "cuda:0")
    a.close()
    b.close()


def test_detect_topology_through_the_registry() -> None:
    (group,) = detect_topology(backend="sim", nics=3)
    assert [d.name for d in group.domains] == ["sim.0", "sim.1", "sim.2"]
