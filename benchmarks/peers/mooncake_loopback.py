"""Mooncake Transfer Engine, TCP transport, one-sided writes between two processes on 127.0.0.1.

Run with the peers venv: ``/tmp/peers/bin/python benchmarks/peers/mooncake_loopback.py [--reps N]``.
Both engines use the P2P handshake ("P2PHANDSHAKE") for metadata, so no etcd or HTTP metadata
server is needed: the target's session id is ``127.0.0.1:<rpc port>``. Every synchronous transfer is
bounded by ``MC_TRANSFER_TIMEOUT`` (seconds, Mooncake's own knob; set to 10 here unless given).
"""

from __future__ import annotations

import os
from importlib.metadata import version
from multiprocessing.connection import Connection

import _harness as h
import numpy as np
from mooncake.engine import TransferEngine

PACKAGE = "mooncake-transfer-engine-non-cuda"
HOST = "127.0.0.1"
PROTOCOL = "tcp"


def _engine() -> TransferEngine:
    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", PROTOCOL, "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize failed")
    return engine


def _register(engine: TransferEngine, buf: np.ndarray) -> None:
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("Mooncake register_memory failed")


def _target(conn: Connection) -> None:
    engine = _engine()
    buf = np.zeros(h.BUFFER_BYTES, dtype=np.uint8)
    _register(engine, buf)
    conn.send((f"{HOST}:{engine.get_rpc_port()}", buf.ctypes.data))
    h.serve(conn, buf)


def main() -> None:
    args = h.setup(__doc__ or "")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "10")
    with h.target_process(_target) as conn:
        session, remote_base = h.recv(conn)
        engine = _engine()
        src = h.source_buffer()
        _register(engine, src)

        def make_writer(size: int, slots: list[h.Slot]) -> h.Writer:
            local = [src.ctypes.data + s.local for s in slots]
            remote = [remote_base + s.remote for s in slots]
            lengths = [size] * len(slots)

            def write() -> None:
                rc = engine.batch_transfer_sync_write(session, local, remote, lengths)
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

            return write

        labels = {"peer": "mooncake-tcp", "version": version(PACKAGE), "transport": PROTOCOL}
        h.run(conn, src, make_writer, args, labels)


if __name__ == "__main__":
    main()
