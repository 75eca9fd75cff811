"""GPU-side waits (fabric_core.device_counter) without a GPU: the counter table's mirror words,
and DeviceCounter's ledger, deadlines and failure release, over plain host words.

The CUDA calls are the only part replaced here: a word pool of ordinary host memory, and a
``stream_wait_value`` that records what a stream would have been told to wait for. The
values written into the words are the real ones. tests/gpu/ runs the same paths on a GPU.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from fabric_core import (
    CapabilityError,
    ConfigError,
    DomainAddress,
    EngineClosed,
    PeerUnreachable,
    TransferTimeout,
)
from fabric_core import cuda as fcuda
from fabric_core import device_counter as dcmod
from fabric_core.counters import CounterTable
from fabric_core.device_counter import DeviceCounter

PEER = DomainAddress(raw=b"peer-a")
OTHER = DomainAddress(raw=b"peer-b")
MASK = 0xFFFFFFFF


def _word(value: int = 0) -> tuple[np.ndarray[Any, Any], int]:
    arr = np.array([value], dtype=np.uint32)
    return arr, int(arr.ctypes.data)


# --- the table's mirror ------------------------------------------------------------------
def test_a_mirror_counts_arrivals_since_engine_start_from_the_word_it_found() -> None:
    t = CounterTable()
    t.add(5, 3)  # before any mirror: still counted
    arr, addr = _word(1000)
    t.attach_mirror(5, addr, None)
    assert int(arr[0]) == 1000  # attaching writes nothing: base = 1000 - 3
    assert t.reserve(5, 2) == 999  # 3 arrived, 2 asked for: already reached
    assert t.reserve(5, 4) == 1003
    t.add(5, 2)
    assert int(arr[0]) == 1002
    t.add(7, 9)  # another imm moves nothing
    assert int(arr[0]) == 1002
    t.add(5, 1)
    assert int(arr[0]) == 1003
    assert t.mirror_state(5) == (6, 6)


def test_host_waiters_consume_their_counts_without_moving_the_device_ledger() -> None:
    t = CounterTable()
    arr, addr = _word()
    t.attach_mirror(1, addr, None)
    c = t.counter(1, 1.0)
    t.add(1, 4)
    c.wait(4, timeout=1.0)
    assert t.value(1) == 0
    assert int(arr[0]) == 4  # the mirror saw all four
    assert t.reserve(1, 4) == 4


def test_refunded_counts_are_not_arrivals() -> None:
    t = CounterTable()
    arr, addr = _word()
    t.attach_mirror(1, addr, None)
    t.add(1, 2)
    t._refund(1, 2)  # a waiter cancelled as it fired gives its counts back
    assert t.value(1) == 4
    assert int(arr[0]) == 2
    assert t.imms_received == 2


def test_the_word_wraps_modulo_two_to_the_32() -> None:
    t = CounterTable()
    arr, addr = _word(MASK - 1)
    t.attach_mirror(3, addr, None)
    assert t.reserve(3, 5) == 3  # (2**32 - 2 + 5) mod 2**32
    t.add(3, 5)
    assert int(arr[0]) == 3


def test_a_lost_peer_releases_every_queued_gpu_wait_and_fails_the_mirror() -> None:
    t = CounterTable()
    arr, addr = _word(10)
    brr, baddr = _word(20)
    t.attach_mirror(1, addr, PEER.raw)
    t.attach_mirror(2, baddr, OTHER.raw)
    t.reserve(1, 3)
    t.reserve(1, 4)  # targets 13, 17
    t.add(1, 1)
    t.reserve(2, 1)
    lost = PeerUnreachable("gone", peer=PEER.raw.hex())
    t.fail_peer(PEER.raw, lost)
    assert int(arr[0]) == 17  # every target handed out is reached
    assert int(brr[0]) == 20  # the other peer's mirror is untouched
    with pytest.raises(PeerUnreachable):
        t.reserve(1, 1)
    t.add(1, 50)  # the word only grows from there
    assert int(arr[0]) == 10 + 51
    with pytest.raises(PeerUnreachable):
        t.attach_mirror(9, _word()[1], PEER.raw)  # a known-lost peer is refused at once


def test_fail_all_releases_every_mirror_and_a_released_mirror_never_moves_back() -> None:
    t = CounterTable()
    arr, addr = _word()
    t.attach_mirror(1, addr, None)
    t.add(1, 9)
    t.reserve(1, 2)  # arrivals are ahead of the targets: the word stays at 9
    t.fail_all(EngineClosed("closing"))
    assert int(arr[0]) == 9
    with pytest.raises(EngineClosed):
        t.reserve(1, 1)
    assert not t.fail_mirror(1, EngineClosed("again"))  # failed already


def test_a_detached_word_serves_the_next_mirror_without_moving_back() -> None:
    t = CounterTable()
    arr, addr = _word()
    t.attach_mirror(1, addr, None)
    t.reserve(1, 8)
    assert t.fail_mirror(1, EngineClosed("closed"), detach=True)
    assert int(arr[0]) == 8  # the old wait (target 8) passes
    with pytest.raises(ConfigError, match="no device counter"):
        t.reserve(1, 1)
    t.add(2, 2)
    t.attach_mirror(2, addr, None)  # the same word for another imm
    assert int(arr[0]) == 8
    assert t.reserve(2, 3) == 9  # base 6: two arrived already
    t.add(2, 1)
    assert int(arr[0]) == 9


def test_one_mirror_per_imm() -> None:
    t = CounterTable()
    t.attach_mirror(1, _word()[1], None)
    with pytest.raises(ConfigError, match="already has a device counter"):
        t.attach_mirror(1, _word()[1], None)


def test_a_peer_named_by_a_live_mirror_is_watched() -> None:
    t = CounterTable()
    t.attach_mirror(1, _word()[1], PEER.raw)
    assert t.names_peer(PEER.raw)
    t.fail_mirror(1, EngineClosed("closed"))
    assert not t.names_peer(PEER.raw)


# --- DeviceCounter over host words ---------------------------------------------------------
class _HostPool:
    """Host words standing in for mapped memory (the device address is the host one)."""

    def __init__(self) -> None:
        self.block = np.zeros(64, dtype=np.uint32)
        self.free = [int(self.block.ctypes.data) + 4 * i for i in range(64)]
        self.given: list[int] = []

    def take(self) -> tuple[int, int]:
        addr = self.free.pop(0)
        return addr, addr

    def give(self, word: tuple[int, int]) -> None:
        self.given.append(word[0])
        self.free.append(word[0])

    def value(self, addr: int) -> int:
        return int(self.block[(addr - int(self.block.ctypes.data)) // 4])


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    pool = _HostPool()
    waits: list[tuple[int, int, int]] = []
    monkeypatch.setattr(dcmod, "_pool", pool)
    monkeypatch.setattr(fcuda, "stream_wait_value", lambda s, ptr, v: waits.append((s, ptr, v)))
    monkeypatch.setattr(fcuda, "available", lambda: True)
    return pool, waits


def test_wait_queues_the_cumulative_target_on_the_stream(gpu: Any) -> None:
    pool, waits = gpu
    t = CounterTable()
    dc = DeviceCounter(t, 4, math.inf)
    assert dc.wait(3, 77) == 3
    assert dc.wait(2, 77) == 5
    assert waits == [(77, dc.word_address, 3), (77, dc.word_address, 5)]
    t.add(4, 5)
    assert pool.value(dc.word_address) == 5
    assert (dc.arrived, dc.reserved) == (5, 5)
    dc.check()
    dc.close()
    assert pool.given == [dc.word_address]
    with pytest.raises(EngineClosed):
        dc.wait(1, 77)
    with pytest.raises(EngineClosed):
        dc.check()


class _Stream:
    cuda_stream = 0x1234


@pytest.mark.parametrize(
    ("stream", "handle"), [(_Stream(), 0x1234), (0, 0), (2**64 - 1, 2**64 - 1)], ids=["object", "zero", "max"]
)
def test_streams_are_taken_as_objects_or_handles(gpu: Any, stream: object, handle: int) -> None:
    _pool, waits = gpu
    dc = DeviceCounter(CounterTable(), 1, math.inf)
    dc.wait(1, stream)
    assert waits[-1][0] == handle


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be"),
        ({"n": True}, "n must be"),
        ({"n": 2**31}, "n must be"),
        ({"n": 1, "stream": True}, "stream must be"),
        ({"n": 1, "stream": -1}, "64-bit"),
        ({"n": 1, "stream": "s"}, "stream must be"),
        ({"n": 1, "stream": 0, "timeout": 0}, "timeout must be"),
        ({"n": 1, "stream": 0, "timeout": float("nan")}, "timeout must be"),
    ],
)
def test_bad_waits_are_refused_and_reserve_nothing(gpu: Any, kwargs: dict[str, Any], match: str) -> None:
    _pool, waits = gpu
    dc = DeviceCounter(CounterTable(), 1, math.inf)
    with pytest.raises(ConfigError, match=match):
        dc.wait(**kwargs)
    assert waits == [] and dc.reserved == 0


def test_a_wait_past_its_deadline_releases_the_gpu_and_fails_the_counter(gpu: Any) -> None:
    pool, _waits = gpu
    t = CounterTable()
    dc = DeviceCounter(t, 2, math.inf, PEER)
    dc.wait(1, 0, timeout=30.0)  # will be satisfied
    dc.wait(4, 0, timeout=0.1)  # will not
    t.add(2, 2)
    deadline = time.monotonic() + 10.0
    while dc._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(TransferTimeout) as info:
        dc.check()
    assert info.value.expected == {2: 5} and info.value.received == {2: 2}
    assert pool.value(dc.word_address) == 5  # the GPU goes on
    with pytest.raises(TransferTimeout):
        dc.wait(1, 0)


def test_waits_met_in_time_leave_the_counter_healthy(gpu: Any) -> None:
    _pool, _waits = gpu
    t = CounterTable()
    dc = DeviceCounter(t, 2, 0.2)  # the engine's default deadline
    dc.wait(2, 0)
    threading.Timer(0.02, t.add, (2, 2)).start()
    time.sleep(0.5)
    dc.check()
    assert dc.arrived == 2


def test_an_engine_hands_out_one_device_counter_per_imm_and_releases_them_on_close(gpu: Any) -> None:
    pool, _waits = gpu
    from fabric_sim import SimFabric

    fabric = SimFabric(0)
    a = fabric.open_engine()
    dc = a.device_counter(9, peer=PEER)
    dc.wait(3, 0)
    with pytest.raises(ConfigError, match="already has a device counter"):
        a.device_counter(9)
    with pytest.raises(ConfigError, match="peer must be"):
        a.device_counter(10, peer=b"raw")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        a.device_counter(2**32)
    a.close()
    assert pool.value(dc.word_address) == 3  # released
    assert dc.closed
    with pytest.raises(EngineClosed):
        a.device_counter(11)


def test_the_simulator_counts_into_a_device_counter(gpu: Any) -> None:
    pool, _waits = gpu
    from fabric_core import WriteRequest
    from fabric_sim import SimFabric

    fabric = SimFabric(3)
    a, b = fabric.open_engine(), fabric.open_engine()
    dst = np.zeros(4096, dtype=np.uint8)
    src = np.arange(4096, dtype=np.uint8)
    rd, rs = b.register(dst), a.register(src)
    dc = b.device_counter(0x42, peer=a.address)
    assert dc.wait(2, 0) == 2
    for _ in range(2):
        a.submit(WriteRequest(rs, 0, 4096, rd.descriptor, 0, imm=0x42)).wait(timeout=10)
    assert pool.value(dc.word_address) == 2
    assert np.array_equal(dst, src)
    dc.check()


def test_without_a_gpu_device_counters_are_a_capability_error() -> None:
    if fcuda.available():
        pytest.skip("a CUDA GPU is present: tests/gpu covers this path")
    from fabric_sim import SimFabric

    a = SimFabric(0).open_engine()
    with pytest.raises(CapabilityError, match="CUDA"):
        a.device_counter(1)
    assert fcuda.unavailable_reason()
    with pytest.raises(CapabilityError):
        fcuda.copy(1, 2, 3)
