"""Control messages between decode and prefill instances (two-sided ``submit_send``).

Every message starts with ``b"FKV"``, a version byte and a kind byte; integers are little
endian. The bulk data never travels here: only page indices, descriptors and outcomes.

======== ================= ===========================================================
kind     direction         body
======== ================= ===========================================================
HELLO    decode → prefill  the decoder's layout (JSON) and its per-layer descriptors
                           (zlib of the descriptors' ``to_bytes()``), once per peer
ACK      prefill → decode  accepted or why not, the prefill's NIC count, max message size
                           and layout (JSON: the decoder derives the writes it will get)
REQUEST  decode → prefill  seq, imm, expected imm count, prefix pages skipped, request id,
                           destination pages (raw u32 or runs, whichever is shorter)
CANCEL   decode → prefill  seq
DONE     prefill → decode  seq, status, whether the count is exact, imms its completed
                           writes carry, error type and message
======== ================= ===========================================================
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum
from typing import Union

import numpy as np

from fabric_core.api import TransferEngine
from fabric_core.errors import (
    ConfigError,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    RemoteAccessError,
    TransferTimeout,
    TransportError,
)
from fabric_core.models import MemoryRegionDescriptor
from fabric_core.ops import Message

from .allocator import Pages
from .errors import RequestAborted, RequestCancelled
from .layout import KvLayout

__all__ = [
    "Ack",
    "Cancel",
    "Done",
    "Hello",
    "Kind",
    "ProtocolError",
    "Request",
    "Status",
    "decode",
    "encode",
    "error_from_wire",
    "next_message",
]

logger = logging.getLogger(__name__)

MAGIC = b"FKV"
VERSION = 2  # 2: the ACK carries the prefill's layout
_HDR = struct.Struct("<3sBB")
_ACK = struct.Struct("<BHQI")
_REQ = struct.Struct("<QIQIIBH")
_SEQ = struct.Struct("<Q")
_DONE = struct.Struct("<QBBQH")
_U32 = np.dtype("<u4")
MAX_REQUEST_ID = 1024


class ProtocolError(ValueError):
    """A control message that is not a well-formed KV-cache message."""


class Kind(IntEnum):
    HELLO = 1
    ACK = 2
    REQUEST = 3
    CANCEL = 4
    DONE = 5


class Status(IntEnum):
    OK = 0
    CANCELLED = 1
    ABORTED = 2
    """The prefill's caller gave the request up."""
    FAILED = 3
    """A write failed (transport error)."""
    REJECTED = 4
    """The request was bad (ConfigError at the prefill); nothing was written."""


@dataclass(frozen=True, slots=True)
class Hello:
    layout: KvLayout
    descriptors: tuple[MemoryRegionDescriptor, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    ok: bool
    num_nics: int
    max_msg_size: int
    layout: KvLayout
    error: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    seq: int
    imm: int
    expected: int
    skip: int
    request_id: str
    pages: Pages


@dataclass(frozen=True, slots=True)
class Cancel:
    seq: int


@dataclass(frozen=True, slots=True)
class Done:
    seq: int
    status: Status
    exact: bool
    imms_sent: int
    error_type: str = ""
    message: str = ""


Msg = Union[Hello, Ack, Request, Cancel, Done]


def _runs(pages: Pages) -> tuple[Pages, Pages]:
    """Starts and lengths of the runs of consecutive indices in ``pages``."""
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    first = np.concatenate(([0], cut))
    lengths = np.diff(np.concatenate((first, [pages.size])))
    return pages[first], lengths.astype(np.int64)


def encode_pages(pages: Pages) -> tuple[int, bytes]:
    """(mode, bytes): mode 0 is raw u32 indices, mode 1 is (start, length) u32 pairs."""
    starts, lengths = _runs(pages)
    if 2 * starts.size < pages.size:
        pairs = np.empty(2 * starts.size, _U32)
        pairs[0::2], pairs[1::2] = starts, lengths
        return 1, pairs.tobytes()
    return 0, pages.astype(_U32).tobytes()


def decode_pages(mode: int, data: bytes, count: int) -> Pages:
    if len(data) % 4:
        raise ProtocolError("page list is not a whole number of u32")
    raw = np.frombuffer(data, _U32).astype(np.int64)
    if mode == 0:
        out = raw
    elif mode == 1:
        if raw.size % 2:
            raise ProtocolError("page runs are not (start, length) pairs")
        starts, lengths = raw[0::2], raw[1::2]
        if (lengths < 1).any():
            raise ProtocolError("a page run is empty")
        total = int(lengths.sum())
        if total != count:
            raise ProtocolError(f"page runs hold {total} pages, the header says {count}")
        offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        out = offsets + np.arange(total, dtype=np.int64)
    else:
        raise ProtocolError(f"unknown page encoding {mode}")
    if out.size != count:
        raise ProtocolError(f"page list holds {out.size} pages, the header says {count}")
    return out


def _str(data: bytes, what: str) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} is not UTF-8") from None


