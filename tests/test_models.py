"""Unit tests of fabric_core.models: addresses, devices, descriptors and their encodings."""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import fabric_core
from fabric_core import (
    Capabilities,
    ConfigError,
    Device,
    DomainAddress,
    DomainInfo,
    MemoryRegion,
    MemoryRegionDescriptor,
    NicKey,
    TopologyGroup,
)
from fabric_core.models import DESCRIPTOR_VERSION

HEADER = struct.Struct("<4sBBHHQQ")
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def addr(raw: bytes) -> DomainAddress:
    return DomainAddress(raw=raw)


def make_desc(
    nics: int = 1,
    *,
    ptr: int = 0x7F00_0000_1000,
    length: int = 1 << 20,
    device: Device | None = None,
    writable: bool = True,
) -> MemoryRegionDescriptor:
    keys = tuple(
        NicKey(address=addr(bytes([0xA0 + i]) * (i + 2)), rkey=(0x1111_0000 + i) * (i + 1))
        for i in range(nics)
    )
    return MemoryRegionDescriptor(
        ptr=ptr, length=length, device=device or Device(), writable=writable, nics=keys
    )


def with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def encode(
    *,
    magic: bytes = b"FBMR",
    version: int = 1,
    flags: int = 1,
    dev_index: int = 0,
    count: int | None = None,
    ptr: int = 0x1000,
    length: int = 4096,
    entries: tuple[tuple[bytes, int], ...] = ((b"\x01\x02", 7),),
    extra: bytes = b"",
) -> bytes:
    """Hand-made encoding (with a valid CRC) to reach checks behind the checksum."""
    n = len(entries) if count is None else count
    body = HEADER.pack(magic, version, flags, dev_index, n, ptr, length)
    for raw, rkey in entries:
        body += bytes((len(raw),)) + raw + struct.pack("<Q", rkey)
    return with_crc(body + extra)


# --------------------------------------------------------------------------- DomainAddress


class TestDomainAddress:
    def test_str_is_hex_and_round_trips(self) -> None:
        a = addr(b"\x00\x01\xfe\xff")
        assert str(a) == "0001feff"
        assert DomainAddress.from_hex(str(a)) == a
        assert DomainAddress.from_hex("0001FEFF") == a
        assert repr(a) == "DomainAddress('0001feff')"

    def test_bytes(self) -> None:
        a = addr(b"\x10\x20\x30")
        assert bytes(a) == b"\x10\x20\x30"
        assert a.raw == b"\x10\x20\x30"

    def test_json_is_hex(self) -> None:
        a = addr(b"\xab\xcd")
        assert a.model_dump_json() == '{"raw":"abcd"}'
        assert DomainAddress.model_validate_json('{"raw":"abcd"}') == a

    @pytest.mark.parametrize("text", ["zz", "0", "abc", "0x01", "g1"])
    def test_from_hex_rejects_non_hex(self, text: str) -> None:
        with pytest.raises(ValueError, match="not a hex DomainAddress") as info:
            DomainAddress.from_hex(text)
        assert repr(text) in str(info.value)

    def test_from_hex_rejects_empty_and_too_long(self) -> None:
        with pytest.raises(ValueError, match=r"(?s)not a hex DomainAddress.*at least 1 byte"):
            DomainAddress.from_hex("")
        with pytest.raises(ValueError, match=r"(?s)not a hex DomainAddress.*at most 255 bytes"):
            DomainAddress.from_hex("00" * 256)
        assert len(DomainAddress.from_hex("ff" * 255).raw) == 255

    def test_length_bounds(self) -> None:
        with pytest.raises(ValidationError, match="at least 1 byte"):
            DomainAddress(raw=b"")
        with pytest.raises(ValidationError, match="at most 255 bytes"):
            DomainAddress(raw=b"\x00" * 256)
        assert DomainAddress(raw=b"\x00").raw == b"\x00"
        assert DomainAddress(raw=b"\x07" * 255).raw == b"\x07" * 255

    def test_equality_and_hash(self) -> None:
        a, b, c = addr(b"\x01\x02"), addr(b"\x01\x02"), addr(b"\x01\x03")
        assert a == b and hash(a) == hash(b)
        assert a != c
        assert a is not b
        assert len({a, b, c}) == 2
        assert {a: 1}[b] == 1

    def test_frozen_and_no_extra(self) -> None:
        a = addr(b"\x01")
        with pytest.raises(ValidationError, match="frozen"):
            a.raw = b"\x02"  # type: ignore[misc]
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            DomainAddress(raw=b"\x01", other=1)  # type: ignore[call-arg]

    def test_pickle(self) -> None:
        a = addr(b"\x09\x08")
        assert pickle.loads(pickle.dumps(a)) == a


