"""Typed data models of the contract: addresses, devices, NICs, topology, descriptors."""

from __future__ import annotations

import struct
import zlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from .errors import ConfigError

__all__ = [
    "DESCRIPTOR_VERSION",
    "Capabilities",
    "Device",
    "DomainAddress",
    "DomainInfo",
    "MemoryRegion",
    "MemoryRegionDescriptor",
    "NicKey",
    "TopologyGroup",
]

U64 = Annotated[int, Field(ge=0, lt=1 << 64)]
_FROZEN = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="hex", val_json_bytes="hex")


class Device(BaseModel):
    """Where memory lives: host memory (``cpu``) or a CUDA device with its index."""

    model_config = _FROZEN

    kind: Literal["cpu", "cuda"] = "cpu"
    index: Annotated[int, Field(ge=0, lt=1 << 16)] = 0

    @classmethod
    def parse(cls, value: Device | str | Any) -> Device:
        """Accept a ``Device``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``."""
        if isinstance(value, Device):
            return value
        text = str(value)
        kind, sep, index = text.partition(":")
        if text == "cpu":
            return cls()
        # ASCII digits only: str.isdigit() also holds for '²', which int() refuses
        if kind == "cuda" and (not sep or (index.isascii() and index.isdigit() and int(index) < 1 << 16)):
            return cls(kind="cuda", index=int(index or 0))
        raise ConfigError(f"unknown device {text!r}: use 'cpu', 'cuda' or 'cuda:N' (0 <= N < 65536)")

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


CPU = Device()


class DomainAddress(BaseModel):
    """Opaque bytes naming one NIC of a peer engine; ``str()`` is hex and round-trips."""

    model_config = _FROZEN

    raw: Annotated[bytes, Field(min_length=1, max_length=255)]

    @classmethod
    def from_hex(cls, text: str) -> DomainAddress:
        try:
            return cls(raw=bytes.fromhex(text))
        except ValueError as exc:
            raise ConfigError(f"not a hex DomainAddress: {text!r} ({exc})") from None

    def __bytes__(self) -> bytes:
        return self.raw

    def __str__(self) -> str:
        return self.raw.hex()

    def __repr__(self) -> str:
        return f"DomainAddress({self.raw.hex()!r})"


class DomainInfo(BaseModel):
    """One NIC (a *domain*) as the backend sees it."""

    model_config = _FROZEN

    name: str
    provider: str
    link_speed_gbps: float | None = None
    numa_node: int | None = None
    pci_bus_id: str | None = None
    max_msg_size: Annotated[int, Field(gt=0)]
    details: dict[str, str | int | bool] = Field(default_factory=dict)
    """Provider limits and modes worth knowing (e.g. libfabric's inject size, queue depth,
    memory-registration mode); free-form, for people and logs."""


class TopologyGroup(BaseModel):
    """The NICs and CPUs that serve one GPU (or host memory), used as one group."""

    model_config = _FROZEN

    device: Device = CPU
    numa_node: int | None = None
    domains: tuple[DomainInfo, ...]
    cpus: tuple[int, ...] = ()


class Capabilities(BaseModel):
    """What an engine can do. Conformance tests skip on these flags, never on names."""

    model_config = _FROZEN

    backend: str
    num_nics: Annotated[int, Field(ge=1)]
    max_msg_size: Annotated[int, Field(gt=0)]
    """Largest single work request; larger shards are split (each piece carries the imm)."""
    imm_bits: int = 32
    max_send_size: Annotated[int, Field(gt=0)] = 65536
    """Largest two-sided control message."""
    host_memory: bool = True
    cuda_memory: bool = False
    ordered: bool = False
    """Always False: no backend promises any ordering, whatever its transport does."""
    virtual_clock: bool = False
    """The backend reports simulated time (the simulator with a link model)."""


class NicKey(BaseModel):
    """How to reach a memory region through one NIC: that NIC's address and remote key."""

    model_config = _FROZEN

    address: DomainAddress
    rkey: U64


DESCRIPTOR_VERSION: Literal[1] = 1
_MAGIC = b"FBMR"
_HEADER = struct.Struct("<4sBBHHQQ")  # magic, version, flags, device index, nics, ptr, len
_NIC_KEY = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_FLAG_WRITABLE = 1
_FLAG_CUDA = 2
_KNOWN_FLAGS = _FLAG_WRITABLE | _FLAG_CUDA


