"""The verbs DomainAddress and the handshake message: fixed layouts that round-trip, and
decoders that refuse anything else with the reason (ValueError), never a bad peer."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_core.models import DomainAddress
from fabric_verbs import _verbs

ADDRESS_BYTES = _verbs.ADDRESS_BYTES
HANDSHAKE_BYTES = _verbs.HANDSHAKE_BYTES

fields = st.fixed_dictionaries(
    {
        "gid": st.binary(min_size=16, max_size=16),
        "lid": st.integers(0, 0xFFFF),
        "port": st.integers(1, 255),
        "gid_index": st.integers(0, 255),
        "ud_qpn": st.integers(2, (1 << 24) - 1),
        "qkey": st.integers(0, (1 << 31) - 1),
        "mtu": st.integers(1, 5),
        "ethernet": st.booleans(),
        "roce_v2": st.booleans(),
    }
).map(lambda f: {**f, "roce_v2": f["roce_v2"] and f["ethernet"]})


def encode(f: dict[str, Any]) -> bytes:
    return _verbs.encode_address(**f)


@given(fields)
def test_an_address_round_trips_at_a_fixed_size(f: dict[str, Any]) -> None:
    raw = encode(f)
    assert len(raw) == ADDRESS_BYTES == 40
    back = _verbs.decode_address(raw)
    assert {k: back[k] for k in f} == f
    # the contract's DomainAddress carries it as opaque bytes, hex in str()
    assert DomainAddress.from_hex(str(DomainAddress(raw=raw))).raw == raw


@given(fields)
def test_the_layout_is_little_endian_with_zlibs_crc32(f: dict[str, Any]) -> None:
    raw = encode(f)
    magic, version, flags = raw[:2], raw[2], raw[3]
    assert magic == b"fv" and version == 1
    assert flags == (1 if f["ethernet"] else 0) | (2 if f["roce_v2"] else 0)
    assert raw[4:20] == f["gid"]
    lid, port, gid_index, qpn, qkey, mtu = struct.unpack_from("<HBBIIB", raw, 20)
    assert (lid, port, gid_index, qpn, qkey, mtu) == (
        f["lid"],
        f["port"],
        f["gid_index"],
        f["ud_qpn"],
        f["qkey"],
        f["mtu"],
    )
    assert raw[33:36] == b"\0\0\0"
    assert struct.unpack_from("<I", raw, 36)[0] == zlib.crc32(raw[:36])


@given(st.binary(max_size=2 * ADDRESS_BYTES))
def test_garbage_is_refused_or_is_exactly_an_address(data: bytes) -> None:
    try:
        back = _verbs.decode_address(data)
    except ValueError as exc:
        refused = str(exc)
    else:
        # accepted only if it is the canonical encoding of what it decodes to
        assert encode({k: back[k] for k in fields_keys}) == data
        return
    assert refused.startswith("not a fabric-verbs address")


fields_keys = ("gid", "lid", "port", "gid_index", "ud_qpn", "qkey", "mtu", "ethernet", "roce_v2")


@given(fields, st.integers(0, ADDRESS_BYTES - 1), st.integers(1, 255))
def test_any_corrupted_byte_is_refused(f: dict[str, Any], where: int, flip: int) -> None:
    raw = bytearray(encode(f))
    raw[where] ^= flip
    with pytest.raises(ValueError, match="not a fabric-verbs address"):
        _verbs.decode_address(bytes(raw))


@given(fields, st.integers(0, ADDRESS_BYTES - 1))
def test_a_truncated_or_padded_address_is_refused_with_its_length(f: dict[str, Any], cut: int) -> None:
    raw = encode(f)
    with pytest.raises(ValueError, match=f"{cut} bytes, expected 40"):
        _verbs.decode_address(raw[:cut])
    with pytest.raises(ValueError, match="41 bytes, expected 40"):
        _verbs.decode_address(raw + b"\0")


def _with_crc(body: bytes) -> bytes:
    return body[:36] + struct.pack("<I", zlib.crc32(body[:36]))


@pytest.mark.parametrize(
    ("offset", "value", "reason"),
    [
        (2, 2, "version 2 is newer than the version this fabric-verbs reads"),
        (2, 0, "version 0 is not the version"),
        (0, ord("x"), "wrong magic"),
        (3, 4, "unknown flag bits 4"),
        (3, 2, "RoCE v2 GID on a port that is not Ethernet"),
        (22, 0, "port 0"),
        (32, 6, "MTU code 6"),
        (33, 1, "reserved bytes"),
    ],
)
def test_each_field_is_validated_with_the_reason(offset: int, value: int, reason: str) -> None:
    raw = bytearray(
        encode(
            {
                "gid": bytes(range(16)),
                "lid": 7,
                "port": 1,
                "gid_index": 3,
                "ud_qpn": 0x1234,
                "qkey": 0x1111,
                "mtu": 5,
                "ethernet": False,
                "roce_v2": False,
            }
        )
    )
    raw[offset] = value
    with pytest.raises(ValueError, match=reason):
        _verbs.decode_address(_with_crc(bytes(raw)))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"port": 0}, "port 0"),
        ({"ud_qpn": 1}, "QPN 1 is not"),
        ({"ud_qpn": 1 << 24}, "QPN 16777216 is not"),
        ({"qkey": 1 << 31}, "privileged"),
        ({"mtu": 0}, "MTU code 0"),
        ({"ethernet": False, "roce_v2": True}, "RoCE v2"),
    ],
)
def test_encoding_refuses_fields_a_peer_could_not_use(change: dict[str, Any], reason: str) -> None:
    f = {
        "gid": bytes(16),
        "lid": 0,
        "port": 1,
        "gid_index": 0,
        "ud_qpn": 100,
        "qkey": 5,
        "mtu": 3,
        "ethernet": True,
        "roce_v2": True,
    }
    with pytest.raises(ValueError, match=reason):
        encode({**f, **change})


def test_gid_text_shows_ipv4_mapped_roce_v2_gids_as_addresses() -> None:
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 7])
    raw = encode(
        {
            "gid": gid,
            "lid": 0,
            "port": 1,
            "gid_index": 3,
            "ud_qpn": 77,
            "qkey": 9,
            "mtu": 3,
            "ethernet": True,
            "roce_v2": True,
        }
    )
    assert _verbs.decode_address(raw)["gid_text"] == "::ffff:10.0.0.7"
    link_local = bytes.fromhex("fe800000000000000211223344556677")
    raw = encode(
        {
            "gid": link_local,
            "lid": 0,
            "port": 1,
            "gid_index": 0,
            "ud_qpn": 77,
            "qkey": 9,
            "mtu": 3,
            "ethernet": True,
            "roce_v2": False,
        }
    )
    assert _verbs.decode_address(raw)["gid_text"] == "fe80:0:0:0:211:2233:4455:6677"


# --- the handshake message --------------------------------------------------------------

addresses = fields.map(encode)
params = st.fixed_dictionaries(
    {
        "qpn": st.integers(2, (1 << 24) - 1),
        "ctrl_qpn": st.one_of(st.just(0), st.integers(2, (1 << 24) - 1)),
        "psn": st.integers(0, (1 << 24) - 1),
        "gid": st.binary(min_size=16, max_size=16),
        "lid": st.integers(0, 0xFFFF),
        "mtu": st.integers(1, 5),
    }
)
NO_PARAMS = {"qpn": 0, "ctrl_qpn": 0, "psn": 0, "gid": bytes(16), "lid": 0, "mtu": 0}


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["REQ", "REP", "ACK"]))
    return {
        "type": kind,
        "epoch": draw(st.integers(1, (1 << 32) - 1)),
        "echo": 0 if kind == "REQ" else draw(st.integers(1, (1 << 32) - 1)),
        "sender": draw(addresses),
        "receiver": draw(addresses),
        "params": NO_PARAMS if kind == "ACK" else draw(params),
    }


@given(messages())
def test_a_handshake_message_round_trips_at_a_fixed_size(m: dict[str, Any]) -> None:
    raw = _verbs.encode_handshake(**m)
    assert len(raw) == HANDSHAKE_BYTES == 128
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[:124])
    assert _verbs.decode_handshake(raw) == m


@given(messages(), st.integers(0, HANDSHAKE_BYTES - 1), st.integers(1, 255))
def test_a_corrupted_handshake_message_is_refused(m: dict[str, Any], where: int, flip: int) -> None:
    raw = bytearray(_verbs.encode_handshake(**m))
    raw[where] ^= flip
    with pytest.raises(ValueError, match="not a fabric-verbs handshake"):
        _verbs.decode_handshake(bytes(raw))


@given(st.binary(max_size=2 * HANDSHAKE_BYTES))
def test_garbage_is_never_a_handshake_message(data: bytes) -> None:
    with pytest.raises(ValueError):
        _verbs.decode_handshake(data)


@given(messages())
def test_inconsistent_messages_are_refused_even_with_a_good_checksum(m: dict[str, Any]) -> None:
    bad = dict(m)
    if m["type"] == "REQ":
        bad["echo"] = 5  # a REQ echoes no epoch
    elif m["type"] == "ACK":
        bad["params"] = {**NO_PARAMS, "qpn": 9}  # an ACK carries no queue pair
    else:
        bad["params"] = {**m["params"], "qpn": 1}  # QPN 1 is the GSI, never an RC QP
    with pytest.raises(ValueError, match="not a fabric-verbs handshake"):
        _verbs.decode_handshake(_verbs.encode_handshake(**bad))