# --------------------------------------------------------------------------- Device


class TestDevice:
    def test_parse_strings(self) -> None:
        assert Device.parse("cpu") == Device(kind="cpu", index=0)
        assert Device.parse("cuda") == Device(kind="cuda", index=0)
        assert Device.parse("cuda:1") == Device(kind="cuda", index=1)
        assert Device.parse("cuda:15") == Device(kind="cuda", index=15)

    def test_parse_passes_device_through(self) -> None:
        d = Device(kind="cuda", index=3)
        assert Device.parse(d) is d

    def test_parse_torch_device(self) -> None:
        assert Device.parse(torch.device("cpu")) == Device()
        assert Device.parse(torch.device("cuda", 2)) == Device(kind="cuda", index=2)
        assert Device.parse(torch.device("cuda")) == Device(kind="cuda", index=0)

    def test_str(self) -> None:
        assert str(Device()) == "cpu"
        assert str(Device(kind="cuda", index=4)) == "cuda:4"
        assert Device.parse(str(Device(kind="cuda", index=4))) == Device(kind="cuda", index=4)

    @pytest.mark.parametrize("text", ["gpu", "CPU", "", " cpu", "cuda0", "mps", "xpu:1"])
    def test_parse_bad_kind(self, text: str) -> None:
        with pytest.raises(ConfigError, match="unknown device") as info:
            Device.parse(text)
        assert repr(text) in str(info.value)
        assert isinstance(info.value, ValueError)

    @pytest.mark.parametrize("text", ["cuda:x", "cuda:-1", "cuda:1:2", "cuda:70000"])
    def test_parse_bad_index_is_config_error(self, text: str) -> None:
        with pytest.raises(ConfigError):
            Device.parse(text)

    def test_validation(self) -> None:
        with pytest.raises(ValidationError):
            Device(kind="tpu")  # type: ignore[arg-type]
        with pytest.raises(ValidationError):
            Device(kind="cuda", index=-1)
        with pytest.raises(ValidationError):
            Device(kind="cuda", index=1 << 16)
        assert Device(kind="cuda", index=(1 << 16) - 1).index == 65535


# --------------------------------------------------------------------------- descriptors


