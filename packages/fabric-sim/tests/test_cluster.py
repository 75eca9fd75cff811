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
    # GPU threads store over NVLink: no NIC work request, so no per-request cost by default
    assert wr.done_s == pytest.approx(n / _bps(3600) + CX7.nvlink_latency_s, abs=EXACT)
    # an engine without an NVLink path loops through its NICs, at their rate and cost
    nic = FlowModel(CX7, nodes=1, nvlink=False)
    looped = nic.write(Port(0, 0), Port(0, 5), n)
    nic.run()
    assert looped.done_s == pytest.approx(CX7.per_wr_s + n / _bps(400) + CX7.nic_latency_s, abs=EXACT)
    assert nic.summary()["links"][0]["link"] in ("tx/0/0/0", "rx/0/5/0")


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


def test_work_requests_of_one_connection_move_their_bytes_one_after_another() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=3)
    n, rate = 1 << 20, _bps(400)
    first = m.write(Port(0, 0), Port(1, 0), n)
    second = m.write(Port(0, 0), Port(1, 0), n)
    other = m.write(Port(0, 0), Port(2, 0), 2 * n)
    m.run()
    # the queue pair to node 1 is one flow: its two writes take turns at half the line
    assert first.sent_s == pytest.approx(2 * n / rate, abs=EXACT)
    assert second.sent_s == pytest.approx(4 * n / rate, abs=EXACT)
    assert other.sent_s == pytest.approx(4 * n / rate, abs=EXACT)


def test_an_imm_only_write_waits_for_the_bytes_ahead_of_it_on_its_connection() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=2)
    n = 1 << 20
    m.write(Port(0, 0), Port(1, 0), n)
    imm = m.write(Port(0, 0), Port(1, 0), 0)
    m.run()
    assert imm.sent_s == pytest.approx(n / _bps(400), abs=EXACT)


def test_a_full_window_holds_the_next_submission_until_an_acknowledgement() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=2)
    m.window("staging", 1)
    n, rate, lat = 1 << 20, _bps(400), spec.nic_latency_s
    wrs = [m.write(Port(0, 0), Port(1, 0), n, window="staging") for _ in range(3)]
    end = m.run()
    one = n / rate + 2 * lat  # bytes out, land, acknowledgement back
    for i, w in enumerate(wrs):
        assert w.submitted_s == pytest.approx(i * one, abs=EXACT)
        assert w.acked_s == pytest.approx((i + 1) * one, abs=EXACT)
    assert end == pytest.approx(3 * one - lat, abs=EXACT)
    # a window as large as the work needs holds nothing back
    wide = FlowModel(spec, nodes=2)
    wide.window("staging", 3)
    for _ in range(3):
        wide.write(Port(0, 0), Port(1, 0), n, window="staging")
    assert wide.run() == pytest.approx(3 * n / rate + lat, abs=EXACT)


def test_a_quantum_delays_a_start_by_less_than_one_quantum() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    q, n, rate = 1e-6, 1 << 20, _bps(400)
    m = FlowModel(spec, nodes=4, quantum_s=q)
    a = m.write(Port(0, 0), Port(1, 0), n)
    b = m.write(Port(2, 0), Port(3, 0), n, at_s=0.3 * q)
    m.run()
    assert a.sent_s == pytest.approx(n / rate, abs=EXACT)
    assert b.sent_s == pytest.approx(q + n / rate, abs=EXACT)  # waited for the next recompute
    exact = FlowModel(spec, nodes=4)
    b0 = exact.write(Port(2, 0), Port(3, 0), n, at_s=0.3 * q)
    exact.run()
    assert 0 < b.sent_s - b0.sent_s < q


def test_the_summary_names_the_busiest_link_and_each_tags_span() -> None:
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=4)
    n = 1 << 20
    for s in range(3):
        m.write(Port(s, 0), Port(3, 0), n, tag="fan-in")
    m.write(Port(0, 0), Port(1, 0), n, at_s=1e-3, tag="later")
    end = m.run()
    out = m.summary()
    assert out["makespan_s"] == end
    assert out["work_requests"] == 4 and out["bytes"] == 4 * n
    busiest = out["links"][0]
    assert busiest["link"] == "rx/3/0/0" and busiest["bytes"] == 3 * n
    assert busiest["busy_s"] == pytest.approx(3 * n / _bps(400), abs=EXACT)
    assert out["tags"]["fan-in"]["end_s"] == pytest.approx(3 * n / _bps(400) + spec.nic_latency_s, abs=EXACT)
    assert out["tags"]["later"]["start_s"] == 1e-3
    assert out["last"]["tag"] == "later"
    assert out["posting"][0] == {"port": "tx/0/0/0", "work_requests": 2, "busy_s": 0.0}
    assert FlowModel(spec, nodes=1).summary()["work_requests"] == 0


def test_many_connections_and_work_requests_stay_exact_in_total() -> None:
    """A balanced all-to-all of 16 GPUs x 64 writes each: every receive side carries the same
    bytes, so the last byte lands at (bytes per receiver) / line rate + latency."""
    spec = replace(CX7, per_wr_s=0.0)
    m = FlowModel(spec, nodes=16)
    n = 1 << 16
    for s in range(16):
        for k in range(64):
            d = (s + 1 + k % 15) % 16
            m.write(Port(s, 0), Port(d, 0), n)
    end = m.run()
    per_rx = max(link["bytes"] for link in m.summary()["links"])
    assert end == pytest.approx(per_rx / _bps(400) + spec.nic_latency_s, rel=1e-9)
    assert m.recomputes < 64 * 16


def test_window_and_quantum_are_checked() -> None:
    m = FlowModel(CX7, nodes=2)
    with pytest.raises(ConfigError, match="positive int"):
        m.window("w", 0)
    with pytest.raises(ConfigError, match="not declared"):
        m.write(Port(0, 0), Port(1, 0), 1, window="w")
    with pytest.raises(ConfigError, match="quantum_s"):
        FlowModel(CX7, nodes=2, quantum_s=-1.0)
