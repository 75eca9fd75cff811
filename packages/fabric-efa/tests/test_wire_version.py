"""Engines of different fabric releases (another wire protocol): every control frame starts
with a wire byte, 0x80 | the protocol version (fabric/engine.hpp, kWireByte). An engine that
gets a frame of another version drops it, counts it (``frames_foreign``), notes the sender
(``dump_state()["foreign_peers"]``) and tells it so, once a second at most; work that depends
on such a peer fails with ``PeerIncompatible`` about a second after a probe went unanswered,
not after the liveness timeout. The other release is played by an engine told to speak wire
protocol 3 (``_speak_wire``); libfabric's shm and tcp providers, two engines in one process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest

from fabric_core.errors import PeerIncompatible, PeerUnreachable, TransferTimeout
from fabric_core.testing.conformance import _eventually
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")

EngineFactory = Callable[..., EfaEngine]
T = 20.0
TCP = "tcp;ofi_rxm"
OURS = 0x80 | 2
OTHER = 0x80 | 3
PROVIDERS = ["shm", TCP]


def _foreign(e: EfaEngine) -> list[dict[str, str]]:
    return list(e.dump_state()["foreign_peers"])


def _frames_foreign(e: EfaEngine) -> int:
    return int(e._core.stats()["frames_foreign"])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_frame_of_another_wire_protocol_is_dropped_counted_and_answered(
    provider: str, efa_engine: EngineFactory
) -> None:
    with efa_engine(provider) as ours, efa_engine(provider) as theirs:
        assert ours.provider_info["wire_protocol"] == OURS & 0x7F
        assert ours.domains[0].details["wire_protocol"] == OURS & 0x7F  # (fabric info shows it)
        theirs._core._speak_wire(OTHER)
        ours.submit_send(theirs.address, b"hello").wait(T)  # (a send completes at its sender)
        # theirs cannot read it: never handed to the application, counted
        with pytest.raises(TransferTimeout):
            theirs.recv(timeout=0.3)
        assert _frames_foreign(theirs) == 1
        assert _foreign(theirs) == [
            {"address": ours.address.raw.hex(), "wire": f"wire protocol {OURS & 0x7F}"}
        ]
        # and it told ours so, in its own protocol: ours notes it, and hands nothing on either
        them = [{"address": theirs.address.raw.hex(), "wire": f"wire protocol {OTHER & 0x7F}"}]
        assert _eventually(lambda: _foreign(ours) == them, 5.0), _foreign(ours)
        assert _frames_foreign(ours) == 1
        with pytest.raises(TransferTimeout):
            ours.recv(timeout=0.1)
        # told at most once a second, however many frames come
        for _ in range(5):
            ours.submit_send(theirs.address, b"again").wait(T)
        assert _eventually(lambda: _frames_foreign(theirs) == 6, 5.0)
        time.sleep(0.2)
        assert _frames_foreign(ours) == 1
        # the same release again: a frame of ours' protocol clears the note, messages go through
        theirs._core._speak_wire(OURS)
        theirs.submit_send(ours.address, b"back").wait(T)
        got = ours.recv(timeout=T)
        assert (got.peer, got.data) == (theirs.address, b"back")
        assert _foreign(ours) == []
        ours.submit_send(theirs.address, b"hi").wait(T)
        assert theirs.recv(timeout=T).data == b"hi"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_wait_naming_a_peer_of_another_wire_protocol_fails_in_seconds_naming_both(
    provider: str, efa_engine: EngineFactory
) -> None:
    """Its probes are not answered: the wait fails with PeerIncompatible (a PeerUnreachable)
    about a second after the first, though the liveness timeout is 30 s."""
    with (
        efa_engine(provider, liveness_interval_s=0.1, liveness_timeout_s=30.0) as ours,
        efa_engine(provider) as theirs,
    ):
        theirs._core._speak_wire(OTHER)
        t0 = time.monotonic()
        with pytest.raises(
            PeerIncompatible,
            match=rf"wire protocol {OTHER & 0x7F} and this engine wire protocol {OURS & 0x7F}",
        ) as err:
            ours.counter(5).wait(1, timeout=T, peer=theirs.address)
        took = time.monotonic() - t0
        assert took < 10.0, took
        assert isinstance(err.value, PeerUnreachable)
        assert err.value.peer == theirs.address.raw.hex()
        # the control frames went nowhere: neither engine took any of the other's
        assert _frames_foreign(theirs) >= 1
        assert _frames_foreign(ours) >= 1


def test_a_write_that_goes_as_a_frame_to_a_peer_of_another_wire_protocol_fails_and_lands_nothing(
    efa_engine: EngineFactory,
) -> None:
    """On tcp a lone small write goes as a control frame (an eager write): the target cannot
    read it, so nothing lands and no imm is counted, and the write fails with
    PeerIncompatible within seconds. Through the provider (a larger write) it would land:
    the provider's writes do not depend on the release."""
    with (
        efa_engine(TCP, liveness_interval_s=0.1, liveness_timeout_s=30.0) as ours,
        efa_engine(TCP) as theirs,
    ):
        theirs._core._speak_wire(OTHER)
        src = np.full(64, 9, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        src_mr, dst_mr = ours.register(src), theirs.register(dst)
        counter = theirs.counter(3)
        t0 = time.monotonic()
        with pytest.raises(PeerIncompatible, match=f"wire protocol {OTHER & 0x7F}"):
            ours.submit_write(src_mr, 0, 64, dst_mr.descriptor, 0, imm=3).wait(T)
        assert time.monotonic() - t0 < 10.0
        assert int(ours._core.stats()["eager_writes"]) == 1
        assert int(theirs._core.stats()["eager_landed"]) == 0
        assert not dst.any()
        assert counter.value == 0
        ours.deregister(src_mr)
        theirs.deregister(dst_mr)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_fence_to_a_peer_of_another_wire_protocol_gives_up_in_seconds(
    provider: str, efa_engine: EngineFactory
) -> None:
    """A fence's ping goes unanswered too: once the peer is heard speaking another version,
    the fence stops waiting a second after it began and raises PeerIncompatible, not at its
    20 s timeout; a fence to it once it speaks the same version again is answered."""
    with efa_engine(provider) as ours, efa_engine(provider) as theirs:
        theirs._core._speak_wire(OTHER)
        t0 = time.monotonic()
        with pytest.raises(PeerIncompatible, match=f"wire protocol {OTHER & 0x7F}") as err:
            ours.fence([theirs.address], timeout=T)
        took = time.monotonic() - t0
        assert 0.9 < took < 10.0, took
        assert err.value.peer == theirs.address.raw.hex()
        theirs._core._speak_wire(OURS)
        ours.fence([theirs.address], timeout=T)
