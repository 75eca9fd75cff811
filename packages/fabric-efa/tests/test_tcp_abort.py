"""The connection reset a path lost in silence gets (fabric-efa's ``tcp_abort.hpp``): which of
the process's TCP connections it takes, and what their ends see. Plain sockets on loopback
stand in for the provider's."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

import pytest

_efa = pytest.importorskip("fabric_efa._efa")


def sockaddr(ip: str, port: int) -> bytes:
    """A libfabric FI_SOCKADDR_IN / FI_SOCKADDR_IN6 address, as tcp;ofi_rxm names endpoints."""
    if ":" in ip:
        return (
            struct.pack("=H", socket.AF_INET6)
            + struct.pack("!HI", port, 0)
            + socket.inet_pton(socket.AF_INET6, ip)
            + struct.pack("=I", 0)
        )
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(ip) + bytes(8)


@contextlib.contextmanager
def listener(ip: str = "127.0.0.1") -> Iterator[tuple[socket.socket, int]]:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        s.listen()
        yield s, s.getsockname()[1]


def connect(ip: str, port: int, server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection((ip, port), timeout=5)
    accepted, _ = server.accept()
    accepted.settimeout(5)
    client.sendall(b"up")
    assert accepted.recv(2) == b"up"
    return client, accepted


def reset(sock: socket.socket) -> bool:
    """Whether ``sock``'s connection was reset (its next read or write says so)."""
    try:
        sock.settimeout(5)
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def alive(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"x")
    return b.recv(1) == b"x"


def test_a_connection_this_side_opened_to_the_peer_is_reset_and_no_other() -> None:
    with listener() as (peer, peer_port), listener() as (other, other_port), listener() as (_, my_port):
        to_peer, at_peer = connect("127.0.0.1", peer_port, peer)
        to_other, at_other = connect("127.0.0.1", other_port, other)
        with to_peer, at_peer, to_other, at_other:
            n = _efa.abort_tcp_connections(sockaddr("127.0.0.1", my_port), sockaddr("127.0.0.1", peer_port))
            assert n == 1
            assert reset(to_peer)  # this side: its next read meets the end
            assert reset(at_peer)  # the peer got the reset
            assert alive(to_other, at_other) and alive(at_other, to_other)


def test_a_connection_the_peer_opened_to_this_endpoint_is_reset() -> None:
    with listener() as (mine, my_port), listener() as (_, peer_port):
        from_peer, accepted = connect("127.0.0.1", my_port, mine)
        with from_peer, accepted:
            n = _efa.abort_tcp_connections(sockaddr("127.0.0.1", my_port), sockaddr("127.0.0.1", peer_port))
            # (both ends are this process's: the peer's end goes from its ephemeral port to
            # my_port, which is no connection of "mine" to "peer"; only the accepted one is)
            assert n == 1
            assert reset(accepted)
            assert reset(from_peer)


def test_a_connection_this_side_opened_spares_those_the_peers_host_opened_to_it() -> None:
    with listener() as (mine, my_port), listener() as (peer, peer_port):
        to_peer, at_peer = connect("127.0.0.1", peer_port, peer)
        from_peers_host, accepted = connect("127.0.0.1", my_port, mine)
        with to_peer, at_peer, from_peers_host, accepted:
            n = _efa.abort_tcp_connections(sockaddr("127.0.0.1", my_port), sockaddr("127.0.0.1", peer_port))
            assert n == 1
            assert reset(to_peer) and reset(at_peer)
            assert alive(from_peers_host, accepted) and alive(accepted, from_peers_host)


def test_unsent_bytes_never_reach_the_peer() -> None:
    with listener() as (peer, peer_port):
        client, accepted = connect("127.0.0.1", peer_port, peer)
        with client, accepted:
            client.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                for _ in range(100_000):  # the peer reads nothing: fill both socket buffers
                    sent += client.send(b"\xab" * 65536)
            assert sent > 0
            assert _efa.abort_tcp_connections(sockaddr("127.0.0.1", 0), sockaddr("127.0.0.1", peer_port)) == 1
            got = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := accepted.recv(1 << 20):
                    got += len(chunk)
            assert got < sent  # what was queued at the sender was dropped, not delivered late


def test_other_addresses_and_bad_input_reset_nothing() -> None:
    with listener() as (peer, peer_port):
        client, accepted = connect("127.0.0.1", peer_port, peer)
        with client, accepted:
            assert _efa.abort_tcp_connections(sockaddr("127.0.0.2", 0), sockaddr("127.0.0.1", peer_port)) == 0
            elsewhere = sockaddr("127.0.0.1", peer_port ^ 1)
            assert _efa.abort_tcp_connections(sockaddr("127.0.0.1", 0), elsewhere) == 0
            assert _efa.abort_tcp_connections(b"", b"") == 0
            assert _efa.abort_tcp_connections(b"\x00" * 16, sockaddr("127.0.0.1", peer_port)) == 0
            assert _efa.abort_tcp_connections(sockaddr("127.0.0.1", 0), b"fabric-1234-0") == 0
            assert alive(client, accepted)


def test_ipv6_connections_are_matched_too() -> None:
    try:
        ctx = listener("::1")
        peer, peer_port = ctx.__enter__()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        client, accepted = connect("::1", peer_port, peer)
        with client, accepted:
            assert _efa.abort_tcp_connections(sockaddr("::1", 0), sockaddr("::1", peer_port)) == 1
            assert reset(client) and reset(accepted)
    finally:
        ctx.__exit__(None, None, None)