def encode(msg: Msg) -> bytes:
    if isinstance(msg, Hello):
        blob = b"".join(struct.pack("<H", len(b)) + b for b in (d.to_bytes() for d in msg.descriptors))
        layout = msg.layout.to_json().encode()
        body = struct.pack("<IH", len(layout), len(msg.descriptors)) + layout + zlib.compress(blob)
        return _HDR.pack(MAGIC, VERSION, Kind.HELLO) + body
    if isinstance(msg, Ack):
        layout = msg.layout.to_json().encode()
        return (
            _HDR.pack(MAGIC, VERSION, Kind.ACK)
            + _ACK.pack(msg.ok, msg.num_nics, msg.max_msg_size, len(layout))
            + layout
            + msg.error.encode()
        )
    if isinstance(msg, Request):
        rid = msg.request_id.encode()
        if len(rid) > MAX_REQUEST_ID:
            raise ConfigError(f"request id is {len(rid)} bytes, at most {MAX_REQUEST_ID} are allowed")
        mode, pages = encode_pages(msg.pages)
        head = _REQ.pack(msg.seq, msg.imm, msg.expected, msg.skip, msg.pages.size, mode, len(rid))
        return _HDR.pack(MAGIC, VERSION, Kind.REQUEST) + head + rid + pages
    if isinstance(msg, Cancel):
        return _HDR.pack(MAGIC, VERSION, Kind.CANCEL) + _SEQ.pack(msg.seq)
    etype = msg.error_type.encode()
    head = _DONE.pack(msg.seq, msg.status, msg.exact, msg.imms_sent, len(etype))
    return _HDR.pack(MAGIC, VERSION, Kind.DONE) + head + etype + msg.message.encode()[:4096]


def decode(data: bytes) -> Msg:
    """Parse a control message; ``ProtocolError`` if it is not one of ours or is malformed."""
    if len(data) < _HDR.size:
        raise ProtocolError(f"{len(data)} bytes: too short for a KV-cache message")
    magic, version, kind = _HDR.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a KV-cache message (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"KV-cache protocol version {version}, this side speaks {VERSION}")
    body = data[_HDR.size :]
    try:
        if kind == Kind.HELLO:
            n_layout, count = struct.unpack_from("<IH", body)
            at = 6 + n_layout
            layout = KvLayout.from_json(body[6:at])
            blob = zlib.decompress(body[at:])
            descs, pos = [], 0
            for _ in range(count):
                (n,) = struct.unpack_from("<H", blob, pos)
                descs.append(MemoryRegionDescriptor.from_bytes(blob[pos + 2 : pos + 2 + n]))
                pos += 2 + n
            if pos != len(blob):
                raise ProtocolError("trailing bytes after the descriptors")
            return Hello(layout, tuple(descs))
        if kind == Kind.ACK:
            ok, nics, max_msg, n_layout = _ACK.unpack_from(body)
            at = _ACK.size + n_layout
            if at > len(body):
                raise ProtocolError(f"malformed ACK: a {n_layout}-byte layout in {len(body)} bytes")
            layout = KvLayout.from_json(body[_ACK.size : at])
            return Ack(bool(ok), nics, max_msg, layout, _str(body[at:], "ack error"))
        if kind == Kind.REQUEST:
            seq, imm, expected, skip, count, mode, n_rid = _REQ.unpack_from(body)
            rid = _str(body[_REQ.size : _REQ.size + n_rid], "request id")
            pages = decode_pages(mode, body[_REQ.size + n_rid :], count)
            return Request(seq, imm, expected, skip, rid, pages)
        if kind == Kind.CANCEL:
            (seq,) = _SEQ.unpack_from(body)
            return Cancel(seq)
        if kind == Kind.DONE:
            seq, status, exact, sent, n_type = _DONE.unpack_from(body)
            etype = _str(body[_DONE.size : _DONE.size + n_type], "error type")
            return Done(
                seq, Status(status), bool(exact), sent, etype, _str(body[_DONE.size + n_type :], "error")
            )
    except (struct.error, zlib.error, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(
            f"malformed {Kind(kind).name if kind in Kind._value2member_map_ else kind}: {exc}"
        ) from None
    raise ProtocolError(f"unknown KV-cache message kind {kind}")


_WIRE_ERRORS: dict[str, type[FabricError]] = {
    cls.__name__: cls
    for cls in (
        ConfigError,
        EngineClosed,
        PeerUnreachable,
        RemoteAccessError,
        TransferTimeout,
        TransportError,
        RequestAborted,
        RequestCancelled,
    )
}


def next_message(engine: TransferEngine, timeout: float | None, who: str) -> tuple[Message, Msg] | None:
    """The next control message on ``engine``, decoded; None if none came within ``timeout``
    or it was not one of ours (logged and dropped). ``EngineClosed`` propagates."""
    try:
        message = engine.recv(timeout=timeout)
    except TransferTimeout:
        return None
    except EngineClosed:
        raise
    except Exception:
        logger.exception("kvcache: %s receive failed", who)
        return None
    try:
        return message, decode(message.data)
    except ProtocolError as exc:
        logger.warning("kvcache: dropped a message from %s: %s", message.peer, exc)
        return None


def error_name(exc: BaseException) -> str:
    """The most specific wire-known class of ``exc`` (``TransportError`` if none)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _WIRE_ERRORS and issubclass(cls, FabricError):
            return cls.__name__
    return TransportError.__name__


def error_from_wire(done: Done, peer: str) -> FabricError:
    """The typed error a DONE that is not OK stands for, at the decoder."""
    text = f"prefill {peer} reports: {done.message or done.status.name.lower()}"
    if done.status == Status.ABORTED:
        return RequestAborted(text, peer=peer)
    if done.status == Status.CANCELLED:
        return RequestCancelled(text)
    cls = _WIRE_ERRORS.get(done.error_type, TransportError)
    if issubclass(cls, TransportError):
        return cls(text, peer=peer)
    return cls(text)
