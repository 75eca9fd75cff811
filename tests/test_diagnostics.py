"""Hang diagnostics: ``dump_state`` of a running process through a signal, and
``fabric info --pending``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from fabric_core import ConfigError
from fabric_core.cli.app import main
from fabric_core.diagnostics import dump_all, request_state, state_path

CHILD = textwrap.dedent(
    """
    import sys, time, threading
    from fabric_sim import SimFabric
    from fabric_core.diagnostics import install_state_dump
    fabric = SimFabric(seed=1)
    a, b = fabric.open_engine(1), fabric.open_engine(1)
    install_state_dump(directory=sys.argv[1])
    buf = bytearray(1 << 16)
    mr = a.register(bytearray(1 << 16))
    desc = b.register(buf).descriptor
    with fabric.paused():  # a transfer that stays in flight, and a waiter that stays queued
        t = a.submit_write(mr, 0, 4096, desc, 0, imm=7)
        print("ready", flush=True)
        try:
            b.counter(0x55).wait(3, timeout=30, peer=a.address)
        except Exception:
            pass
    """
)


@pytest.fixture
def child(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait(10)
    proc.stdout.close()


def test_a_signalled_process_reports_its_transfers_and_waiters(
    child: subprocess.Popen[str], tmp_path: Path
) -> None:
    deadline = time.monotonic() + 10
    while True:  # the child queues its waiter just after it says ready
        doc = request_state(child.pid, timeout=10, directory=tmp_path)
        if any(e["waiters"] for e in doc["engines"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert doc["pid"] == child.pid and state_path(child.pid, tmp_path).exists()
    (sender,) = [e for e in doc["engines"] if e["requests"]]
    (target,) = [e for e in doc["engines"] if e is not sender]
    (req,) = sender["requests"]
    assert req["imm"] == 7 and req["outstanding"] == req["work_requests"] >= 1
    assert req["peers"] == [target["address"]]
    (waiter,) = target["waiters"]
    assert waiter == {"imm": 0x55, "received": 0, "expected": 3, "peer": sender["address"]}


def test_fabric_info_pending_prints_the_state(
    child: subprocess.Popen[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    time.sleep(0.3)  # the child queues its waiter just after it says ready
    result = CliRunner().invoke(main, ["info", "--pending", str(child.pid)])
    assert result.exit_code == 0, result.output
    assert "in-flight transfers: 1" in result.output and "imm 0x55: expected 3, received 0" in result.output
    result = CliRunner().invoke(main, ["info", "--pending", str(child.pid), "--json"])
    assert json.loads(result.output)["pid"] == child.pid


def test_pending_of_a_process_that_did_not_opt_in_is_a_clear_error(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(30)",
        ]
    )
    try:
        time.sleep(0.3)
        started = time.monotonic()
        with pytest.raises(Exception, match="install_state_dump"):
            request_state(proc.pid, timeout=0.5, directory=tmp_path)
        assert time.monotonic() - started < 3
    finally:
        proc.kill()
        proc.wait(10)
    with pytest.raises(ConfigError, match="no process"):
        request_state(2**22 + 12345, timeout=0.1, directory=tmp_path)


def test_dump_all_skips_closed_engines() -> None:
    from fabric_sim import SimFabric

    fabric = SimFabric(seed=2)
    a = fabric.open_engine(1)
    assert any(d["address"] == a.address.raw.hex() for d in dump_all())
    a.close()
    assert all(d.get("address") != a.address.raw.hex() for d in dump_all())