class MemoryRegionDescriptor(BaseModel):
    """What a peer needs to write into a registered region: base, length, one key per NIC.

    Versioned; ``to_bytes()``/``from_bytes()`` give a compact checksummed form,
    ``model_dump_json()``/``from_json()`` a readable one. Malformed input raises
    ``ConfigError`` (a ``ValueError``) naming what is wrong.
    """

    model_config = _FROZEN

    version: Literal[1] = DESCRIPTOR_VERSION
    ptr: U64
    length: U64
    device: Device = CPU
    writable: bool = True
    nics: Annotated[tuple[NicKey, ...], Field(min_length=1, max_length=64)]

    @property
    def peer(self) -> DomainAddress:
        """Address of the owning engine's first NIC (its main address)."""
        return self.nics[0].address

    def to_bytes(self) -> bytes:
        flags = (_FLAG_WRITABLE if self.writable else 0) | (_FLAG_CUDA if self.device.kind == "cuda" else 0)
        parts = [
            _HEADER.pack(
                _MAGIC, self.version, flags, self.device.index, len(self.nics), self.ptr, self.length
            )
        ]
        for nic in self.nics:
            raw = nic.address.raw
            parts.append(bytes((len(raw),)) + raw + _NIC_KEY.pack(nic.rkey))
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def __bytes__(self) -> bytes:
        return self.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> MemoryRegionDescriptor:
        data = bytes(data)
        name = "MemoryRegionDescriptor"
        if len(data) < 5:
            raise ConfigError(f"{name}: truncated: {len(data)} bytes, the header alone is {_HEADER.size}")
        if data[:4] != _MAGIC:
            raise ConfigError(f"{name}: not a descriptor (magic {data[:4]!r}, expected {_MAGIC!r})")
        if data[4] != DESCRIPTOR_VERSION:
            raise ConfigError(
                f"{name}: foreign version {data[4]} (this fabric-core reads version "
                f"{DESCRIPTOR_VERSION}); upgrade the older side"
            )
        if len(data) < _HEADER.size + _CRC.size:
            raise ConfigError(f"{name}: truncated: {len(data)} bytes, the header alone is {_HEADER.size}")
        _, version, flags, dev_index, count, ptr, length = _HEADER.unpack_from(data)
        pos = _HEADER.size
        keys = []
        for i in range(count):
            if pos >= len(data):
                raise ConfigError(f"{name}: truncated in NIC entry {i} of {count}")
            alen = data[pos]
            end = pos + 1 + alen + _NIC_KEY.size
            if end > len(data):
                raise ConfigError(f"{name}: truncated in NIC entry {i} of {count}")
            (rkey,) = _NIC_KEY.unpack_from(data, pos + 1 + alen)
            keys.append((data[pos + 1 : pos + 1 + alen], rkey))
            pos = end
        if len(data) < pos + _CRC.size:
            raise ConfigError(f"{name}: truncated: {len(data)} bytes, {pos + _CRC.size} expected")
        if len(data) > pos + _CRC.size:
            raise ConfigError(f"{name}: {len(data) - pos - _CRC.size} unexpected trailing bytes")
        (crc,) = _CRC.unpack_from(data, pos)
        if zlib.crc32(data[:pos]) != crc:
            raise ConfigError(f"{name}: corrupted: checksum mismatch")
        if flags & ~_KNOWN_FLAGS:
            raise ConfigError(f"{name}: unknown flags {flags:#x}")
        try:
            return cls(
                version=version,
                ptr=ptr,
                length=length,
                device=Device(kind="cuda" if flags & _FLAG_CUDA else "cpu", index=dev_index),
                writable=bool(flags & _FLAG_WRITABLE),
                nics=tuple(NicKey(address=DomainAddress(raw=a), rkey=k) for a, k in keys),
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(part) for part in err["loc"])
            raise ConfigError(f"{name}: invalid field: {where}: {err['msg']}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> MemoryRegionDescriptor:
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "document"
            raise ConfigError(f"MemoryRegionDescriptor JSON: {where}: {err['msg']}") from None


class MemoryRegion(BaseModel):
    """A local registration. Keep it (or deregister it) as long as peers may write into it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    handle: int
    ptr: U64
    length: U64
    device: Device = CPU
    writable: bool = True
    descriptor: MemoryRegionDescriptor
    _keepalive: object = PrivateAttr(default=None)
    _engine_id: int = PrivateAttr(default=0)

    def __repr__(self) -> str:
        return (
            f"MemoryRegion(handle={self.handle}, ptr={self.ptr:#x}, length={self.length}, "
            f"device={self.device})"
        )
