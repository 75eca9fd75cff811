"""CUDA memory through the contract, and GPU-side waits, on a real GPU.

Skipped without one (tests/gpu/conftest.py). The simulator moves CUDA bytes with device
copies; fabric-efa registers CUDA memory with FI_HMEM_CUDA where the provider has FI_HMEM
(shm: CUDA IPC between processes). Every check is of exact bytes and exact counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from fabric_core import (
    CapabilityError,
    ConfigError,
    PagedWriteRequest,
    RawMemory,
    TransferTimeout,
    WriteRequest,
    cuda,
    open_engine,
)
from fabric_core.models import Device
from fabric_sim import SimFabric

torch: Any = pytest.importorskip("torch")


def _rand(n: int, device: str = "cuda") -> Any:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)


def _efa_shm() -> Any:
    try:
        import fabric_efa  # noqa: F401
    except ImportError:
        pytest.skip("fabric-efa is not installed")
    e = open_engine("efa", efa_provider="shm")
    if not e.capabilities.cuda_memory:
        e.close()
        pytest.skip("this libfabric's shm provider has no FI_HMEM")
    return e


def test_the_driver_knows_a_tensor_and_its_device() -> None:
    t = _rand(1 << 20)
    info = cuda.pointer_device(t.data_ptr())
    assert info is not None and info.device == torch.cuda.current_device()
    assert info.base <= t.data_ptr() < t.data_ptr() + t.numel() <= info.base + info.size
    assert cuda.pointer_device(torch.empty(16).data_ptr()) is None


@pytest.mark.parametrize(("src_dev", "dst_dev"), [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_the_simulator_moves_cuda_bytes_exactly(src_dev: str, dst_dev: str) -> None:
    fabric = SimFabric(11, chunk_bytes=1 << 16)
    a, b = fabric.open_engine(), fabric.open_engine()
    assert a.capabilities.cuda_memory
    src = _rand(3 << 20, src_dev)
    dst = torch.zeros(4 << 20, dtype=torch.uint8, device=dst_dev)
    rs, rd = a.register(src), b.register(dst)
    assert rd.descriptor.device.kind == ("cuda" if dst_dev == "cuda" else "cpu")
    a.submit(WriteRequest(rs, 0, 3 << 20, rd.descriptor, 1 << 20, imm=5)).wait(timeout=30)
    b.counter(5).wait(a.capabilities.num_nics, timeout=10)  # one imm per shard: a 2-NIC write
    assert torch.equal(dst[1 << 20 :].cpu(), src.cpu())
    assert int(dst[: 1 << 20].count_nonzero()) == 0
    # paged: pages 3, 0, 2 of the source to pages 1, 2, 0 of the target
    page = 1 << 18
    a.submit(PagedWriteRequest(rs, [3, 0, 2], page, rd.descriptor, [1, 2, 0], page, page, imm=6)).wait(
        timeout=30
    )
    for s, d in ((3, 1), (0, 2), (2, 0)):
        assert torch.equal(dst[d * page : (d + 1) * page].cpu(), src[s * page : (s + 1) * page].cpu())
    a.close()
    b.close()


def test_cuda_registrations_are_checked_against_the_driver() -> None:
    fabric = SimFabric(0)
    e = fabric.open_engine()
    t = _rand(1 << 20)
    wrong = torch.cuda.device_count()  # a device this memory is not on
    with pytest.raises(ConfigError, match=r"memory of cuda:0|not CUDA device memory"):
        e.register(RawMemory(t.data_ptr(), t.numel(), f"cuda:{wrong}"))
    host = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="not CUDA device memory"):
        e.register(RawMemory(host.data_ptr(), 4096, "cuda:0"))
    info = cuda.pointer_device(t.data_ptr())
    assert info is not None
    with pytest.raises(ConfigError, match="runs past the end"):
        e.register(RawMemory(info.base, info.size + (64 << 20), "cuda:0"))
    assert e.stats().registrations == 0
    r = e.register(RawMemory(t.data_ptr(), t.numel(), "cuda:0"))
    assert r.device == Device(kind="cuda", index=0)
    e.close()


_EXPANDABLE = textwrap.dedent(
    """
    import torch
    from fabric_core import WriteRequest, CapabilityError, open_engine
    from fabric_sim import SimFabric
    n = 300 << 20  # several of expandable_segments' 20 MiB pieces
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    fabric = SimFabric(1, chunk_bytes=8 << 20)
    a, b = fabric.open_engine(), fabric.open_engine()
    rs, rd = a.register(src), b.register(dst)
    a.submit(WriteRequest(rs, 0, n, rd.descriptor, 0, imm=1)).wait(timeout=60)
    assert torch.equal(src, dst)
    print("sim ok")
    try:
        import fabric_efa
    except ImportError:
        print("no efa")
    else:
        e = open_engine("efa", efa_provider="shm")
        try:
            e.register(dst)
        except CapabilityError as exc:
            # refused whole: the span crosses pieces, or the provider takes no CUDA memory
            want = "expandable_segments" if e.capabilities.cuda_memory else "carries host memory only"
            assert want in str(exc), exc
            assert e.stats().registrations == 0
            print("efa refused")
        else:
            print("efa registered a tensor across pieces")
        e.close()
    """
)


def test_expandable_segments_work_on_the_simulator_and_are_refused_where_one_allocation_is_needed() -> None:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sim ok" in out.stdout
    assert "efa refused" in out.stdout or "no efa" in out.stdout, out.stdout


def _held(event: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if event.query():
            return False
    return True


def test_a_stream_waits_for_the_imms_then_reads_the_landed_bytes() -> None:
    fabric = SimFabric(5, chunk_bytes=1 << 16)
    a, b = fabric.open_engine(), fabric.open_engine()
    src = _rand(1 << 20)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    rs, rd = a.register(src), b.register(dst)
    dc = b.device_counter(0x77, peer=a.address)
    stream = torch.cuda.Stream()
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    nics = a.capabilities.num_nics
    with torch.cuda.stream(stream):
        dc.wait(nics, stream)
        out.copy_(dst.to(torch.int64).sum().reshape(1))
        done = torch.cuda.Event()
        done.record(stream)
    assert _held(done, 0.1), "the stream ran before any imm arrived"
    a.submit(WriteRequest(rs, 0, 1 << 20, rd.descriptor, 0, imm=0x77)).wait(timeout=30)
    assert not _held(done, 10.0)
    assert int(out.item()) == int(src.to(torch.int64).sum().item())
    dc.check()
    assert (dc.arrived, dc.reserved) == (nics, nics)
    a.close()
    b.close()


def test_waiting_streams_do_not_stall_the_other_streams_of_the_process() -> None:
    e = SimFabric(0).open_engine()
    dc = e.device_counter(12)
    a = _rand(64 << 20)
    b = torch.empty_like(a)
    x = torch.ones(1 << 20, device="cuda")
    other = torch.cuda.Stream()
    try:
        for s in [torch.cuda.Stream() for _ in range(16)]:  # twice CUDA's default 8 queues
            dc.wait(1, s, timeout=60)
        with torch.cuda.stream(other):
            b.copy_(a)
            x.mul_(3.0)
            done = torch.cuda.Event()
            done.record(other)
        assert not _held(done, 5.0), "work on another stream stalled behind the waits"
        assert torch.equal(a, b) and float(x[0]) == 3.0
    finally:
        e.close()  # releases the waits
        torch.cuda.synchronize()


def test_a_device_wait_past_its_deadline_lets_the_stream_go_and_fails_the_counter() -> None:
    e = SimFabric(0).open_engine()
    dc = e.device_counter(3)
    stream = torch.cuda.Stream()
    dc.wait(1, stream, timeout=0.2)
    done = torch.cuda.Event()
    done.record(stream)
    assert not _held(done, 10.0), "the GPU was not released"
    with pytest.raises(TransferTimeout):
        dc.check()
    e.close()


def test_closing_the_engine_releases_a_waiting_stream() -> None:
    e = SimFabric(0).open_engine()
    dc = e.device_counter(3)
    stream = torch.cuda.Stream()
    dc.wait(5, stream, timeout=float("inf"))
    done = torch.cuda.Event()
    done.record(stream)
    assert _held(done, 0.05)
    e.close()
    assert not _held(done, 10.0)


def test_a_device_wait_can_be_captured_in_a_cuda_graph() -> None:
    fabric = SimFabric(2)
    a, b = fabric.open_engine(nics=1), fabric.open_engine(nics=1)
    dc = b.device_counter(9, peer=a.address)
    src = _rand(4096)
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    rs, rd = a.register(src), b.register(dst)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    acc = torch.zeros(1, dtype=torch.int64, device="cuda")
    with torch.cuda.graph(graph, stream=stream):
        dc.wait(1, torch.cuda.current_stream(), timeout=float("inf"))  # target baked in: 1
        acc.add_(dst.to(torch.int64).sum())
    graph.replay()
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream())
    assert _held(done, 0.1)
    a.submit(WriteRequest(rs, 0, 4096, rd.descriptor, 0, imm=9)).wait(timeout=30)
    assert not _held(done, 10.0)
    assert int(acc.item()) == int(src.to(torch.int64).sum().item())
    a.close()
    b.close()


def test_efa_shm_carries_cuda_memory_between_engines() -> None:
    a = _efa_shm()
    b = open_engine("efa", efa_provider="shm")
    src = _rand(8 << 20)
    dst = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    rs, rd = a.register(src), b.register(dst)
    a.submit(WriteRequest(rs, 0, 8 << 20, rd.descriptor, 0, imm=4)).wait(timeout=30)
    b.counter(4).wait(1, timeout=10)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    a.close()
    b.close()


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_efa_refuses_cuda_memory_at_registration_where_the_provider_cannot_carry_it(provider: str) -> None:
    try:
        import fabric_efa  # noqa: F401
    except ImportError:
        pytest.skip("fabric-efa is not installed")
    addrs = "127.0.0.1" if provider.startswith("tcp") else None
    e = open_engine("efa", efa_provider=provider, efa_nic_addrs=addrs)
    if e.capabilities.cuda_memory:
        e.close()
        pytest.skip(f"{provider} carries CUDA memory here")
    assert str(e.domains[0].details["cuda_memory"]).startswith("no: ")
    with pytest.raises(CapabilityError):
        e.register(_rand(4096))
    assert e.stats().registrations == 0
    e.close()
