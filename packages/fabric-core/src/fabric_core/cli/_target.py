"""The receiving side of ``fabric bench``: an engine in this process, or one in a server process
(another host, or a child process) driven over a small control connection.

The control connection carries JSON lines, never code (so a bench server listening on a
cluster network runs nothing but these requests):

``hello``         the server's backend, version, NIC count and address
``setup``         register a zeroed target buffer of ``bytes``; learn the client's ack region
``ack``           wait for ``n`` imms ``imm``, consuming them, then write imm ``back`` to the
                  client: completion of a window is signalled over the fabric, not over TCP
``echo``          until ``stop_echo``: for every ``n`` imms ``imm``, write imm ``back`` (the
                  latency phase measures a round trip on the fabric alone)
``value``         imms ``imm`` counted and not consumed
``zero``/``digest``  clear, or SHA-256, a range of the target buffer (data checks)
``bye``           deregister, close, exit

Every reply is one JSON object; a failure is ``{"error": type, "message": ...}`` and is raised
at the client as the same fabric error type where there is one.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .. import errors
from ..api import TransferEngine
from ..errors import FabricError, TransferTimeout
from ..models import MemoryRegion, MemoryRegionDescriptor
from ..transfer import Transfer

__all__ = ["LocalTarget", "RemoteTarget", "Target", "serve_target"]

ACK_IMM = 0xFAAC_0001
ECHO_IMM = 0xFAAC_0002
_ECHO_POLL_S = 0.1


def _describe(dst: np.ndarray[Any, Any], offset: int, expected: np.ndarray[Any, Any]) -> str | None:
    got = dst[offset : offset + expected.size]
    bad = np.flatnonzero(got != expected)
    if not bad.size:
        return None
    return f"{bad.size} of {expected.size} bytes differ (first at offset {int(bad[0])})"


class Target(ABC):
    """What the sweep needs from the side that receives the writes."""

    round_trip: bool = False
    """Latency samples are round trips (write, then an imm back) rather than one-way waits."""

    @abstractmethod
    def setup(self, nbytes: int) -> MemoryRegionDescriptor:
        """Register a zeroed target buffer; its descriptor."""

    @abstractmethod
    def counted(self, imm: int, n: int, timeout: float) -> None:
        """Block until ``n`` imms ``imm`` have arrived at the target, consuming them."""

    @abstractmethod
    def leftover(self, imm: int) -> int:
        """Imms ``imm`` counted at the target and not consumed."""

    @abstractmethod
    def zero(self, length: int) -> None:
        """Clear the first ``length`` bytes of the target buffer."""

    @abstractmethod
    def mismatch(self, offset: int, expected: np.ndarray[Any, Any]) -> str | None:
        """None if the target holds ``expected`` at ``offset``, else what differs."""

    def ping(self, submit: Callable[[], Transfer], imm: int, timeout: float) -> Transfer:
        """One latency sample: submit, then wait until the target has counted it."""
        transfer = submit()
        self.counted(imm, transfer.imms_at_target, timeout)
        return transfer

    def end_ping(self, imm: int) -> None:  # noqa: B027 (an optional hook: nothing to do by default)
        """The latency phase for ``imm`` is over."""

    @abstractmethod
    def close(self) -> None: ...


class LocalTarget(Target):
    """A target engine in this process."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.dst: np.ndarray[Any, np.dtype[np.uint8]] = np.zeros(0, dtype=np.uint8)
        self._mr: MemoryRegion | None = None

    def setup(self, nbytes: int) -> MemoryRegionDescriptor:
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        self._mr = self.engine.register(self.dst)
        return self._mr.descriptor

    def counted(self, imm: int, n: int, timeout: float) -> None:
        self.engine.counter(imm).wait(n, timeout)

    def leftover(self, imm: int) -> int:
        return self.engine.counter(imm).value

    def zero(self, length: int) -> None:
        self.dst[:length] = 0

    def mismatch(self, offset: int, expected: np.ndarray[Any, Any]) -> str | None:
        return _describe(self.dst, offset, expected)

    def close(self) -> None:
        if self._mr is not None and not self.engine.closed:
            self.engine.deregister(self._mr)
        self._mr = None


def _error(reply: dict[str, Any]) -> FabricError:
    cls = getattr(errors, str(reply.get("error")), None)
    message = str(reply.get("message", "the bench server failed"))
    if isinstance(cls, type) and issubclass(cls, FabricError):
        try:
            return cls(message)
        except TypeError:  # errors whose constructor takes more than a message
            pass
    return errors.TransportError(f"bench server: {reply.get('error')}: {message}")


class Stream(Protocol):
    """A buffered byte stream (``socket.makefile("rwb")``)."""

    def readline(self, size: int = -1, /) -> bytes: ...
    def write(self, data: bytes, /) -> int: ...
    def flush(self) -> None: ...


