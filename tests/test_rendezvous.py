"""Unit tests of fabric_core.rendezvous over real torch.distributed stores (127.0.0.1 only)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fabric_core import (
    ConfigError,
    Device,
    DomainAddress,
    MemoryRegionDescriptor,
    NicKey,
    PeerUnreachable,
    Rendezvous,
)

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 3
HOST = "127.0.0.1"
JOIN_S = 30.0


def rank_address(rank: int) -> DomainAddress:
    return DomainAddress(raw=bytes([0xF0 | rank]) * (rank + 1))


def rank_descriptor(rank: int) -> MemoryRegionDescriptor:
    return MemoryRegionDescriptor(
        ptr=0x10_0000 * (rank + 1),
        length=4096 << rank,
        device=Device(kind="cuda", index=rank) if rank % 2 else Device(),
        writable=rank != 1,
        nics=tuple(
            NicKey(address=DomainAddress(raw=bytes([rank, i])), rkey=1000 * rank + i) for i in range(2)
        ),
    )


def tcp_store(port: int, *, master: bool, timeout: float = 20.0) -> Any:
    return dist.TCPStore(HOST, port, None, master, timedelta(seconds=timeout), wait_for_workers=False)


def _worker(rank: int, file_path: str, tcp_port: int, results: Any) -> None:
    """One rank: exchange an address and a descriptor over a FileStore and a TCPStore."""
    try:
        out: dict[str, Any] = {"rank": rank}
        stores = {
            "file": dist.FileStore(file_path, WORLD),
            "tcp": tcp_store(tcp_port, master=False),
        }
        for kind, store in stores.items():
            rdv = Rendezvous(store, rank=rank, world_size=WORLD, prefix=f"t-{kind}", timeout=20.0)
            addrs = rdv.exchange_addresses(rank_address(rank))
            descs = rdv.exchange_descriptors(rank_descriptor(rank))
            raw = rdv.all_gather("raw", f"rank{rank}".encode())
            out[kind] = ([a.raw for a in addrs], [d.to_bytes() for d in descs], raw)
        results.put(out)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Run WORLD ranks as spawned processes once; each returns what it gathered."""
    master = tcp_store(0, master=True)  # the server lives here; the ranks are clients
    file_path = str(tmp_path_factory.mktemp("rdv") / "store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, file_path, master.port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + JOIN_S
        while len(out) < WORLD:
            item = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[item["rank"]] = item
    finally:
        for p in procs:
            p.join(JOIN_S if len(out) == WORLD else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)
    for item in out.values():
        assert "error" not in item, item["error"]
    assert [p.exitcode for p in procs] == [0] * WORLD
    del master
    return out


@pytest.mark.parametrize("kind", ["file", "tcp"])
def test_three_ranks_exchange(exchanged: dict[int, dict[str, Any]], kind: str) -> None:
    want_addrs = [rank_address(r).raw for r in range(WORLD)]
    want_descs = [rank_descriptor(r).to_bytes() for r in range(WORLD)]
    want_raw = [f"rank{r}".encode() for r in range(WORLD)]
    assert sorted(exchanged) == list(range(WORLD))
    for rank in range(WORLD):
        addrs, descs, raw = exchanged[rank][kind]
        assert addrs == want_addrs, f"rank {rank}"
        assert descs == want_descs, f"rank {rank}"
        assert raw == want_raw, f"rank {rank}"
        decoded = [MemoryRegionDescriptor.from_bytes(d) for d in descs]
        assert decoded == [rank_descriptor(r) for r in range(WORLD)]
        assert decoded[1].device == Device(kind="cuda", index=1) and decoded[1].writable is False


# --------------------------------------------------------------------------- single-process checks


@pytest.fixture
def file_store(tmp_path: Path) -> Any:
    return dist.FileStore(str(tmp_path / "store"), 2)


@pytest.fixture
def tcp_master() -> Any:
    return tcp_store(0, master=True)


def test_round_trip_in_one_process(tcp_master: Any) -> None:
    client = tcp_store(tcp_master.port, master=False)
    r0 = Rendezvous(tcp_master, rank=0, world_size=2, prefix="p", timeout=5)
    r1 = Rendezvous(client, rank=1, world_size=2, prefix="p", timeout=5)
    r1.publish("k", b"from one")
    assert r0.all_gather("k", b"from zero") == [b"from zero", b"from one"]
    assert r1.get("k", 0) == b"from zero"
    assert tcp_master.get("p/k/1") == b"from one"  # the key layout: prefix/key/rank
    r0.publish("mv", memoryview(b"view"))
    assert r1.get("mv", 0) == b"view"


@pytest.mark.parametrize("store_kind", ["file", "tcp"])
def test_missing_key_times_out(request: pytest.FixtureRequest, store_kind: str) -> None:
    store = request.getfixturevalue("file_store" if store_kind == "file" else "tcp_master")
    rdv = Rendezvous(store, rank=0, world_size=2, timeout=0.3)
    rdv.publish("present", b"x")
    assert rdv.get("present", 0) == b"x"
    start = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        rdv.get("never", 1)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0
    assert str(info.value).startswith("rank 1 did not publish 'never' within 0.3 s (")
    assert info.value.__cause__ is not None


def test_all_gather_with_absent_rank_raises(tcp_master: Any) -> None:
    rdv = Rendezvous(tcp_master, rank=1, world_size=3, timeout=0.2)
    with pytest.raises(PeerUnreachable, match="rank 0 did not publish 'address'"):
        rdv.exchange_addresses(rank_address(1))


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0), (5, 3)])
def test_bad_rank_in_constructor(file_store: Any, rank: int, world: int) -> None:
    with pytest.raises(ConfigError, match=rf"rank {rank} is outside \[0, {world}\)"):
        Rendezvous(file_store, rank=rank, world_size=world)