class TestDescriptorRoundTrip:
    @pytest.mark.parametrize("nics", [1, 2, 4])
    @pytest.mark.parametrize(
        "device", [Device(), Device(kind="cuda", index=0), Device(kind="cuda", index=7)], ids=str
    )
    @pytest.mark.parametrize("writable", [True, False])
    def test_bytes_and_json(self, nics: int, device: Device, writable: bool) -> None:
        d = make_desc(nics, device=device, writable=writable)
        data = d.to_bytes()
        assert bytes(d) == data
        back = MemoryRegionDescriptor.from_bytes(data)
        assert back == d
        assert back.device == device and back.writable is writable and len(back.nics) == nics
        assert MemoryRegionDescriptor.from_json(d.model_dump_json()) == d
        assert MemoryRegionDescriptor.from_json(d.model_dump_json().encode()) == d
        assert pickle.loads(pickle.dumps(d)) == d
        assert MemoryRegionDescriptor.from_bytes(bytearray(data)) == d
        assert MemoryRegionDescriptor.from_bytes(memoryview(data)) == d

    def test_exact_encoding(self) -> None:
        d = MemoryRegionDescriptor(ptr=0x1000, length=100, nics=(NicKey(address=addr(b"\x01\x02"), rkey=5),))
        body = (
            b"FBMR"
            + bytes([1, 1])  # version, flags (writable)
            + (0).to_bytes(2, "little")  # device index
            + (1).to_bytes(2, "little")  # NIC count
            + (0x1000).to_bytes(8, "little")
            + (100).to_bytes(8, "little")
            + b"\x02\x01\x02"
            + (5).to_bytes(8, "little")
        )
        assert d.to_bytes() == with_crc(body)
        assert len(d.to_bytes()) == 26 + 3 + 8 + 4

    def test_flags_encoding(self) -> None:
        def flags(d: MemoryRegionDescriptor) -> int:
            return d.to_bytes()[5]

        assert flags(make_desc()) == 1
        assert flags(make_desc(writable=False)) == 0
        assert flags(make_desc(device=Device(kind="cuda", index=3))) == 3
        assert flags(make_desc(device=Device(kind="cuda", index=3), writable=False)) == 2
        assert make_desc(device=Device(kind="cuda", index=0x0102)).to_bytes()[6:8] == b"\x02\x01"

    def test_extreme_values(self) -> None:
        d = MemoryRegionDescriptor(
            ptr=(1 << 64) - 1,
            length=(1 << 64) - 1,
            nics=tuple(NicKey(address=addr(bytes([i]) * 255), rkey=(1 << 64) - 1) for i in range(64)),
        )
        assert MemoryRegionDescriptor.from_bytes(d.to_bytes()) == d
        assert MemoryRegionDescriptor.from_json(d.model_dump_json()) == d

    def test_json_shape(self) -> None:
        d = make_desc(2, device=Device(kind="cuda", index=1), writable=False)
        doc = json.loads(d.model_dump_json())
        assert doc["version"] == 1
        assert doc["device"] == {"kind": "cuda", "index": 1}
        assert doc["writable"] is False
        assert doc["nics"][1] == {"address": {"raw": "a1a1a1"}, "rkey": 0x1111_0001 * 2}

    def test_peer_is_first_nic(self) -> None:
        d = make_desc(4)
        assert d.peer == d.nics[0].address == addr(b"\xa0\xa0")

    def test_descriptor_validation(self) -> None:
        key = NicKey(address=addr(b"\x01"), rkey=1)
        with pytest.raises(ValidationError):
            MemoryRegionDescriptor(ptr=0, length=1, nics=())
        with pytest.raises(ValidationError):
            MemoryRegionDescriptor(ptr=0, length=1, nics=(key,) * 65)
        with pytest.raises(ValidationError):
            MemoryRegionDescriptor(ptr=-1, length=1, nics=(key,))
        with pytest.raises(ValidationError):
            MemoryRegionDescriptor(ptr=1 << 64, length=1, nics=(key,))
        with pytest.raises(ValidationError):
            NicKey(address=addr(b"\x01"), rkey=1 << 64)
        with pytest.raises(ValidationError):
            MemoryRegionDescriptor(version=2, ptr=0, length=1, nics=(key,))  # type: ignore[arg-type]
        d = MemoryRegionDescriptor(ptr=0, length=1, nics=(key,) * 64)
        with pytest.raises(ValidationError, match="frozen"):
            d.ptr = 5  # type: ignore[misc]

    def test_memory_region_repr_and_frozen(self) -> None:
        d = make_desc()
        r = MemoryRegion(handle=3, ptr=0x1000, length=64, descriptor=d)
        assert repr(r) == "MemoryRegion(handle=3, ptr=0x1000, length=64, device=cpu)"
        assert r.writable is True and r.device == Device()
        with pytest.raises(ValidationError):
            r.length = 5  # type: ignore[misc]
        with pytest.raises(ValidationError):
            MemoryRegion(handle=3, ptr=0x1000, length=64, descriptor=d, extra=1)  # type: ignore[call-arg]


