"""Prometheus export of ``engine.stats()`` (``pip install fabric-core[metrics]``).

``register()`` adds a collector to a ``prometheus_client`` registry. At each scrape it reads
``stats()`` of the engines it watches (by default every open engine of the process), so
nothing is counted twice and nothing runs between scrapes::

    from prometheus_client import start_http_server
    from fabric_core.metrics import register

    register()                       # every open engine, in the default registry
    start_http_server(9400, addr="127.0.0.1")

Every sample carries ``engine`` (the engine's NIC 0 address, hex) and ``backend`` labels;
per-NIC series add ``nic``, per-peer series add ``peer`` (the peer's NIC 0 address, hex).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from . import diagnostics
from .stats import WAIT_BUCKETS_S

if TYPE_CHECKING:
    from .api import TransferEngine

__all__ = ["EngineCollector", "register"]

_ENGINE = ("engine", "backend")

# (metric, help, EngineStats field) — counters
_TOTALS = (
    ("transfers_submitted", "Transfers submitted.", "submitted"),
    ("transfers_completed", "Transfers completed successfully.", "completed"),
    ("transfers_failed", "Transfers that ended with an error.", "failed"),
    ("work_requests", "Write work requests completed.", "work_requests"),
    ("bytes_written", "Bytes written by completed work requests.", "bytes_written"),
    ("imms_received", "Imms counted at this engine.", "imms_received"),
    ("callback_errors", "User callbacks that raised.", "callback_errors"),
    ("retries", "Work requests retried on another NIC after theirs was lost.", "retries"),
)
_NIC_TOTALS = (
    ("nic_work_requests", "Write work requests completed on the NIC.", "work_requests"),
    ("nic_bytes_written", "Bytes written through the NIC.", "bytes_written"),
    ("nic_errors", "Write work requests that failed on the NIC.", "errors"),
    ("nic_retries", "Failed work requests of the NIC retried on another one.", "retries"),
    ("nic_imms_received", "Imms counted that arrived on the NIC.", "imms_received"),
)
_PEER_TOTALS = (
    ("peer_work_requests", "Write work requests to the peer completed.", "work_requests"),
    ("peer_bytes_written", "Bytes written to the peer.", "bytes_written"),
    ("peer_errors", "Write work requests to the peer that failed.", "errors"),
)


def _prometheus() -> Any:
    try:
        from prometheus_client import core
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "fabric_core.metrics needs prometheus-client: pip install 'fabric-core[metrics]'"
        ) from exc
    return core


class EngineCollector:
    """A ``prometheus_client`` collector over engines' ``stats()``.

    ``engines``: the engines to export, or a callable returning them at each scrape; None
    exports every open engine of the process (``fabric_core.diagnostics.open_engines``).
    """

    def __init__(
        self,
        engines: Iterable[TransferEngine] | Callable[[], Iterable[TransferEngine]] | None = None,
        *,
        prefix: str = "fabric",
    ) -> None:
        if engines is None:
            self._engines: Callable[[], Iterable[TransferEngine]] = diagnostics.open_engines
        elif callable(engines):
            self._engines = engines
        else:
            fixed = list(engines)
            self._engines = lambda: fixed
        self._prefix = prefix
        self._core = _prometheus()

    def _name(self, metric: str) -> str:
        return f"{self._prefix}_{metric}"

    def collect(self) -> Iterator[Any]:
        core = self._core
        engines = [e for e in self._engines() if not e.closed]
        counter, gauge = core.CounterMetricFamily, core.GaugeMetricFamily
        totals = {m: counter(self._name(m), h, labels=_ENGINE) for m, h, _ in _TOTALS}
        registrations = gauge(self._name("registrations"), "Memory regions registered.", labels=_ENGINE)
        nic_totals = {m: counter(self._name(m), h, labels=(*_ENGINE, "nic")) for m, h, _ in _NIC_TOTALS}
        nic_inflight = gauge(
            self._name("nic_inflight"), "Write work requests in flight on the NIC.", labels=(*_ENGINE, "nic")
        )
        peer_totals = {m: counter(self._name(m), h, labels=(*_ENGINE, "peer")) for m, h, _ in _PEER_TOTALS}
        peer_inflight = gauge(
            self._name("peer_inflight"),
            "Write work requests in flight to the peer.",
            labels=(*_ENGINE, "peer"),
        )
        waits = core.HistogramMetricFamily(
            self._name("counter_wait_seconds"),
            "Latency of counter waits (wait, wait_async, expect) that were satisfied.",
            labels=_ENGINE,
        )
        wait_failures = counter(
            self._name("counter_wait_failures"),
            "Counter waits that ended with an error (timeout, lost peer, closed engine).",
            labels=_ENGINE,
        )
        for engine in engines:
            try:
                s = engine.stats()
            except Exception:  # closed between the listing and the read: skip it
                continue
            who = (str(engine.address), engine.capabilities.backend)
            for m, _, field in _TOTALS:
                totals[m].add_metric(who, getattr(s, field))
            registrations.add_metric(who, s.registrations)
            for n in s.nics:
                nic = (*who, str(n.nic))
                for m, _, field in _NIC_TOTALS:
                    nic_totals[m].add_metric(nic, getattr(n, field))
                nic_inflight.add_metric(nic, n.inflight)
            for p in s.peers:
                peer = (*who, str(p.peer))
                for m, _, field in _PEER_TOTALS:
                    peer_totals[m].add_metric(peer, getattr(p, field))
                peer_inflight.add_metric(peer, p.inflight)
            w = s.counter_waits
            cumulative: list[tuple[str, int]] = []
            running = 0
            for bound, count in zip((*(repr(b) for b in WAIT_BUCKETS_S), "+Inf"), w.buckets, strict=True):
                running += count
                cumulative.append((bound, running))
            waits.add_metric(who, cumulative, w.total_s)
            wait_failures.add_metric(who, w.failed)
        yield from totals.values()
        yield registrations
        yield from nic_totals.values()
        yield nic_inflight
        yield from peer_totals.values()
        yield peer_inflight
        yield waits
        yield wait_failures


def register(
    registry: Any = None,
    engines: Iterable[TransferEngine] | Callable[[], Iterable[TransferEngine]] | None = None,
    *,
    prefix: str = "fabric",
) -> EngineCollector:
    """Add an ``EngineCollector`` to ``registry`` (default: prometheus_client's global one)."""
    collector = EngineCollector(engines, prefix=prefix)
    if registry is None:
        registry = _prometheus().REGISTRY
    registry.register(collector)
    return collector