@pytest.mark.parametrize("rank", [-1, 2, 10])
def test_bad_rank_in_get(file_store: Any, rank: int) -> None:
    rdv = Rendezvous(file_store, rank=0, world_size=2, timeout=0.1)
    with pytest.raises(ConfigError, match=rf"rank {rank} is outside \[0, 2\)"):
        rdv.get("k", rank)


@pytest.mark.parametrize("key", ["", "a/b", "/", "x/"])
def test_bad_key(file_store: Any, key: str) -> None:
    rdv = Rendezvous(file_store, rank=0, world_size=2, timeout=0.1)
    with pytest.raises(ConfigError, match="key must be non-empty and without '/'") as info:
        rdv.publish(key, b"x")
    assert repr(key) in str(info.value)
    with pytest.raises(ConfigError, match="key must be non-empty"):
        rdv.get(key, 1)
    with pytest.raises(ConfigError, match="key must be non-empty"):
        rdv.all_gather(key, b"x")


def test_bad_prefix(file_store: Any) -> None:
    with pytest.raises(ConfigError, match="prefix must not contain '/'"):
        Rendezvous(file_store, rank=0, world_size=1, prefix="a/b")


ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("missing", range(len(ENV)))
def test_from_env_names_missing_variable(monkeypatch: pytest.MonkeyPatch, missing: int) -> None:
    values = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": HOST, "MASTER_PORT": "1"}
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name in ENV[:missing]:
        monkeypatch.setenv(name, values[name])
    with pytest.raises(
        ConfigError, match=f"^{ENV[missing]} is not set: launch with torchrun or pass a store$"
    ):
        Rendezvous.from_env()


def test_from_env_without_any_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="is not set"):
        Rendezvous.from_env()


def test_from_env_single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    rdv = Rendezvous.from_env(prefix="env", timeout=5)
    assert (rdv.rank, rdv.world_size, rdv.prefix, rdv.timeout) == (0, 1, "env", 5)
    assert rdv.exchange_descriptors(rank_descriptor(0)) == [rank_descriptor(0)]
    assert rdv.exchange_addresses(rank_address(0)) == [rank_address(0)]
    assert os.environ["RANK"] == "0"
