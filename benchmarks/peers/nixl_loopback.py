"""NIXL, UCX backend, one-sided writes (DRAM to DRAM) between two processes on one host.

Run with the peers venv: ``/tmp/peers/bin/python benchmarks/peers/nixl_loopback.py [--reps N]``.
The target's agent metadata goes to the initiator over the harness pipe (``add_remote_agent``), so
no NIXL listener thread or etcd is involved. Each window is one prepared transfer request
(``make_prepped_xfer``) reposted with ``transfer`` and polled with ``check_xfer_state``.

UCX is pinned per run with environment variables, set before either agent exists:
``tcp`` is UCX_TLS=tcp on the loopback device (UCX_NET_DEVICES=lo); ``shm`` is UCX_TLS=shm (UCX's
shared-memory transports: posix/sysv segments and CMA), which cannot serve NIXL's default
``ucx_error_handling_mode=peer`` (no peer failure handler), so that run sets it to ``none``.

UCX_MODULES=^efa keeps UCX from loading its EFA module: that module links the system's libefa,
libibverbs and libnl next to the wheel's bundled copies, and the process then crashes in libnl's
destructor at exit (only where rdma-core is installed, as here).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from importlib.metadata import version
from multiprocessing.connection import Connection

import _harness as h
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

WAIT_S = 10.0


@dataclass(frozen=True)
class Pinning:
    env: dict[str, str]
    params: dict[str, str]

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in {**self.env, **self.params}.items())


PINNINGS = {
    "tcp": Pinning({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, {}),
    "shm": Pinning({"UCX_TLS": "shm"}, {"ucx_error_handling_mode": "none"}),
}


def _agent(name: str, params: dict[str, str], buf: np.ndarray) -> nixl_agent:
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", params)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    return agent


def _target(conn: Connection, params: dict[str, str]) -> None:
    buf = np.zeros(h.BUFFER_BYTES, dtype=np.uint8)
    agent = _agent("target", params, buf)
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    h.serve(conn, buf)


def _bench(name: str, pinning: Pinning, args: argparse.Namespace) -> None:
    os.environ.update(pinning.env)
    with h.target_process(_target, pinning.params) as conn:
        metadata, remote_base = h.recv(conn)
        src = h.source_buffer()
        agent = _agent(f"initiator-{name}", pinning.params, src)
        remote = agent.add_remote_agent(metadata)

        def make_writer(size: int, slots: list[h.Slot]) -> h.Writer:
            local_list = [(src.ctypes.data + s.local, size, 0) for s in slots]
            remote_list = [(remote_base + s.remote, size, 0) for s in slots]
            local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_list, "DRAM")
            remote_side = agent.prep_xfer_dlist(remote, remote_list, "DRAM")
            indices = list(range(len(slots)))
            handle = agent.make_prepped_xfer("WRITE", local_side, indices, remote_side, indices)

            def write() -> None:
                state = agent.transfer(handle)
                deadline = time.monotonic() + WAIT_S
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL write window of {size} B not done in {WAIT_S:.0f} s")
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer state {state}")

            return write

        labels = {"peer": "nixl-ucx", "version": version("nixl"), "transport": pinning.label()}
        h.run(conn, src, make_writer, args, labels)
        agent.remove_remote_agent(remote)


def _flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--transports",
        nargs="+",
        choices=sorted(PINNINGS),
        default=list(PINNINGS),
        help="UCX pinnings to run",
    )


def main() -> None:
    args = h.setup(__doc__ or "", _flags)
    os.environ["UCX_MODULES"] = "^efa"
    for name in args.transports:
        _bench(name, PINNINGS[name], args)


if __name__ == "__main__":
    main()