class TestDescriptorMalformedBytes:
    @pytest.mark.parametrize("nics", [1, 2, 4])
    def test_every_truncation_raises(self, nics: int) -> None:
        data = make_desc(nics, device=Device(kind="cuda", index=2)).to_bytes()
        for cut in range(len(data)):
            with pytest.raises(ValueError, match="truncated") as info:
                MemoryRegionDescriptor.from_bytes(data[:cut])
            assert str(info.value).startswith("MemoryRegionDescriptor: ")

    def test_short_prefix_messages(self) -> None:
        for cut in range(5):
            with pytest.raises(ValueError, match=rf"truncated: {cut} bytes, the header alone is 26"):
                MemoryRegionDescriptor.from_bytes(b"FBMR\x01"[:cut])
        data = make_desc().to_bytes()
        with pytest.raises(ValueError, match="truncated: 29 bytes"):
            MemoryRegionDescriptor.from_bytes(data[:29])
        with pytest.raises(ValueError, match="truncated in NIC entry 0 of 1"):
            MemoryRegionDescriptor.from_bytes(data[:31])
        with pytest.raises(ValueError, match=rf"truncated: {len(data) - 1} bytes, {len(data)} expected"):
            MemoryRegionDescriptor.from_bytes(data[:-1])

    @pytest.mark.parametrize("nics", [1, 2, 4])
    def test_every_bit_flip_raises(self, nics: int) -> None:
        d = make_desc(nics, device=Device(kind="cuda", index=1), writable=False)
        data = d.to_bytes()
        for bit in range(len(data) * 8):
            bad = bytearray(data)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(ValueError) as info:
                MemoryRegionDescriptor.from_bytes(bytes(bad))
            msg = str(info.value)
            byte = bit // 8
            if byte < 4:
                assert "not a descriptor (magic" in msg
            elif byte == 4:
                assert f"foreign version {1 ^ (1 << (bit % 8))}" in msg and "version" in msg
            else:
                assert any(
                    part in msg
                    for part in ("corrupted: checksum mismatch", "truncated", "unexpected trailing bytes")
                ), msg

    def test_wrong_magic(self) -> None:
        data = make_desc().to_bytes()
        with pytest.raises(ValueError, match=r"not a descriptor \(magic b'XBMR', expected b'FBMR'\)"):
            MemoryRegionDescriptor.from_bytes(b"X" + data[1:])
        with pytest.raises(ValueError, match="not a descriptor"):
            MemoryRegionDescriptor.from_bytes(b"\x00" * 64)
        with pytest.raises(ValueError, match="not a descriptor"):
            MemoryRegionDescriptor.from_bytes(make_desc().model_dump_json().encode())

    @pytest.mark.parametrize("version", [0, 2, 255])
    def test_foreign_version(self, version: int) -> None:
        data = bytearray(make_desc().to_bytes())
        data[4] = version
        with pytest.raises(ValueError, match=rf"foreign version {version} .*reads version 1") as info:
            MemoryRegionDescriptor.from_bytes(bytes(data))
        assert "upgrade" in str(info.value)
        # Even a short record of another version names the version, not a truncation.
        with pytest.raises(ValueError, match=f"foreign version {version}"):
            MemoryRegionDescriptor.from_bytes(b"FBMR" + bytes([version]))
        # ... and a well-formed (checksummed) one as well.
        with pytest.raises(ValueError, match=f"foreign version {version}"):
            MemoryRegionDescriptor.from_bytes(encode(version=version))
        assert DESCRIPTOR_VERSION == 1

    def test_trailing_bytes_inside_checksum(self) -> None:
        with pytest.raises(ValueError, match="3 unexpected trailing bytes"):
            MemoryRegionDescriptor.from_bytes(encode(extra=b"abc"))
        assert MemoryRegionDescriptor.from_bytes(encode()).nics[0].rkey == 7

    def test_trailing_bytes_after_checksum(self) -> None:
        data = make_desc(2).to_bytes()
        for extra in (b"\x00", b"junk", data):
            with pytest.raises(ValueError, match="MemoryRegionDescriptor: "):
                MemoryRegionDescriptor.from_bytes(data + extra)

    @pytest.mark.parametrize("flags", [4, 5, 8, 0x80, 0xFF])
    def test_unknown_flags(self, flags: int) -> None:
        with pytest.raises(ValueError, match=f"unknown flags {flags:#x}"):
            MemoryRegionDescriptor.from_bytes(encode(flags=flags))

    def test_known_flags_decode(self) -> None:
        assert MemoryRegionDescriptor.from_bytes(encode(flags=0)).writable is False
        cuda = MemoryRegionDescriptor.from_bytes(encode(flags=3, dev_index=5))
        assert cuda.device == Device(kind="cuda", index=5) and cuda.writable is True

    def test_invalid_fields_behind_checksum(self) -> None:
        with pytest.raises(ValueError, match=r"invalid field: .*at least 1 item"):
            MemoryRegionDescriptor.from_bytes(encode(entries=()))
        with pytest.raises(ValueError, match=r"invalid field: .*at least 1 byte"):
            MemoryRegionDescriptor.from_bytes(encode(entries=((b"", 1),)))
        with pytest.raises(ValueError, match=r"invalid field: .*at most 64 items"):
            MemoryRegionDescriptor.from_bytes(encode(entries=((b"\x01", 1),) * 65))

    def test_nic_count_larger_than_entries(self) -> None:
        with pytest.raises(ValueError, match="truncated in NIC entry 1 of 2"):
            MemoryRegionDescriptor.from_bytes(encode(count=2))
        with pytest.raises(ValueError, match="2 unexpected trailing bytes"):
            MemoryRegionDescriptor.from_bytes(encode(count=1, extra=b"\x00\x00"))


