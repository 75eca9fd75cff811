"""Worker process of ``fabric_core.testing.remote``: hosts engines and runs calls on them.

``python -m fabric_core.testing._worker SOCKET_FD ARENA_FD ARENA_BYTES``. Calls arrive as
``(call id, engine id, method, args)``; replies and events (transfer completions, ``expect``
firings) go back on the same socket. Calls that block (counter waits, ``recv``, ``close``) run
on their own thread so the next call is read at once. When the socket closes, every engine
here is closed and the process exits.
"""

from __future__ import annotations

import io
import itertools
import mmap
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..api import TransferEngine
from ..counters import Expectation
from ..memory import RawMemory
from ..models import Device, MemoryRegion
from ..ops import PeerGroup
from ..registry import open_engine
from ..transfer import Transfer
from .remote import dump_error

_BLOCKING = frozenset({"counter_wait", "wait_counts", "recv", "close", "fence", "cancel"})


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, worker: _Worker) -> None:
        super().__init__(file)
        self._worker = worker

    def persistent_load(self, pid: Any) -> Any:
        return self._worker.resolve(pid)


class _Worker:
    def __init__(self, conn: Connection, arena: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        self.conn, self.arena = conn, arena
        self.send_lock = threading.Lock()
        self.engines: dict[int, TransferEngine] = {}
        self.regions: dict[int, tuple[int, MemoryRegion]] = {}  # handle -> (engine id, region)
        self.groups: dict[int, tuple[int, PeerGroup]] = {}
        self.expects: dict[tuple[int, int], Expectation] = {}
        self.transfers: dict[int, Transfer] = {}  # running, by id (for cancel)
        self.stand_ins = itertools.count(-1, -1)

    # wire ------------------------------------------------------------------------------
    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                pass  # the parent is gone; the read loop ends too

    def loads(self, data: bytes) -> Any:
        return _Unpickler(io.BytesIO(data), self).load()

    def resolve(self, pid: Any) -> Any:
        """The object a reference from the parent names (see ``remote._Pickler``)."""
        kind, handle, extra = pid
        if kind == "mr":
            known = self.regions.get(handle)
            if known is not None:
                return known[1]
            # a region no engine here registered: an equal-looking stand-in, which every
            # engine refuses as "not registered with this engine"
            return MemoryRegion.model_validate({**extra, "handle": next(self.stand_ins)})
        if kind == "group":
            group = self.groups.get(handle)
            if group is not None:
                return group[1]
            return PeerGroup(next(self.stand_ins), (), frozenset(extra))
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")

    def serve(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                cid, eid, method, args = self.loads(data)
            except Exception as exc:  # a message we cannot read: answer nothing, say why
                sys.stderr.write(f"fabric test worker: unreadable call: {exc!r}\n")
                continue
            if method in _BLOCKING:
                threading.Thread(target=self.run, args=(cid, eid, method, args), daemon=True).start()
            else:
                self.run(cid, eid, method, args)
        for engine in list(self.engines.values()):
            try:
                engine.close(timeout=2.0)
            except Exception as exc:
                sys.stderr.write(f"fabric test worker: close failed: {exc!r}\n")

    def run(self, cid: int, eid: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            fn: Callable[..., Any] = getattr(self, f"m_{method}")
            value = fn(eid, *args)
        except BaseException as exc:
            self.send(("reply", cid, False, dump_error(exc)))
        else:
            self.send(("reply", cid, True, value))

    # calls ------------------------------------------------------------------------------
    def m_ping(self, eid: int) -> bool:
        return True

    def m_open(self, eid: int, config: dict[str, Any]) -> tuple[Any, ...]:
        engine = open_engine(**config)
        self.engines[eid] = engine
        return engine.addresses, engine.capabilities, engine.domains

    def m_forget(self, eid: int) -> None:
        engine = self.engines.pop(eid, None)
        if engine is not None and not engine.closed:
            engine.close(timeout=2.0)
        for handle in [h for h, (owner, _) in self.regions.items() if owner == eid]:
            del self.regions[handle]
        for handle in [h for h, (owner, _) in self.groups.items() if owner == eid]:
            del self.groups[handle]
        for key in [k for k in self.expects if k[0] == eid]:
            del self.expects[key]

    def _fields(self, eid: int, handle: int, region: MemoryRegion) -> dict[str, Any]:
        self.regions[handle] = (eid, region)
        return region.model_dump()

    def m_register(
        self, eid: int, handle: int, offset: int, length: int, mutable: bool, writable: bool | None
    ) -> dict[str, Any]:
        view = self.arena[offset : offset + length]
        if not mutable:
            view = view.view()
            view.flags.writeable = False
        return self._fields(eid, handle, self.engines[eid].register(view, writable=writable))

    def m_register_raw(
        self, eid: int, handle: int, ptr: int, length: int, device: str, writable: bool | None
    ) -> dict[str, Any]:
        region = self.engines[eid].register(RawMemory(ptr, length, Device.parse(device)), writable=writable)
        return self._fields(eid, handle, region)

    def m_deregister(self, eid: int, region: MemoryRegion) -> None:
        self.engines[eid].deregister(region)

    def m_rekey(self, eid: int, region: MemoryRegion, handle: int) -> dict[str, Any]:
        fresh = self.engines[eid].rekey(region)
        self.regions = {h: v for h, v in self.regions.items() if v[1] is not region}
        return self._fields(eid, handle, fresh)

    def m_fence(self, eid: int, peers: list[Any], timeout: float | None) -> None:
        self.engines[eid].fence(peers, timeout=timeout)

    def m_dump_state(self, eid: int) -> dict[str, Any]:
        return self.engines[eid].dump_state()

    def _track(self, eid: int, transfer: Transfer) -> tuple[int, tuple[int, ...]]:
        tid = transfer.id
        self.transfers[tid] = transfer
        transfer.on_done(lambda _t: self._ended(eid, tid, None))
        transfer.on_error(lambda _t, exc: self._ended(eid, tid, dump_error(exc)))
        return tid, transfer.imms_per_target

    def _ended(self, eid: int, tid: int, error: bytes | None) -> None:
        self.transfers.pop(tid, None)
        self.send(("xfer", eid, tid, error))

    def m_cancel(self, eid: int, tid: int, timeout: float | None) -> bool:
        transfer = self.transfers.get(tid)
        return transfer.cancel(timeout) if transfer is not None else False

    def m_submit(self, eid: int, request: Any, timeout: float | None = None) -> tuple[int, tuple[int, ...]]:
        return self._track(eid, self.engines[eid].submit(request, timeout=timeout))

    def m_submit_send(
        self, eid: int, peer: Any, data: bytes, timeout: float | None = None
    ) -> tuple[int, tuple[int, ...]]:
        return self._track(eid, self.engines[eid].submit_send(peer, data, timeout=timeout))

    def m_peer_group(self, eid: int, handle: int, peers: list[Any]) -> tuple[Any, ...]:
        group = self.engines[eid].peer_group(peers)
        self.groups[handle] = (eid, group)
        return group.peers

    def m_counter_value(self, eid: int, imm: int) -> int:
        return self.engines[eid].counter(imm).value

    def m_counter_wait(self, eid: int, imm: int, n: int, timeout: float | None, peer: Any) -> None:
        self.engines[eid].counter(imm).wait(n, timeout, peer=peer)

    def m_wait_counts(self, eid: int, waits: list[Any], timeout: float | None) -> None:
        self.engines[eid].wait_counts(waits, timeout)

    def m_expect(self, eid: int, imm: int, n: int, xid: int, peer: Any) -> None:
        def fired() -> None:
            self.send(("expect", eid, xid, None))

        def failed(exc: BaseException) -> None:
            self.send(("expect", eid, xid, dump_error(exc)))

        self.expects[(eid, xid)] = self.engines[eid].counter(imm).expect(n, fired, on_error=failed, peer=peer)

    def m_expect_fired(self, eid: int, xid: int) -> bool:
        return self.expects[(eid, xid)].fired

    def m_expect_cancel(self, eid: int, xid: int) -> bool:
        return self.expects[(eid, xid)].cancel()

    def m_stats(self, eid: int) -> Any:
        return self.engines[eid].stats()

    def m_recv(self, eid: int, timeout: float | None) -> Any:
        return self.engines[eid].recv(timeout)

    def m_close(self, eid: int, timeout: float | None) -> None:
        self.engines[eid].close(timeout)


def main(argv: list[str]) -> int:
    sock_fd, arena_fd, size = (int(a) for a in argv[1:4])
    conn = Connection(sock_fd)
    mapping = mmap.mmap(arena_fd, size)
    arena: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(mapping, dtype=np.uint8)
    _Worker(conn, arena).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
