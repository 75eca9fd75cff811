"""``fabric info`` and ``fabric bench`` with the efa backend, as a user runs them: the bench's
client and server are two processes, launched by one command or by hand with ``--server`` and
``--connect`` (as on two hosts)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric_core.settings import load_settings

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm"}


def _env(provider: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    env.update(FABRIC_EFA_PROVIDER=provider, FI_TCP_IFACE="lo", FABRIC_TIMEOUT_S="20")
    return env


def _fabric(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fabric_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(params=sorted(PROVIDERS))
def provider(request: pytest.FixtureRequest) -> str:
    from fabric_efa import EfaBackend

    name = PROVIDERS[request.param]
    probe = EfaBackend.probe(load_settings(efa_provider=name))
    if not probe.available:
        pytest.skip(probe.reason)
    return name


def test_info_lists_the_provider_its_limits_and_capabilities(provider: str) -> None:
    done = _fabric("info", "--json", env=_env(provider))
    assert done.returncode == 0, done.stderr
    efa = next(b for b in json.loads(done.stdout)["backends"] if b["name"] == "efa")
    assert efa["available"] and provider in efa["reason"]
    caps = efa["capabilities"]
    assert caps["backend"] == "efa" and caps["max_msg_size"] > 0 and caps["cuda_memory"] is False
    domain = efa["topology"][0]["domains"][0]
    assert domain["provider"] == provider
    assert {"libfabric", "mr_mode", "inject_bytes", "tx_depth", "cq_data_bytes"} <= set(domain["details"])
    assert domain["details"]["delivery_markers"] is (provider == "shm")  # (docs/backends/efa.md)
    text = _fabric("info", env=_env(provider))
    assert f"efa: available (provider {provider})" in text.stdout and "inject_bytes" in text.stdout


def test_bench_runs_client_and_server_as_two_processes(provider: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _fabric(
        "bench",
        "--backend",
        "efa",
        "--nics",
        "2",
        "--quick",
        "--sizes",
        "4K,256K",
        "--json",
        str(out),
        env=_env(provider),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target in a bench server" in done.stdout
    report = json.loads(out.read_text())
    assert report["backend"] == "efa" and report["nics"] == 2 and report["latency"] == "round-trip"
    assert [r["size"] for r in report["results"]] == [4096, 256 << 10]
    assert all(r["ops"] > 0 and r["bandwidth_gbps"] > 0 for r in report["results"])
    assert report["paged"]["pages_per_s"] > 0


@contextlib.contextmanager
def _server(env: dict[str, str], *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``fabric bench --server`` in a child process; it and the endpoint from its banner."""
    cmd = [sys.executable, "-m", "fabric_core.cli", "bench", "--backend", "efa", "--server", *args]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            banner = server.stdout.readline()
            assert banner.startswith("fabric bench server: listening on 127.0.0.1:"), banner
            yield server, banner.split()[5]
        finally:
            if server.poll() is None:
                server.kill()


def test_bench_server_and_connect_by_hand(provider: str, tmp_path: Path) -> None:
    env = _env(provider)
    with _server(env, "--listen", "127.0.0.1:0") as (server, endpoint):
        out = tmp_path / "b.json"
        done = _fabric(
            "bench",
            "--backend",
            "efa",
            "--connect",
            endpoint,
            "--quick",
            "--sizes",
            "64K",
            "--json",
            str(out),
            env=env,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(out.read_text())["results"][0]["ops"] > 0
        assert server.wait(30) == 0
        assert server.stdout is not None and "done" in server.stdout.read()


def test_bench_refuses_a_server_with_another_nic_count(provider: str) -> None:
    env = _env(provider)
    with _server(env, "--nics", "2") as (server, endpoint):
        done = _fabric("bench", "--backend", "efa", "--nics", "1", "--connect", endpoint, "--quick", env=env)
        assert done.returncode == 1
        assert "start both with the same --backend and --nics" in done.stderr
        server.wait(30)


def test_connect_to_nobody_is_a_clear_error(provider: str) -> None:
    done = _fabric("bench", "--backend", "efa", "--connect", "127.0.0.1:1", "--quick", env=_env(provider))
    assert done.returncode == 1 and "cannot reach the bench server at 127.0.0.1:1" in done.stderr
    assert "Traceback" not in done.stderr
