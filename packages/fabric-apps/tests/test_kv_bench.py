"""``fabric bench kv`` on the simulator: both phases run, a decode instance joins and a
prefill instance dies mid-run, only requests that touched it fail, nothing leaks, and the
page checks catch a page that landed wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fabric_apps.kvcache import KvLayout
from fabric_apps.kvcache import bench as kvb
from fabric_core.errors import ConfigError

SMALL: dict[str, Any] = dict(
    backend="sim",
    layers=2,
    decode_blocks=64,
    prefill_blocks=32,
    throughput_s=1.0,
    warmup_s=0.2,
    throughput_tokens=64,
    serve_s=2.4,
    rate=25.0,
    min_tokens=16,
    max_tokens=256,
    verify_every=2,
    timeout=20.0,
)


@pytest.mark.parametrize("model", ["llama70b", "deepseek-v3"])
def test_a_run_joins_a_decoder_kills_a_prefill_and_leaks_nothing(model: str) -> None:
    spec = kvb.KvBenchSpec(model=model, **SMALL)
    result = kvb.run_kv_bench(spec)
    t, s = result.throughput, result.serve
    assert t["requests"] > 0 and t["gbytes_per_s"] > 0 and t["failed"] == 0
    assert s["completed"] > 0 and s["unexpected_failures"] == [] and s["problems"] == []
    # every failure touched the killed prefill, and the survivor kept serving after the kill
    assert s["failed"] == s["failed_touching_killed"]
    assert s["completed_after_kill"] > 0 and s["per_prefill"].get("prefill-1", 0) > 0
    late = s["per_decoder"]["decode-1"]
    assert late["completed"] > 0 and late["joined_s"] == pytest.approx(spec.serve_s / 3, abs=0.5)
    assert s["leaked_pages"] == 0 and all(d["leak"] is None for d in s["per_decoder"].values())
    assert all(d["idle_at_end"] for d in s["per_decoder"].values())
    # the surviving prefill saw every job it ran end well; the killed one reports nothing
    jobs = s["prefill_jobs"]
    assert jobs["prefill-0"] is None and set(jobs["prefill-1"]) == {"ok"} and jobs["prefill-1"]["ok"] > 0
    checked = sum(d["checked"] for d in s["per_decoder"].values())
    assert checked >= s["completed"] + t["requests"]  # the warm-up's requests are checked too
    # each decoder compares every verify_every-th of its own serve-phase requests byte for byte
    assert all(d["verified"] == d["completed"] // spec.verify_every for d in s["per_decoder"].values())
    assert sum(d["verified"] for d in s["per_decoder"].values()) > 0
    doc = result.to_json()
    assert doc["kind"] == "kv" and doc["layout"]["layers"] == 2 and doc["ceiling"] is None


def test_without_faults_nothing_fails() -> None:
    spec = kvb.KvBenchSpec(
        model="llama70b", add_decode=False, kill_prefill=False, prefills=1, verify_throughput=True, **SMALL
    )
    s = kvb.run_kv_bench(spec).serve
    assert s["failed"] == 0 and s["completed"] == s["arrived"] - s["not_issued"]
    # with verify_throughput, every verify_every-th request of both phases is byte-compared
    assert all(d["verified"] == d["checked"] // spec.verify_every for d in s["per_decoder"].values())
    assert "kill_prefill" not in s["events_s"] and list(s["per_decoder"]) == ["decode-0"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model": "gpt"}, "model"),
        ({"prefills": 1}, "kill_prefill needs"),
        ({"max_tokens": 4096}, "pages"),
        ({"min_tokens": 300}, "min_tokens"),
        ({"rate": 0.0}, "rate"),
        ({"warmup_s": 5.0}, "warmup_s"),
        ({"layers": 0}, "layers"),
        ({"kv_split": "diagonal"}, "kv_split"),
    ],
)
def test_bad_specs_are_config_errors(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        kvb.KvBenchSpec(**(SMALL | change))


def _copy_pages(layout: KvLayout, src: list[Any], dst: list[Any], pairs: list[tuple[int, int]]) -> None:
    for layer in range(layout.num_layers):
        s, d = src[layer].view(-1).view(torch.uint8), dst[layer].view(-1).view(torch.uint8)
        for seg in layout.segments:
            for dp, sp in pairs:
                a, b = seg.offset + sp * seg.stride, seg.offset + dp * seg.stride
                d[b : b + layout.page_bytes] = s[a : a + layout.page_bytes]


def test_page_checks_find_a_misplaced_a_missing_and_a_corrupt_page() -> None:
    layout = KvLayout(3, 8, 4, 2, 8, "bfloat16", "stacked")
    src = kvb._source_caches(layout, 1, seed=0)
    sw = kvb._Words(layout, layout.check(src))
    sw.stamp_sources(1)
    table = sw.crcs(range(8))
    dst = kvb._layer_tensors(layout)
    dw = kvb._Words(layout, layout.check(dst))
    pages, sources = [5, 2, 7], [0, 3, 6]
    _copy_pages(layout, src, dst, list(zip(pages, sources, strict=True)))
    assert dw.check(1, pages, sources) is None
    assert np.array_equal(dw.crcs(pages), table[:, :, sources])
    assert "prefill 2" in (dw.check(2, pages, sources) or "")  # another prefill's pages
    assert "page 2" in (dw.check(1, pages, [0, 4, 6]) or "")  # the wrong source page
    dw.clear([7])  # a page that never landed
    assert "page 7" in (dw.check(1, pages, sources) or "")
    _copy_pages(layout, src, dst, [(7, 6)])
    dst[1].view(-1).view(torch.uint8)[2 * layout.page_bytes + 100] ^= 0xFF  # one byte inside page 2
    assert dw.check(1, pages, sources) is None  # stamps are only the ends of each page ...
    assert not np.array_equal(dw.crcs(pages), table[:, :, sources])  # ... the CRCs see the rest


def test_source_tables_are_distinct_pages_fixed_by_the_request_id() -> None:
    a = kvb.source_table("d0-serve-1", 16, 32)
    assert a == kvb.source_table("d0-serve-1", 16, 32) and len(set(a)) == 16
    assert a != kvb.source_table("d0-serve-2", 16, 32)
    assert all(0 <= p < 32 for p in a)


# --- the command line ---------------------------------------------------------------------
_CLI_SMALL = [
    "--backend", "sim", "--layers", "2", "--decode-blocks", "64", "--prefill-blocks", "32",
    "--throughput-s", "0.8", "--warmup-s", "0.2", "--throughput-tokens", "64", "--serve-s", "1.5",
    "--rate", "20", "--min-tokens", "16", "--max-tokens", "128", "--timeout", "20",
]  # fmt: skip


def _cli(*args: str) -> Any:
    from click.testing import CliRunner

    from fabric_core.cli.app import main

    return CliRunner().invoke(main, ["bench", "kv", *args], catch_exceptions=False)


def test_cli_kv_on_the_simulator_reports_both_phases_and_writes_json_and_plot(tmp_path: Any) -> None:
    import json

    pytest.importorskip("matplotlib")
    out, png = tmp_path / "kv.json", tmp_path / "kv.png"
    result = _cli(*_CLI_SMALL, "--json", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    for model in ("llama70b (2 layers, 16-token pages", "deepseek-v3 (2 layers, 64-token pages"):
        assert model in result.output
    assert "decode-1 joined at" in result.output and "prefill-0 killed at" in result.output
    assert "pages allocated at the end: 0" in result.output
    doc = json.loads(out.read_text())
    assert [r["spec"]["model"] for r in doc["runs"]] == ["llama70b", "deepseek-v3"]
    assert all(r["serve"]["leaked_pages"] == 0 for r in doc["runs"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_compares_with_the_ceiling_at_the_size_of_fabric_writes(tmp_path: Any) -> None:
    """An interleaved Llama cache writes 64 KiB (K and V of a page as one): the plot reads the
    ceiling at that size, whatever the page is. It used to read the page's 32 KiB, which a run
    of interleaved caches never measures, and failed."""
    import dataclasses

    from fabric_core.cli.bench_kv import _plot

    pytest.importorskip("matplotlib")
    spec = kvb.KvBenchSpec(
        model="llama70b", kv_split="interleaved", add_decode=False, kill_prefill=False, prefills=1, **SMALL
    )
    result = kvb.run_kv_bench(spec)
    assert result.to_json()["layout"]["write_bytes"] == [65536]
    fake = {
        "span_bytes": 1,
        "runs": {"65536": [5.0]},
        "gbytes_per_s": {"65536": 5.0},
        "ratio": {"65536": 0.5},
    }
    ceiling = {"provider": "shm", "program": "fi_ceiling", "kv_working_set": fake, "cached": fake}
    png = tmp_path / "kv.png"
    _plot([dataclasses.replace(result, ceiling=ceiling)], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt"], "unknown model 'gpt' (known: llama70b, deepseek-v3)"),
        (["--model", ","], "name at least one model"),
        (["--prefills", "1"], "kill_prefill needs at least 2 prefill"),
        (["--max-tokens", "4096"], "raise prefill_blocks"),
        (["--backend", "warp"], "unknown fabric backend 'warp'"),
    ],
)
def test_cli_kv_refuses_bad_options_with_a_clear_message(args: list[str], message: str) -> None:
    result = _cli(*_CLI_SMALL, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_the_ceiling_runs_before_and_after_in_both_modes_and_gives_ratios(tmp_path: Any) -> None:
    """A stand-in for fi_ceiling that reports fixed rates: the run calls it twice per mode
    (before and after), with ``-b`` (the decoder's cache size) in the working-set mode only,
    and divides fabric's aggregate rate by the median."""
    import json
    import stat

    log = tmp_path / "calls"
    fake = tmp_path / "fi_ceiling"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv[1:]\n"
        "span = int(a[a.index('-b') + 1]) if '-b' in a else 0\n"
        "for s in a[a.index('-s') + 1].split(','):\n"
        "    g = 2.0 if span else 8.0\n"
        "    print(json.dumps({'kind': 'bandwidth', 'size': int(s), 'span': span, 'gbytes_per_s': g}))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    spec = kvb.KvBenchSpec(
        model="llama70b", add_decode=False, kill_prefill=False, prefills=1, ceiling=str(fake), **SMALL
    )
    result = kvb.run_kv_bench(spec)
    calls = log.read_text().splitlines()
    span = spec.decode_blocks * spec.request_bytes(1)
    assert len(calls) == 4 and sum(f"-b {span}" in c for c in calls) == 2
    assert all("-s 32768,65536" in c for c in calls)  # a page of K or V (16 x 8 x 128 x 2 B) and 64 KiB
    c = result.ceiling
    assert c is not None and c["kv_working_set"]["span_bytes"] == span and c["cached"]["span_bytes"] == 0
    fab = result.throughput["gbytes_per_s"]
    assert c["kv_working_set"]["ratio"]["32768"] == pytest.approx(fab / 2.0)
    assert c["cached"]["ratio"]["65536"] == pytest.approx(fab / 8.0)
    assert json.loads(json.dumps(result.to_json()))["ceiling"]["cached"]["gbytes_per_s"]["32768"] == 8.0
