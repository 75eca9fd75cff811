"""``fabric bench`` with its target behind a control connection (``--server`` / ``--connect``).

Here the server and the client share one process and one simulated fabric, joined by a
socket pair or loopback TCP, so the whole protocol (setup, fabric acks, echo round trips,
SHA-256 data checks, typed errors) runs without a NIC. The efa package runs the same
commands as two real processes.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fabric_core.cli import main
from fabric_core.cli._target import RemoteTarget, serve_target
from fabric_core.cli.bench import (
    QUICK_BUDGET,
    BenchFailure,
    EnginePair,
    parse_endpoint,
    run_server,
    run_sweep,
)
from fabric_core.errors import ConfigError, PeerUnreachable, TransportError
from fabric_sim import SimFabric

T = 20.0


@dataclasses.dataclass
class Served:
    target: RemoteTarget
    thread: threading.Thread
    fabric: SimFabric


@pytest.fixture
def served() -> Iterator[Served]:
    fabric = SimFabric(seed=3, chunk_bytes=4096)
    writer, engine = fabric.open_engine(2), fabric.open_engine(2)
    ours, theirs = socket.socketpair()
    stream = theirs.makefile("rwb")
    thread = threading.Thread(
        target=serve_target, args=(engine, stream), kwargs={"backend": "sim", "version": "test"}, daemon=True
    )
    thread.start()
    target = RemoteTarget(writer, ours, T)
    yield Served(target, thread, fabric)
    if not ours._closed:  # type: ignore[attr-defined]
        target.close()
    thread.join(T)
    assert not thread.is_alive(), "the server did not finish after bye"
    stream.close()
    theirs.close()
    writer.close()
    engine.close()


def test_sweep_through_a_server_checks_bytes_and_measures_round_trips(served: Served) -> None:
    assert served.target.hello["nics"] == 2 and served.target.hello["backend"] == "sim"
    pair = EnginePair("sim", "test", served.target.writer, served.target)
    report = run_sweep(pair, [8, 4096, 100_000], budget=QUICK_BUDGET, timeout=T)
    assert report.latency == "round-trip" and report.to_json()["latency"] == "round-trip"
    assert [r.size for r in report.results] == [8, 4096, 100_000]
    for r in report.results:
        assert r.ops > 0 and r.latency_us_p50 > 0 and r.bandwidth_gbps > 0
    assert report.paged is not None and report.paged.pages_per_s > 0


@pytest.mark.usefixtures("misplaced_writes")
def test_wrong_bytes_at_the_server_fail_the_sweep(served: Served) -> None:
    pair = EnginePair("sim", "test", served.target.writer, served.target)
    with pytest.raises(BenchFailure, match="SHA-256 mismatch"):
        run_sweep(pair, [4096], budget=QUICK_BUDGET, timeout=T)


def test_server_errors_come_back_typed_and_the_server_goes_on(served: Served) -> None:
    target = served.target
    with pytest.raises(ConfigError, match="send setup first"):
        target.counted(5, 1, 0.2)
    with pytest.raises(ConfigError, match="unknown bench request"):
        target._call({"op": "warp"})
    with pytest.raises(TransportError, match="KeyError"):
        target._call({"op": "value"})
    desc = target.setup(4096)
    assert desc.length == 4096
    with pytest.raises(TransportError):  # a timeout at the server, reported with its counts
        target.counted(6, 2, 0.1)
    assert target.leftover(6) == 0
    target.zero(10)


def test_echo_round_trips_and_stops(served: Served) -> None:
    target = served.target
    desc = target.setup(4096)
    writer = target.writer
    data = np.arange(1, 65, dtype=np.uint8)
    src = writer.register(data)
    for _ in range(5):
        t = target.ping(lambda: writer.submit_write(src, 0, 64, desc, 0, imm=77), 77, T)
        t.wait(T)
    target.end_ping(77)
    target.end_ping(77)  # idempotent
    assert target.leftover(77) == 0  # the echo consumed exactly one count per round
    assert target.mismatch(0, data) is None  # the bytes landed at the server
    assert target.mismatch(0, np.zeros(64, dtype=np.uint8)) is not None
    target.zero(64)
    assert target.mismatch(0, np.zeros(64, dtype=np.uint8)) is None


def test_a_vanished_server_is_peer_unreachable() -> None:
    fabric = SimFabric(seed=0)
    writer = fabric.open_engine(1)
    ours, theirs = socket.socketpair()

    def half_server() -> None:
        stream = theirs.makefile("rwb")
        stream.readline()
        stream.write(b'{"backend": "sim", "nics": 1}\n')
        stream.flush()
        stream.readline()
        stream.close()
        theirs.close()

    thread = threading.Thread(target=half_server)
    thread.start()
    target = RemoteTarget(writer, ours, 5.0)
    with pytest.raises(PeerUnreachable, match="closed the connection"):
        target.setup(64)
    thread.join(5)
    ours.close()
    writer.close()


def test_run_server_serves_one_client_over_tcp_then_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_NICS", "1")
    lines: list[str] = []
    ready = threading.Event()

    def echo(text: str) -> None:
        lines.append(text)
        ready.set()

    server = threading.Thread(target=run_server, args=("sim", 1, "127.0.0.1:0", T, echo))
    server.start()
    assert ready.wait(T)
    host, port = parse_endpoint(lines[0].split()[5])
    from fabric_core import registry

    writer = registry.open_engine("sim", nics=1)  # the same in-process default fabric
    target = RemoteTarget(writer, socket.create_connection((host, port)), T)
    report = run_sweep(EnginePair("sim", "test", writer, target), [4096], budget=QUICK_BUDGET, timeout=T)
    target.close()
    server.join(T)
    writer.close()
    assert not server.is_alive() and report.results[0].ops > 0
    assert "listening on 127.0.0.1:" in lines[0] and "done" in lines[-1]


def test_run_server_without_a_client_times_out() -> None:
    with pytest.raises(PeerUnreachable, match="no bench client"):
        run_server("sim", 1, "127.0.0.1:0", 0.2, lambda _t: None)


@pytest.mark.parametrize("text", ["nope", "host:", ":80", "h:99999", "h:x"])
def test_bad_endpoints_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_endpoint(text)


def test_ipv6_endpoint() -> None:
    assert parse_endpoint("[::1]:7000") == ("::1", 7000)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "--connect", "h:1"], "give one of them"),
        (["--server"], "the simulator runs both engines in one process"),
        (["--connect", "127.0.0.1:1"], "the simulator runs both engines in one process"),
    ],
)
def test_server_and_connect_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["bench", "--backend", "sim", *args])
    assert result.exit_code == 2 and message in result.output


def test_json_report_says_one_way_in_process(tmp_path: Any) -> None:
    out = tmp_path / "b.json"
    result = CliRunner().invoke(
        main, ["bench", "--backend", "sim", "--quick", "--sizes", "4K", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["latency"] == "one-way"
    assert "both engines in this process" in result.output
