"""Simulator-specific behaviour: scheduled faults, the virtual clock, the shared fabric."""

from __future__ import annotations

import numpy as np
import pytest

from fabric_core import (
    ConfigError,
    PeerUnreachable,
    Pinned,
    Sharded,
    TransferCancelled,
    TransportError,
    load_settings,
)
from fabric_sim import SimBackend, SimFabric, default_fabric, link_preset
from fabric_sim.testing import SimHarness

MiB = 1 << 20


def _pair(fabric: SimFabric, nics: int, size: int = MiB):  # type: ignore[no-untyped-def]
    a, b = fabric.open_engine(nics), fabric.open_engine(nics)
    src = np.random.default_rng(0).integers(1, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    return a, b, src, dst, a.register(src), b.register(dst)


def test_peer_killed_after_exact_event_count_leaves_partial_bytes_and_no_imm() -> None:
    fabric = SimFabric(5, chunk_bytes=4096)
    a, b, src, dst, smr, dmr = _pair(fabric, 1, 64 * 4096)
    with fabric.paused():
        t = a.submit_write(smr, 0, 64 * 4096, dmr.descriptor, 0, imm=1, routing=Pinned(0))
        fabric.after(20, lambda: fabric.fail_peer(b))
    assert isinstance(t.exception(10), PeerUnreachable)
    landed = int((dst != 0).sum())
    assert 0 < landed < src.size  # 20 chunks of 4 KiB, no more
    assert landed == 20 * 4096
    assert b.counter(1).value == 0
    a.close()


def test_restored_nic_carries_traffic_again() -> None:
    fabric = SimFabric(1)
    a, b, _src, _dst, smr, dmr = _pair(fabric, 2)
    fabric.fail_nic(b, 1)
    t = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=2, routing=Pinned(1))
    b.counter(2).wait(1, timeout=10)  # moved to NIC 0
    fabric.restore_nic(b, 1)
    t2 = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=2, routing=Pinned(1))
    b.counter(2).wait(1, timeout=10)
    t.wait(10)
    t2.wait(10)
    with pytest.raises(ConfigError):
        fabric.fail_nic(b, 2)
    a.close()
    b.close()


def test_all_nics_down_fails_with_transport_error() -> None:
    fabric = SimFabric(1)
    a, b, _, _, smr, dmr = _pair(fabric, 2)
    fabric.fail_nic(a, 0)
    fabric.fail_nic(b, 1)
    t = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=2)
    exc = t.exception(10)
    assert isinstance(exc, TransportError) and "down" in str(exc)
    a.close()
    b.close()


@pytest.mark.parametrize("nics", [1, 2, 4])
def test_virtual_clock_follows_the_link_model(nics: int) -> None:
    link = link_preset("cx7-400g")
    fabric = SimFabric(0, link=link)
    a, b, _, _, smr, dmr = _pair(fabric, nics, 8 * MiB)
    assert a.capabilities.virtual_clock and a.domains[0].link_speed_gbps == 400
    start = fabric.now
    t = a.submit_write(smr, 0, 8 * MiB, dmr.descriptor, 0, imm=3, routing=Sharded())
    b.counter(3).wait(t.imms_at_target, timeout=30)
    t.wait(30)
    fabric.quiesce()
    elapsed = fabric.now - start
    wire = 8 * MiB / nics / link.bytes_per_s
    # serialisation on each NIC plus one-way latency and the ack, nothing else
    assert wire + link.latency_s < elapsed < wire + 3 * link.latency_s + 1e-6
    a.close()
    b.close()


def test_default_fabric_refuses_conflicting_settings_while_in_use() -> None:
    e = SimBackend.open(load_settings(backend="sim", sim_seed=11))
    try:
        with pytest.raises(ConfigError, match="seed=11"):
            default_fabric(load_settings(backend="sim", sim_seed=12))
        assert default_fabric(load_settings(backend="sim", sim_seed=11)) is e.fabric  # type: ignore[attr-defined]
    finally:
        e.close()
    assert default_fabric(load_settings(backend="sim", sim_seed=12)).seed == 12


def test_sim_backend_topology_and_probe() -> None:
    assert SimBackend.probe().available
    (group,) = SimBackend.detect_topology(load_settings(backend="sim", nics=4, sim_link="efa-p5"))
    assert len(group.domains) == 4 and group.domains[0].link_speed_gbps == 100


def test_fabric_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        SimFabric(chunk_bytes=0)
    fabric = SimFabric()
    with pytest.raises(ConfigError):
        fabric.open_engine(nics=0)
    with pytest.raises(ConfigError, match="simulator engines only"):
        fabric.open_engine(1, backend="efa")
    with pytest.raises(ConfigError, match="unknown link preset"):
        link_preset("infiniband-9000")


