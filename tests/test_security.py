"""What docs/concepts/security.md says about descriptors and listening addresses, beyond the
conformance suite (which proves that the target's keys refuse what a descriptor must not do)."""

from __future__ import annotations

import pytest

from fabric_core.cli.bench import bench
from fabric_core.models import DomainAddress, MemoryRegionDescriptor, NicKey


def _desc() -> MemoryRegionDescriptor:
    nic = NicKey(address=DomainAddress(raw=b"\x02\x00\x12\x34"), rkey=7)
    return MemoryRegionDescriptor(ptr=0x7F00_0000_0000, length=4096, writable=False, nics=(nic,))


def test_a_well_formed_forgery_passes_validation() -> None:
    """``from_bytes`` checks form (magic, version, lengths, checksum, fields), not origin: its
    CRC-32 catches corruption, and anyone can compute it. A forged descriptor, larger and
    writable, parses; only the target's keys stand in its way."""
    forged = _desc().model_copy(update={"length": 1 << 40, "writable": True}).to_bytes()
    back = MemoryRegionDescriptor.from_bytes(forged)
    assert (back.length, back.writable, back.nics[0].rkey) == (1 << 40, True, 7)
    corrupted = bytearray(forged)
    corrupted[20] ^= 0x01  # the same change without the checksum's fix-up
    with pytest.raises(ValueError, match="checksum mismatch"):
        MemoryRegionDescriptor.from_bytes(bytes(corrupted))


def test_bench_server_listens_on_loopback_by_default() -> None:
    """``fabric bench --server`` accepts its client on 127.0.0.1 unless ``--listen`` says
    otherwise."""
    (listen,) = [p for p in bench.params if p.name == "listen"]
    assert listen.default == "127.0.0.1:0"