class TestDescriptorMalformedJson:
    def _doc(self) -> dict[str, Any]:
        return json.loads(make_desc(2).model_dump_json())

    def test_version_2(self) -> None:
        doc = self._doc()
        doc["version"] = 2
        with pytest.raises(ValueError, match="MemoryRegionDescriptor JSON: version: ") as info:
            MemoryRegionDescriptor.from_json(json.dumps(doc))
        assert "version" in str(info.value)

    @pytest.mark.parametrize("field", ["ptr", "length", "nics"])
    def test_missing_field(self, field: str) -> None:
        doc = self._doc()
        del doc[field]
        with pytest.raises(ValueError, match=f"JSON: {field}: Field required"):
            MemoryRegionDescriptor.from_json(json.dumps(doc))

    def test_missing_nested_field(self) -> None:
        doc = self._doc()
        del doc["nics"][1]["rkey"]
        with pytest.raises(ValueError, match=r"JSON: nics\.1\.rkey: Field required"):
            MemoryRegionDescriptor.from_json(json.dumps(doc))

    @pytest.mark.parametrize(
        ("path", "value", "where"),
        [
            (("ptr",), "x", "ptr"),
            (("length",), -1, "length"),
            (("length",), 1 << 64, "length"),
            (("writable",), "maybe", "writable"),
            (("device", "kind"), "tpu", "device.kind"),
            (("device", "index"), "one", "device.index"),
            (("nics",), [], "nics"),
            (("nics",), "abc", "nics"),
            (("nics", 0, "rkey"), -5, "nics.0.rkey"),
            (("nics", 0, "address", "raw"), "zz", "nics.0.address.raw"),
            (("nics", 0, "address", "raw"), "", "nics.0.address.raw"),
        ],
    )
    def test_wrong_types(self, path: tuple[Any, ...], value: object, where: str) -> None:
        doc = self._doc()
        node: Any = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        with pytest.raises(ValueError, match=rf"MemoryRegionDescriptor JSON: {where}: "):
            MemoryRegionDescriptor.from_json(json.dumps(doc))

    def test_extra_field(self) -> None:
        doc = self._doc()
        doc["colour"] = "red"
        with pytest.raises(ValueError, match="JSON: colour: Extra inputs are not permitted"):
            MemoryRegionDescriptor.from_json(json.dumps(doc))

    def test_not_json(self) -> None:
        with pytest.raises(ValueError, match="MemoryRegionDescriptor JSON: document: Invalid JSON"):
            MemoryRegionDescriptor.from_json("not json")
        with pytest.raises(ValueError, match="MemoryRegionDescriptor JSON: "):
            MemoryRegionDescriptor.from_json("[]")


# --------------------------------------------------------------------------- property tests