def test_harness_refuses_engines_of_another_fabric() -> None:
    h, other = SimHarness(0), SimFabric(1)
    e = other.open_engine(1)
    with pytest.raises(ConfigError):
        h.kill_nic(e, 0)
    e.close()
    h.close()


def test_messages_beyond_posted_receives_wait_for_a_buffer() -> None:
    fabric = SimFabric(2)
    a, b = fabric.open_engine(1), fabric.open_engine(1, recv_depth=2)
    sends = [a.submit_send(b.address, bytes([i])) for i in range(5)]
    assert fabric.quiesce()
    assert sum(t.done() for t in sends) == 2  # three senders wait for a posted receive
    got = [b.recv(timeout=10).data for _ in range(3)]
    assert fabric.quiesce()
    assert sum(t.done() for t in sends) == 5
    got += [b.recv(timeout=10).data for _ in range(2)]
    assert sorted(got) == [bytes([i]) for i in range(5)]
    late = [a.submit_send(b.address, b"x") for _ in range(3)]
    assert fabric.quiesce()
    b.close()
    outcomes = [type(t.exception(10)).__name__ for t in late]
    assert sorted(outcomes) == ["NoneType", "NoneType", "PeerUnreachable"]  # the parked one fails
    a.close()


def _stage_cancelled_ghost(seed: int):  # type: ignore[no-untyped-def]
    """A WriteImm cancelled after it landed (counted) and before its acknowledgement, which
    its NIC going down then turns into a failure; behind it, live WriteImms fail on that NIC.
    Returns None where this seed's event order does not stage that."""
    fabric = SimFabric(seed, chunk_bytes=4096)
    a, b, src, dst, smr, dmr = _pair(fabric, 2, 8 * 4096)
    with fabric.paused():
        doomed = a.submit_write(smr, 0, 4096, dmr.descriptor, 0, imm=40, routing=Pinned(1))
        live = [
            a.submit_write(smr, i * 4096, 4096, dmr.descriptor, i * 4096, imm=41, routing=Pinned(1))
            for i in range(1, 5)
        ]
        fabric.fail_nic(a, 1)  # everything above is on the wire on NIC 1
        for _ in range(200):  # up to the doomed write's count, not its acknowledgement
            if b.counter(40).value or doomed.done():
                break
            fabric.step()
        staged = b.counter(40).value == 1 and doomed.cancel(timeout=1.0)
    if not staged:
        a.close()
        b.close()
        return None
    return fabric, a, b, src, dst, doomed, live


def test_a_cancelled_writeimm_counted_before_its_nic_failed_is_accounted_for() -> None:
    """The live WriteImms that failed with the NIC are reconciled and retried: the count the
    cancelled one left at the target is owed to it, not taken for theirs."""
    staged = [s for s in map(_stage_cancelled_ghost, range(12)) if s is not None]
    assert staged, "no seed staged the case"
    for fabric, a, b, src, dst, doomed, live in staged:
        for t in live:
            assert t.exception(10) is None
        b.counter(41).wait(4, timeout=10)
        assert np.array_equal(dst[4096 : 5 * 4096], src[4096 : 5 * 4096])
        fabric.quiesce()
        assert b.counter(41).value == 0 and b.counter(40).value == doomed.imms_at_target == 1
        assert isinstance(doomed.exception(0), TransferCancelled)
        assert a.stats().retries >= 1
        a.close()
        b.close()


def test_cancel_counts_the_imms_that_landed_before_it_returns() -> None:
    """A work request whose bytes and imm landed before the cancel, but whose count the target
    had not taken yet (the simulated poll comes a little later), is counted by the time
    ``cancel`` returns: nothing of the transfer is counted afterwards."""
    from fabric_sim.fabric import _IMM

    fabric = SimFabric(3, chunk_bytes=4096)
    a = fabric.open_engine(1, max_msg_size=4096)
    b = fabric.open_engine(1)
    src = np.random.default_rng(0).integers(1, 256, 16 * 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    smr, dmr = a.register(src), b.register(dst)
    with fabric.paused():
        t = a.submit_write(smr, 0, src.size, dmr.descriptor, 0, imm=5)
        assert t.imms_at_target == 16
        for _ in range(500):  # up to the first imm landed and not counted yet
            if any(e[2] == _IMM for e in fabric._heap):
                break
            fabric.step()
        assert any(e[2] == _IMM for e in fabric._heap) and b.counter(5).value == 0
        assert t.cancel(timeout=1.0) is True
        counted = b.counter(5).value
    fabric.quiesce()
    assert 1 <= counted < 16 and b.counter(5).value == counted
    a.close()
    b.close()
