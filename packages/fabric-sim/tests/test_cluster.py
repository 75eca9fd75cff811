"""The cluster timing model (fabric_sim.cluster) against closed-form answers, to the nanosecond
and below: one flow, flows sharing a NIC (max-min fair), many small writes bounded by the
per-request cost, NVLink inside a node, one GPU's NICs aggregated."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fabric_core import ConfigError
from fabric_sim.cluster import CLUSTERS, ClusterSpec, FlowModel, Port, cluster_preset

CX7 = cluster_preset("cx7-400g")
P5 = cluster_preset("efa-p5")
EXACT = 1e-12  # seconds: the model is exact, up to floating point


def _bps(gbps: float) -> float:
    return gbps * 1e9 / 8


def test_one_flow_takes_its_cost_its_bytes_at_line_rate_and_the_latency() -> None:
    m = FlowModel(CX7, nodes=2)
    n = 1 << 20
    wr = m.write(Port(0, 0), Port(1, 0), n)
    end = m.run()
    assert wr.posted_s == pytest.approx(CX7.per_wr_s, abs=EXACT)
    assert wr.sent_s == pytest.approx(CX7.per_wr_s + n / _bps(400), abs=EXACT)
    assert wr.done_s == end == pytest.approx(CX7.per_wr_s + n / _bps(400) + CX7.nic_latency_s, abs=EXACT)


def test_two_flows_from_one_nic_share_it_fairly() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=3)
    small, big = 1 << 20, 3 << 20
    a = m.write(Port(0, 0), Port(1, 0), small)
    b = m.write(Port(0, 0), Port(2, 0), big)
    m.run()
    rate = _bps(400)
    # both at half the rate until the small one is through, then the big one alone
    assert a.sent_s == pytest.approx(2 * small / rate, abs=EXACT)
    assert b.sent_s == pytest.approx((small + big) / rate, abs=EXACT)
    assert b.done_s - b.sent_s == pytest.approx(spec.nic_latency_s, abs=EXACT)


def test_staggered_posting_gives_the_first_flow_the_line_alone_meanwhile() -> None:
    m = FlowModel(CX7, nodes=3)
    n = 1 << 20
    a = m.write(Port(0, 0), Port(1, 0), n)
    b = m.write(Port(0, 0), Port(2, 0), n)
    m.run()
    rate, c = _bps(400), CX7.per_wr_s
    alone = rate * c  # bytes a sends before b is posted
    assert b.posted_s == pytest.approx(2 * c, abs=EXACT)
    assert a.sent_s == pytest.approx(2 * c + (n - alone) / (rate / 2), abs=EXACT)
    assert b.sent_s == pytest.approx(a.sent_s + alone / rate, abs=EXACT)


def test_many_small_writes_are_bounded_by_the_per_request_cost() -> None:
    m = FlowModel(P5, nodes=2)
    count, size = 1000, 64
    wrs = [m.write(Port(0, 0), Port(1, 0), size) for _ in range(count)]
    end = m.run()
    assert size / _bps(100) < P5.per_wr_s  # each is through before the next is posted
    assert end == pytest.approx(count * P5.per_wr_s + size / _bps(100) + P5.nic_latency_s, abs=EXACT)
    assert all(w.posted_s == pytest.approx((i + 1) * P5.per_wr_s, abs=EXACT) for i, w in enumerate(wrs))


def test_an_imm_only_write_takes_its_cost_and_the_latency() -> None:
    m = FlowModel(P5, nodes=2)
    wr = m.write(Port(0, 0), Port(1, 0), 0, at_s=1e-3)
    assert m.run() == pytest.approx(1e-3 + P5.per_wr_s + P5.nic_latency_s, abs=EXACT)
    assert wr.sent_s == wr.posted_s


def test_max_min_fairness_gives_the_leftover_to_flows_off_the_bottleneck() -> None:
    x, y = ("tx", 0, 0, 0), ("rx", 1, 0, 0)
    rates = FlowModel.max_min_rates([[x], [x, y], [y]], {x: 10.0, y: 4.0})
    assert rates == [8.0, 2.0, 2.0]  # y splits 2/2; x's other flow gets the 8 left


def test_a_shared_target_nic_is_the_bottleneck_of_flows_from_different_senders() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=4)
    n = 1 << 20
    wrs = [m.write(Port(s, 0), Port(3, 0), n) for s in range(3)]
    m.run()
    for w in wrs:  # the target's receive side carries all three: a third each
        assert w.sent_s == pytest.approx(3 * n / _bps(400), abs=EXACT)


def test_inside_a_node_writes_go_over_nvlink() -> None:
    m = FlowModel(CX7, nodes=1)
    n = 64 << 20
    wr = m.write(Port(0, 0), Port(0, 5), n)
    m.run()
    assert wr.done_s == pytest.approx(CX7.per_wr_s + n / _bps(3600) + CX7.nvlink_latency_s, abs=EXACT)


def test_one_gpus_four_efa_nics_together_match_one_400g_nic() -> None:
    n = 256 << 20
    p5 = FlowModel(replace(P5, per_wr_s=0.0, nic_latency_s=0.0), nodes=2)
    for k in range(4):
        p5.write(Port(0, 0, k), Port(1, 0, k), n // 4)
    cx7 = FlowModel(replace(CX7, per_wr_s=0.0, nic_latency_s=0.0), nodes=2)
    cx7.write(Port(0, 0), Port(1, 0), n)
    assert p5.run() == pytest.approx(cx7.run(), abs=EXACT) == pytest.approx(n / _bps(400), abs=EXACT)
    assert P5.gpu_gbps == CX7.gpu_gbps == 400.0


def test_presets_are_the_datasheet_shapes() -> None:
    assert {name: (s.gpus_per_node, s.nics_per_gpu, s.nic_gbps) for name, s in CLUSTERS.items()} == {
        "cx7-400g": (8, 1, 400.0),
        "efa-p5": (8, 4, 100.0),
        "efa-p5en": (8, 2, 200.0),
    }


def test_bad_input_is_refused_with_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown cluster preset"):
        cluster_preset("nope")
    with pytest.raises(ConfigError, match="nodes"):
        FlowModel(CX7, nodes=0)
    m = FlowModel(CX7, nodes=2)
    with pytest.raises(ConfigError, match="not in the cluster"):
        m.write(Port(0, 0), Port(2, 0), 1)
    with pytest.raises(ConfigError, match="not in the cluster"):
        m.write(Port(0, 8), Port(1, 0), 1)
    with pytest.raises(ConfigError, match="non-negative"):
        m.write(Port(0, 0), Port(1, 0), -1)
    with pytest.raises(ConfigError, match="same GPU"):
        m.write(Port(0, 0), Port(0, 0, 0), 1)
    with pytest.raises(ConfigError, match="at_s"):
        m.write(Port(0, 0), Port(1, 0), 1, at_s=math.nan)
    with pytest.raises(ConfigError, match="positive rate"):
        ClusterSpec("x", 8, 1, 0.0, 1e-6, 0.0, 1.0, 0.0)
    with pytest.raises(ConfigError, match="at least 1"):
        ClusterSpec("x", 0, 1, 1.0, 1e-6, 0.0, 1.0, 0.0)
    assert m.run() == 0.0  # nothing was added