addresses = st.binary(min_size=1, max_size=255).map(addr)
devices = st.one_of(
    st.just(Device()), st.integers(0, (1 << 16) - 1).map(lambda i: Device(kind="cuda", index=i))
)
descriptors = st.builds(
    MemoryRegionDescriptor,
    ptr=st.integers(0, (1 << 64) - 1),
    length=st.integers(0, (1 << 64) - 1),
    device=devices,
    writable=st.booleans(),
    nics=st.lists(
        st.builds(NicKey, address=addresses, rkey=st.integers(0, (1 << 64) - 1)), min_size=1, max_size=8
    ).map(tuple),
)


@FAST
@given(descriptors)
def test_property_round_trip(d: MemoryRegionDescriptor) -> None:
    data = d.to_bytes()
    assert MemoryRegionDescriptor.from_bytes(data) == d
    assert MemoryRegionDescriptor.from_bytes(data).to_bytes() == data
    assert MemoryRegionDescriptor.from_json(d.model_dump_json()) == d
    assert len(data) == 26 + sum(1 + len(k.address.raw) + 8 for k in d.nics) + 4


@FAST
@given(st.binary(max_size=200))
def test_property_random_bytes_only_value_error(data: bytes) -> None:
    message = "returned"
    try:
        MemoryRegionDescriptor.from_bytes(data)
    except ValueError as exc:
        message = str(exc)
    assert message.startswith("MemoryRegionDescriptor: ") or message == "returned"


@FAST
@given(st.binary(max_size=200), st.integers(0, 255), st.integers(0, 70))
def test_property_random_checksummed_bodies_only_value_error(tail: bytes, flags: int, count: int) -> None:
    """Bodies with a valid header and CRC reach the field parsing: still only ValueError."""
    data = with_crc(HEADER.pack(b"FBMR", 1, flags, 0, count, 1, 2) + tail)
    try:
        d = MemoryRegionDescriptor.from_bytes(data)
    except ValueError as exc:
        message = str(exc)
    else:
        assert d.to_bytes() == data
        return
    assert message.startswith("MemoryRegionDescriptor: ")


# --------------------------------------------------------------------------- other models


def test_capabilities() -> None:
    c = Capabilities(backend="sim", num_nics=2, max_msg_size=1 << 30)
    assert (c.imm_bits, c.max_send_size, c.host_memory, c.cuda_memory, c.ordered, c.virtual_clock) == (
        32,
        65536,
        True,
        False,
        False,
        False,
    )
    with pytest.raises(ValidationError, match="frozen"):
        c.num_nics = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Capabilities(backend="sim", num_nics=2, max_msg_size=1, bogus=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="num_nics"):
        Capabilities(backend="sim", num_nics=0, max_msg_size=1)
    with pytest.raises(ValidationError, match="max_msg_size"):
        Capabilities(backend="sim", num_nics=1, max_msg_size=0)
    with pytest.raises(ValidationError, match="max_send_size"):
        Capabilities(backend="sim", num_nics=1, max_msg_size=1, max_send_size=0)
    with pytest.raises(ValidationError, match="backend"):
        Capabilities(num_nics=1, max_msg_size=1)  # type: ignore[call-arg]


def test_domain_info_and_topology_group() -> None:
    dom = DomainInfo(name="mlx5_0", provider="verbs", max_msg_size=1 << 30)
    assert (dom.link_speed_gbps, dom.numa_node, dom.pci_bus_id) == (None, None, None)
    with pytest.raises(ValidationError, match="max_msg_size"):
        DomainInfo(name="x", provider="y", max_msg_size=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DomainInfo(name="x", provider="y", max_msg_size=1, speed=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="frozen"):
        dom.name = "other"  # type: ignore[misc]

    group = TopologyGroup(domains=(dom, dom), cpus=(0, 1))
    assert group.device == Device() and group.numa_node is None and len(group.domains) == 2
    assert TopologyGroup(domains=[dom]).domains == (dom,)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="domains"):
        TopologyGroup()  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TopologyGroup(domains=(dom,), gpus=(0,))  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="frozen"):
        group.cpus = ()  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(group)) == group
    assert TopologyGroup.model_validate_json(group.model_dump_json()) == group


def test_public_exports() -> None:
    for name in ("Device", "DomainAddress", "MemoryRegionDescriptor", "NicKey", "Capabilities"):
        assert getattr(fabric_core, name) is getattr(fabric_core.models, name)
