"""Control messages larger than their receiver takes. A receiver's buffers hold its own
``max_send_size`` (plus a header, and never less than 16.7 KiB, the largest frame an engine
sends of its own accord), not its sender's. A larger message would be truncated to nothing on
tcp and would stop the sender's endpoint for good on shm (libfabric 1.17). So the sender learns
the receiver's size from its answer to a ping before it sends a message above 16.7 KiB, and
fails one that does not fit at once (fabric/engine.hpp, Engine::sized).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import pytest

from fabric_core.errors import PeerUnreachable, TransportError
from fabric_efa.engine import EfaEngine

os.environ.setdefault("FI_TCP_IFACE", "lo")

EngineFactory = Callable[..., EfaEngine]
T = 20.0
PROVIDERS = ["shm", "tcp;ofi_rxm"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_message_larger_than_its_receiver_takes_fails_at_the_sender_and_the_rest_go_on(
    provider: str, efa_engine: EngineFactory
) -> None:
    with efa_engine(provider) as sender, efa_engine(provider, max_send_size=64, recv_depth=2) as small:
        fits = bytes(range(256)) * 60  # 15,360 bytes: every engine takes it
        big = bytes(range(256)) * 100  # 25,600 bytes: more than the small receiver's buffers
        sender.submit_send(small.address, fits).wait(T)
        assert small.recv(T).data == fits
        for _ in range(5):  # (more than its receive buffers: none is lost to them)
            with pytest.raises(
                TransportError, match=r"takes 25\d{3} bytes and the peer's receive buffers hold 16\d{3}"
            ) as err:
                sender.submit_send(small.address, big).wait(T)
            assert type(err.value) is TransportError
            assert err.value.peer == small.address.raw.hex()
        sender.submit_send(small.address, b"after").wait(T)
        assert small.recv(T).data == b"after"
        assert int(small._core.stats()["frames_truncated"]) == 0
        # a receiver that takes it gets it whole (after one question for its size)
        with efa_engine(provider) as roomy:
            sender.submit_send(roomy.address, big).wait(T)
            got = roomy.recv(T)
            assert (got.peer, got.data) == (sender.address, big)
            sender.submit_send(roomy.address, big[::-1]).wait(T)  # (asked once: known now)
            assert roomy.recv(T).data == big[::-1]
        # and the sender goes on: writes and messages to the small receiver
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        src_mr, dst_mr = sender.register(src), small.register(dst)
        sender.submit_write(src_mr, 0, 64, dst_mr.descriptor, 0, imm=4).wait(T)
        small.counter(4).wait(1, timeout=T)
        assert np.array_equal(dst, src)
        small.submit_send(sender.address, fits[:64]).wait(T)  # (its own max_send_size)
        assert sender.recv(T).data == fits[:64]
        sender.deregister(src_mr)
        small.deregister(dst_mr)


def test_a_large_message_to_a_closed_engine_of_this_process_fails_at_once(efa_engine: EngineFactory) -> None:
    """On shm an engine of this process that closed is known as such (its memory is gone): a
    large message to it fails at once, as a small one does, rather than waiting for a size it
    will never be told. (On tcp a closed peer is found by the liveness probes, for a message
    of any size.)"""
    with efa_engine("shm") as sender:
        gone = efa_engine("shm")
        address = gone.address
        gone.close()
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match="closed"):
            sender.submit_send(address, bytes(20000)).wait(T)
        assert time.monotonic() - t0 < 5.0
