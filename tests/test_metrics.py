"""Prometheus export of engine stats (fabric_core.metrics), on the simulator."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from fabric_core import TransferTimeout  # noqa: E402
from fabric_core.metrics import EngineCollector, register  # noqa: E402
from fabric_core.ops import Sharded  # noqa: E402
from fabric_core.stats import WAIT_BUCKETS_S  # noqa: E402
from fabric_sim import SimFabric  # noqa: E402


def test_scrape_reports_exact_per_nic_per_peer_and_wait_figures() -> None:
    fabric = SimFabric(seed=5)
    a, b = fabric.open_engine(2), fabric.open_engine(2)
    try:
        registry = prometheus_client.CollectorRegistry()
        register(registry, [a, b])
        mr = a.register(bytearray(1 << 18))
        desc = b.register(bytearray(1 << 18)).descriptor
        t = a.submit_write(mr, 0, 200_000, desc, 0, imm=4, routing=Sharded())
        b.counter(4).wait(t.imms_at_target, timeout=10)
        t.wait(10)
        with pytest.raises(TransferTimeout):
            b.counter(5).wait(1, timeout=0.01)

        def value(name: str, engine: object, **labels: str) -> float | None:
            who = {"engine": str(engine.address), "backend": "sim"}  # type: ignore[attr-defined]
            return registry.get_sample_value(name, {**who, **labels})

        per_nic = [value("fabric_nic_bytes_written_total", a, nic=str(n)) for n in range(2)]
        assert sum(v or 0 for v in per_nic) == 200_000 and all(v for v in per_nic)
        assert value("fabric_bytes_written_total", a) == 200_000
        assert value("fabric_transfers_completed_total", a) == 1
        assert value("fabric_peer_bytes_written_total", a, peer=str(b.address)) == 200_000
        assert value("fabric_peer_inflight", a, peer=str(b.address)) == 0
        assert value("fabric_nic_inflight", a, nic="0") == 0
        assert value("fabric_registrations", a) == 1
        imms = [value("fabric_nic_imms_received_total", b, nic=str(n)) or 0 for n in range(2)]
        assert sum(imms) == t.imms_at_target == value("fabric_imms_received_total", b)
        # one satisfied wait (in the smallest buckets that hold it, cumulative up to +Inf), one failed
        assert value("fabric_counter_wait_seconds_count", b) == 1
        assert value("fabric_counter_wait_seconds_bucket", b, le="+Inf") == 1
        assert value("fabric_counter_wait_seconds_bucket", b, le=repr(WAIT_BUCKETS_S[-1])) == 1
        assert value("fabric_counter_wait_failures_total", b) == 1
        text = prometheus_client.generate_latest(registry).decode()
        assert "fabric_nic_bytes_written_total" in text and 'nic="1"' in text
    finally:
        a.close()
        b.close()


def test_closed_engines_drop_out_and_the_default_watches_every_open_engine() -> None:
    fabric = SimFabric(seed=6)
    a = fabric.open_engine(1)
    registry = prometheus_client.CollectorRegistry()
    collector = EngineCollector()  # every open engine of the process
    registry.register(collector)
    who = {"engine": str(a.address), "backend": "sim"}
    assert registry.get_sample_value("fabric_transfers_submitted_total", who) == 0
    a.close()
    assert registry.get_sample_value("fabric_transfers_submitted_total", who) is None


def test_the_prefix_names_every_series() -> None:
    fabric = SimFabric(seed=7)
    a = fabric.open_engine(1)
    try:
        registry = prometheus_client.CollectorRegistry()
        register(registry, lambda: [a], prefix="kv")
        names = {m.name for m in registry.collect()}
        assert names and all(n.startswith("kv_") for n in names), names
    finally:
        a.close()
