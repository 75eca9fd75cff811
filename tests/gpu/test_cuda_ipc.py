"""CUDA memory between two processes of one host: fabric-efa over shm with the CUDA IPC domain
(fabric/cuda_ipc.hpp). The other process is tests/gpu/ipc_peer.py, driven line by line.

Skipped without a GPU (tests/gpu/conftest.py) or without fabric-efa. Every check is of exact
bytes (sha256 of the whole region), exact counts and typed errors; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric_core import (
    MemoryRegionDescriptor,
    PeerUnreachable,
    RemoteAccessError,
    TransferTimeout,
    WriteRequest,
    open_engine,
)

torch: Any = pytest.importorskip("torch")
pytest.importorskip("fabric_efa")

MiB = 1 << 20


class Peer:
    """tests/gpu/ipc_peer.py in a process of its own."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("ipc_peer.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        ready = self._line(120)
        assert ready.startswith("ready "), ready
        self.cuda_memory = ready.split(" ", 1)[1]

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            self.proc.kill()
            raise AssertionError(f"the peer gave no answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"the peer exited: {err[-3000:]}")
        return line.strip()

    def ask(self, cmd: str, timeout: float = 60) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def register(self, where: str, n: int, seed: int = -1) -> tuple[int, MemoryRegionDescriptor]:
        index, desc = self.ask(f"reg {where} {n} {seed}").split()
        return int(index), MemoryRegionDescriptor.from_bytes(bytes.fromhex(desc))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("exit", timeout=30)
            except (AssertionError, BrokenPipeError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                try:
                    f.close()
                except BrokenPipeError:
                    pass


def _shm_engine(carries: Callable[[Any], bool], why: str, **settings: Any) -> Iterator[Any]:
    """An efa shm engine for a fixture, skipping the test with ``why`` where it does not
    carry CUDA memory the way ``carries`` asks."""
    e = open_engine("efa", efa_provider="shm", **settings)
    if not carries(e):
        state = e.domains[0].details["cuda_memory"]
        e.close()
        pytest.skip(f"{why}: {state}")
    yield e
    e.close()


def _peer(env: dict[str, str] | None = None) -> Iterator[Peer]:
    p = Peer(env)
    yield p
    p.close()


@pytest.fixture
def engine() -> Iterator[Any]:
    yield from _shm_engine(lambda e: e.capabilities.cuda_memory, "efa shm carries no CUDA memory here")


@pytest.fixture
def peer() -> Iterator[Peer]:
    yield from _peer()


def _bytes(n: int, seed: int, where: str = "cuda") -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(where)


def _sha(t: Any) -> str:
    torch.cuda.synchronize()
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()


def test_the_engine_says_it_carries_cuda_memory_over_cuda_ipc(engine: Any) -> None:
    assert engine.domains[0].details["cuda_memory"] == "yes (CUDA IPC)"
    assert engine.provider_info["cuda_ipc"] is True


def test_writeimm_lands_exact_bytes_in_another_process_gpu_memory(engine: Any, peer: Peer) -> None:
    assert peer.cuda_memory == "yes (CUDA IPC)"
    n = 8 * MiB + 12345
    index, desc = peer.register("cuda", n)
    src = _bytes(n, 1)
    rs = engine.register(src)
    # three writes: the whole, then two unaligned pieces over it with other bytes
    engine.submit(WriteRequest(rs, 0, n, desc, 0, imm=7)).wait(timeout=30)
    other = _bytes(n, 2)
    ro = engine.register(other)
    engine.submit(WriteRequest(ro, 4099, 65537, desc, 4099, imm=7)).wait(timeout=30)
    engine.submit(WriteRequest(ro, n - 3, 3, desc, n - 3, imm=7)).wait(timeout=30)
    assert peer.ask("wait 7 3") == "ok"
    assert peer.ask("count 7") == "0"
    want = src.clone()
    want[4099 : 4099 + 65537] = other[4099 : 4099 + 65537]
    want[n - 3 :] = other[n - 3 :]
    assert peer.ask(f"sha {index}") == _sha(want)


def test_the_other_process_writes_into_this_ones_gpu_memory(engine: Any, peer: Peer) -> None:
    n = 3 * MiB + 5
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    rd = engine.register(dst)
    index, _ = peer.register("cuda", n, seed=11)
    assert peer.ask(f"write {index} {rd.descriptor.to_bytes().hex()} {n} 21") == "ok"
    engine.counter(21).wait(1, timeout=30)
    assert _sha(dst) == _sha(_bytes(n, 11))


def test_host_memory_writes_into_a_peer_gpu_and_gpu_writes_are_refused_into_peer_host_memory(
    engine: Any, peer: Peer
) -> None:
    n = MiB + 1
    gpu_index, gpu_desc = peer.register("cuda", n)
    host_index, host_desc = peer.register("cpu", n)
    host_src = _bytes(n, 3, "cpu")
    engine.submit(WriteRequest(engine.register(host_src), 0, n, gpu_desc, 0, imm=30)).wait(timeout=30)
    assert peer.ask("wait 30 1") == "ok"
    assert peer.ask(f"sha {gpu_index}") == _sha(host_src)
    # a CUDA source into the peer's host memory: not carried, a typed error, nothing lands
    gpu_src = engine.register(_bytes(n, 4))
    with pytest.raises(RemoteAccessError, match="CUDA"):
        engine.submit(WriteRequest(gpu_src, 0, n, host_desc, 0, imm=31)).wait(timeout=30)
    assert peer.ask("count 31") == "0"
    assert peer.ask(f"sha {host_index}") == _sha(torch.zeros(n, dtype=torch.uint8))


def test_writes_outside_the_region_or_after_deregistration_fail_typed_and_land_nothing(
    engine: Any, peer: Peer
) -> None:
    n = MiB
    index, desc = peer.register("cuda", n)
    src = engine.register(_bytes(2 * n, 5))
    zeros = _sha(torch.zeros(n, dtype=torch.uint8))
    # a descriptor that claims more than the peer registered (forged, or stale): the domain
    # checks the range against the peer's table, and refuses before any byte moves
    forged = desc.model_copy(update={"length": 2 * n})
    with pytest.raises(RemoteAccessError, match="outside"):
        engine.submit(WriteRequest(src, 0, n + 1, forged, 0, imm=40)).wait(timeout=30)
    assert peer.ask("count 40") == "0"
    assert peer.ask(f"sha {index}") == zeros
    engine.submit(WriteRequest(src, 0, 4096, desc, 0, imm=41)).wait(timeout=30)
    assert peer.ask("wait 41 1") == "ok"
    assert peer.ask(f"dereg {index}") == "ok"
    with pytest.raises(RemoteAccessError):
        engine.submit(WriteRequest(src, 0, 4096, desc, 4096, imm=42)).wait(timeout=30)
    assert peer.ask("count 42") == "0"


def test_many_writes_in_flight_count_exactly(engine: Any, peer: Peer) -> None:
    n = 64 * MiB
    index, desc = peer.register("cuda", n)
    src = _bytes(n, 6)
    rs = engine.register(src)
    piece = n // 256
    pending = [engine.submit(WriteRequest(rs, i * piece, piece, desc, i * piece, imm=50)) for i in range(256)]
    for t in pending:
        t.wait(timeout=60)
    assert peer.ask("wait 50 256") == "ok"
    assert peer.ask("count 50") == "0"
    assert peer.ask(f"sha {index}") == _sha(src)


@pytest.mark.parametrize(("stride", "length"), [(4099, 4093), (8192, 8001)])
def test_paged_writes_go_through_the_copy_kernel_and_the_inbox_and_land_exact_bytes(
    engine: Any, peer: Peer, stride: int, length: int
) -> None:
    # thousands of pages, scattered at both ends: the domain moves them in a few kernel
    # launches and delivers their imms through the peer's inbox. Odd strides and lengths
    # take the kernel's byte loop, 16-byte aligned ones its vector loop and then a tail.
    details = engine.domains[0].details
    assert details["cuda_copy_kernel"] == "yes", details
    assert details["cuda_imm_inbox"] == "yes", details
    pages = 3000
    n = pages * stride
    index, desc = peer.register("cuda", n)
    src = _bytes(n, 8)
    rs = engine.register(src)
    g = torch.Generator().manual_seed(stride)
    src_pages = torch.randperm(pages, generator=g).numpy()
    dst_pages = torch.randperm(pages, generator=g).numpy()
    t = engine.submit_paged_write(rs, src_pages, stride, desc, dst_pages, stride, length, imm=60)
    t.wait(timeout=60)
    assert peer.ask(f"wait 60 {t.imms_at_target}") == "ok"
    assert peer.ask("count 60") == "0"
    host = src.cpu()
    want = torch.zeros(n, dtype=torch.uint8)
    for s, d in zip(src_pages.tolist(), dst_pages.tolist(), strict=True):
        want[d * stride : d * stride + length] = host[s * stride : s * stride + length]
    assert peer.ask(f"sha {index}") == _sha(want)


def test_memory_of_another_gpu_registers_and_moves_both_ways(engine: Any, peer: Peer) -> None:
    # both engines are on GPU 0 (the device current when they opened); the tensors are on
    # GPU 1. Before, such a registration failed in the driver's lookup (the allocation is
    # another context's).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    n = 2 * MiB + 3
    index, desc = peer.register("cuda:1", n)
    src = _bytes(n, 12, "cuda:1")
    rs = engine.register(src)
    engine.submit(WriteRequest(rs, 0, n, desc, 0, imm=70)).wait(timeout=30)
    # small pieces too: the copy-list kernel's size (they go as peer copies here)
    pieces = [engine.submit(WriteRequest(rs, i * 4096, 4096, desc, i * 4096, imm=70)) for i in range(16)]
    for t in pieces:
        t.wait(timeout=30)
    assert peer.ask("wait 70 17") == "ok"
    assert peer.ask(f"sha {index}") == _sha(src)
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:1")
    rd = engine.register(dst)
    other, _ = peer.register("cuda:1", n, seed=13)
    assert peer.ask(f"write {other} {rd.descriptor.to_bytes().hex()} {n} 71") == "ok"
    engine.counter(71).wait(1, timeout=30)
    assert _sha(dst) == _sha(_bytes(n, 13))


def test_a_dead_peer_fails_the_write_typed_and_in_bounded_time(engine: Any, peer: Peer) -> None:
    _, desc = peer.register("cuda", MiB)
    src = engine.register(_bytes(MiB, 7))
    engine.submit(WriteRequest(src, 0, MiB, desc, 0, imm=60)).wait(timeout=30)
    peer.proc.kill()
    peer.proc.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises((PeerUnreachable, TransferTimeout)):
        engine.submit(WriteRequest(src, 0, MiB, desc, 0, imm=61), timeout=20).wait(timeout=40)
    assert time.monotonic() - t0 < 40


def test_a_stream_waits_on_the_gpu_for_a_write_from_another_process(engine: Any, peer: Peer) -> None:
    n = 2 * MiB
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    rd = engine.register(dst)
    index, _ = peer.register("cuda", n, seed=12)
    dc = engine.device_counter(71)
    stream = torch.cuda.Stream()
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    with torch.cuda.stream(stream):
        dc.wait(1, stream)
        out.copy_(dst.to(torch.int64).sum().reshape(1))
        done = torch.cuda.Event()
        done.record(stream)
    time.sleep(0.1)
    assert not done.query(), "the stream ran before the imm arrived"
    assert peer.ask(f"write {index} {rd.descriptor.to_bytes().hex()} {n} 71") == "ok"
    end = time.monotonic() + 10
    while not done.query() and time.monotonic() < end:
        time.sleep(0.001)
    assert done.query(), "the stream still waits after the imm arrived"
    assert int(out.item()) == int(_bytes(n, 12).to(torch.int64).sum().item())
    dc.check()
    dc.close()


# --- CUDA memory through the provider's own FI_HMEM (efa_cuda_ipc off) -----------------------
# The path fabric-efa takes on the efa provider between hosts: CUDA memory registered with
# fi_mr_regattr and FI_HMEM_CUDA, the provider moving it. Off AWS it runs only against a
# libfabric built with CUDA (benchmarks/device/run.sh's hmem-lf2 step builds 2.1 so); the
# GPU machine's own libfabric (1.17, Ubuntu's) refuses such registrations, and these skip.


@pytest.fixture
def hmem_engine() -> Iterator[Any]:
    yield from _shm_engine(
        lambda e: e.domains[0].details["cuda_memory"] == "yes",
        "this libfabric's shm does not carry CUDA memory itself (FI_HMEM_CUDA)",
        efa_cuda_ipc=False,
    )


@pytest.fixture
def hmem_peer() -> Iterator[Peer]:
    yield from _peer({"FABRIC_EFA_CUDA_IPC": "0"})


def test_without_cuda_ipc_the_engine_carries_cuda_memory_through_fi_hmem(hmem_engine: Any) -> None:
    assert hmem_engine.provider_info["cuda_ipc"] is False
    assert hmem_engine.provider_info["hmem"] is True
    assert hmem_engine.capabilities.cuda_memory


@pytest.mark.parametrize(("here", "there"), [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
def test_fi_hmem_writes_land_exact_bytes_both_ways_between_processes(
    hmem_engine: Any, hmem_peer: Peer, here: str, there: str
) -> None:
    """A WriteImm of 8 MiB and some from this process's ``here`` memory into the peer's
    ``there`` memory, two unaligned pieces over it, and one the other way: every byte (the
    sha256 of each whole region) and every imm count exact."""
    assert hmem_peer.cuda_memory == "yes", hmem_peer.cuda_memory
    n = 8 * MiB + 12345
    index, desc = hmem_peer.register(there, n)
    src, other = _bytes(n, 41, here), _bytes(n, 42, here)
    rs, ro = hmem_engine.register(src), hmem_engine.register(other)
    hmem_engine.submit(WriteRequest(rs, 0, n, desc, 0, imm=51)).wait(timeout=30)
    hmem_engine.submit(WriteRequest(ro, 4099, 65537, desc, 4099, imm=51)).wait(timeout=30)
    hmem_engine.submit(WriteRequest(ro, n - 3, 3, desc, n - 3, imm=51)).wait(timeout=30)
    assert hmem_peer.ask("wait 51 3") == "ok"
    assert hmem_peer.ask("count 51") == "0"
    want = src.clone()
    want[4099 : 4099 + 65537] = other[4099 : 4099 + 65537]
    want[n - 3 :] = other[n - 3 :]
    assert hmem_peer.ask(f"sha {index}") == _sha(want)
    # the peer's ``there`` memory into this process's ``here`` memory
    dst = torch.zeros(n, dtype=torch.uint8, device=here)
    rd = hmem_engine.register(dst)
    back, _ = hmem_peer.register(there, n, seed=43)
    assert hmem_peer.ask(f"write {back} {rd.descriptor.to_bytes().hex()} {n} 52") == "ok"
    hmem_engine.counter(52).wait(1, timeout=30)
    assert _sha(dst) == _sha(_bytes(n, 43))
    assert hmem_engine.counter(52).value == 0