class _Lines:
    """JSON lines over one stream."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        with self.lock:
            self.stream.write(data)
            self.stream.flush()

    def read(self) -> dict[str, Any] | None:
        line = self.stream.readline()
        if not line:
            return None
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("a control message must be a JSON object")
        return obj


class RemoteTarget(Target):
    """A target engine in a bench server, reached over ``sock``. ``writer`` is this side's
    engine: the server signals completions by writing imms back into a small region of it."""

    round_trip = True

    def __init__(self, writer: TransferEngine, sock: socket.socket, timeout: float) -> None:
        self.writer, self.sock, self.timeout = writer, sock, timeout
        sock.settimeout(timeout + 30.0)  # a dead server is an error, never a hang
        self._io = _Lines(sock.makefile("rwb"))
        self._ack_buf = np.zeros(64, dtype=np.uint8)
        self._ack_mr = writer.register(self._ack_buf)
        self.hello = self._call({"op": "hello"})
        self._echo: int | None = None
        self._echoes = writer.counter(ECHO_IMM)  # held, as a user holds the counters they wait on

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        self._io.send(request)
        return self._reply(str(request["op"]))

    def _reply(self, op: str) -> dict[str, Any]:
        try:
            reply = self._io.read()
        except OSError as exc:
            raise errors.PeerUnreachable(f"bench server did not answer {op}: {exc}") from None
        if reply is None:
            raise errors.PeerUnreachable(f"bench server closed the connection during {op}")
        if "error" in reply:
            raise _error(reply)
        return reply

    def setup(self, nbytes: int) -> MemoryRegionDescriptor:
        client = self._ack_mr.descriptor.to_bytes().hex()
        reply = self._call({"op": "setup", "bytes": nbytes, "client": client})
        return MemoryRegionDescriptor.from_bytes(bytes.fromhex(reply["descriptor"]))

    def counted(self, imm: int, n: int, timeout: float) -> None:
        self._io.send({"op": "ack", "imm": imm, "n": n, "back": ACK_IMM, "timeout": timeout})
        try:
            self.writer.counter(ACK_IMM).wait(1, timeout + 1.0)
        except TransferTimeout:
            self._reply("ack")  # the server's own error says more (what it counted)
            raise
        self._reply("ack")

    def leftover(self, imm: int) -> int:
        return int(self._call({"op": "value", "imm": imm})["value"])

    def zero(self, length: int) -> None:
        self._call({"op": "zero", "length": length})

    def mismatch(self, offset: int, expected: np.ndarray[Any, Any]) -> str | None:
        reply = self._call({"op": "digest", "offset": offset, "length": int(expected.size)})
        if reply["sha256"] == hashlib.sha256(np.ascontiguousarray(expected).tobytes()).hexdigest():
            return None
        return f"the {expected.size} bytes at offset {offset} differ (SHA-256 mismatch at the server)"

    def ping(self, submit: Callable[[], Transfer], imm: int, timeout: float) -> Transfer:
        transfer = submit()
        if self._echo != imm:
            self._call({"op": "echo", "imm": imm, "n": transfer.imms_at_target, "back": ECHO_IMM})
            self._echo = imm
        self._echoes.wait(1, timeout)
        return transfer

    def end_ping(self, imm: int) -> None:
        if self._echo is not None:
            self._call({"op": "stop_echo"})
            self._echo = None

    def close(self) -> None:
        try:
            self._call({"op": "bye"})
        finally:
            if not self.writer.closed:
                self.writer.deregister(self._ack_mr)
            self.sock.close()


class _Echo:
    def __init__(self, engine: TransferEngine, client: MemoryRegionDescriptor, req: dict[str, Any]) -> None:
        self.engine, self.client = engine, client
        self.imm, self.n, self.back = int(req["imm"]), int(req["n"]), int(req["back"])
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fabric-bench-echo", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        counter = self.engine.counter(self.imm)
        try:
            while not self.stop.is_set():
                try:
                    counter.wait(self.n, _ECHO_POLL_S)
                except TransferTimeout:
                    continue
                self.engine.submit_imm(self.client, self.back)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def serve_target(engine: TransferEngine, stream: Stream, *, backend: str, version: str) -> None:
    """Answer one client's control requests on ``stream`` until ``bye`` or end of stream."""
    io = _Lines(stream)
    dst: np.ndarray[Any, np.dtype[np.uint8]] = np.zeros(0, dtype=np.uint8)
    mr: MemoryRegion | None = None
    client: MemoryRegionDescriptor | None = None
    echo: _Echo | None = None

    def need_client() -> MemoryRegionDescriptor:
        if client is None:
            raise errors.ConfigError("send setup first")
        return client

    try:
        while True:
            req = io.read()
            if req is None:
                return
            op = req.get("op")
            reply: dict[str, Any] = {}
            try:
                if op == "hello":
                    reply = {
                        "backend": backend,
                        "version": version,
                        "nics": engine.num_nics,
                        "address": engine.address.raw.hex(),
                    }
                elif op == "setup":
                    if mr is not None:
                        engine.deregister(mr)
                        mr = None
                    client = MemoryRegionDescriptor.from_bytes(bytes.fromhex(str(req["client"])))
                    dst = np.zeros(int(req["bytes"]), dtype=np.uint8)
                    mr = engine.register(dst)
                    reply = {"descriptor": mr.descriptor.to_bytes().hex()}
                elif op == "ack":
                    back_to = need_client()
                    engine.counter(int(req["imm"])).wait(int(req["n"]), float(req["timeout"]))
                    engine.submit_imm(back_to, int(req["back"]))
                elif op == "echo":
                    if echo is not None:
                        echo.close()
                    echo = _Echo(engine, need_client(), req)
                elif op == "stop_echo":
                    if echo is not None:
                        echo.close()
                        failed, echo = echo.error, None
                        if failed is not None:
                            raise failed
                elif op == "value":
                    reply = {"value": engine.counter(int(req["imm"])).value}
                elif op == "zero":
                    dst[: int(req["length"])] = 0
                elif op == "digest":
                    lo = int(req["offset"])
                    reply = {
                        "sha256": hashlib.sha256(dst[lo : lo + int(req["length"])].tobytes()).hexdigest()
                    }
                elif op == "bye":
                    io.send({})
                    return
                else:
                    raise errors.ConfigError(f"unknown bench request {op!r}")
            except (FabricError, KeyError, TypeError, ValueError) as exc:
                reply = {"error": type(exc).__name__, "message": str(exc)}
            io.send(reply)
    finally:
        if echo is not None:
            echo.close()
        if mr is not None and not engine.closed:
            engine.deregister(mr)
