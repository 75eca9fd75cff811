"""``fabric bench kv``: KV-cache transfer between prefill and decode instances, with a decode
instance joining and a prefill instance killed while traffic runs (``fabric_apps.kvcache.bench``
does the work; this is its command line)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, FabricError
from ._util import app_module, output_options, pyplot, write_json
from .bench import app_backend, backend_option

__all__ = ["bench_kv"]

_MODELS = ("llama70b", "deepseek-v3")
_SPLITS = ("stacked", "interleaved", "separate")


def _models(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in _MODELS]
    if bad or not names:
        raise click.BadParameter(
            f"unknown model {bad[0]!r} (known: {', '.join(_MODELS)})" if bad else "name at least one model",
            param_hint="'--model'",
        )
    return names


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1f} ms"


def _report(result: Any) -> None:
    s, t, v = result.spec, result.throughput, result.serve
    lay = s.layout(1)
    where = "threads of this process" if s.backend == "sim" else "processes"
    click.echo(
        f"fabric bench kv: {s.model} ({lay.num_layers} layers, {lay.block_size}-token pages, "
        f"{'+'.join(x.name for x in lay.segments)} of {lay.page_bytes // 1024} KiB), backend {s.backend}, "
        f"{s.prefills} prefill + {s.decodes} decode instances ({where})"
    )
    click.echo(
        f"  throughput: {t['requests']} requests of {t['tokens_per_request']} tokens in "
        f"{t['seconds']:.1f} s: {t['gbytes_per_s']:.2f} GB/s, {t['pages_per_s']:.0f} pages/s "
        f"({t['writes_per_s']:.0f} page writes/s), p50 {_ms(t['latency_ms_p50'])}"
    )
    if result.ceiling:
        c = result.ceiling
        for mode, what in (
            ("kv_working_set", "through a decoder-sized buffer"),
            ("cached", "to one cached offset"),
        ):
            m = c[mode]
            parts = [
                f"{int(k) // 1024} KiB {g:.2f} GB/s (fabric x{m['ratio'][k]:.2f})"
                for k, g in m["gbytes_per_s"].items()
            ]
            click.echo(
                f"  raw libfabric ceiling, one pair on {c['provider']}, writes {what}: " + ", ".join(parts)
            )
    click.echo(
        f"  serve: {v['arrived']} arrived at {s.rate:g}/s per decoder, {v['completed']} completed, "
        f"{v['failed']} failed ({v['failed_touching_killed']} touched the killed prefill: "
        f"{v['failed_errors'] or 'none'}), {v['not_issued']} not issued by the end"
    )
    click.echo(
        f"  transfer p50 {_ms(v['transfer_ms_p50'])} p99 {_ms(v['transfer_ms_p99'])}; arrival to landed "
        f"p50 {_ms(v['end_to_end_ms_p50'])} p99 {_ms(v['end_to_end_ms_p99'])}; {v['gbytes_per_s']:.2f} GB/s"
    )
    ev = v["events_s"]
    if "add_decode" in ev:
        late = f"decode-{s.decodes}"
        click.echo(
            f"  decode-{s.decodes} joined at {ev['add_decode']:.1f} s and completed "
            f"{v['per_decoder'].get(late, {}).get('completed', 0)} requests"
        )
    if "kill_prefill" in ev:
        click.echo(
            f"  prefill-0 killed at {ev['kill_prefill']:.1f} s; {v['completed_after_kill']} requests "
            f"issued after it completed; completed per prefill: {v['per_prefill']}"
        )
    checked = sum(d["checked"] for d in v["per_decoder"].values())
    verified = sum(d["verified"] for d in v["per_decoder"].values())
    click.echo(
        f"  {checked} requests checked by stamps, {verified} byte for byte; pages allocated at the end: "
        f"{v['leaked_pages']}; took {result.duration_s:.1f} s"
    )


def _write_size(result: Any) -> str:
    """The bytes of the run's largest paged write (K and V of an interleaved page go as one)."""
    return str(max(result.to_json()["layout"]["write_bytes"]))


def _plot(results: list[Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r.spec.model for r in results]
    fab = [r.throughput["gbytes_per_s"] for r in results]
    ax = axes[0]
    ax.bar([i - 0.26 for i in range(len(results))], fab, width=0.25, label="fabric KvCache (aggregate)")
    with_ceiling = [r for r in results if r.ceiling]
    for k, (mode, label) in enumerate(
        (
            ("kv_working_set", "raw libfabric, decoder-sized buffer"),
            ("cached", "raw libfabric, cached offset"),
        )
    ):
        xs = [results.index(r) + 0.26 * k for r in with_ceiling]
        ys = [r.ceiling[mode]["gbytes_per_s"][_write_size(r)] for r in with_ceiling]
        if xs:
            ax.bar(xs, ys, width=0.25, label=f"{label} (writes of fabric's size)")
    for r in with_ceiling:  # the ratio to the ceiling's 64 KiB writes through a decoder-sized buffer
        ratio = r.ceiling["kv_working_set"]["ratio"].get("65536")
        if ratio is not None:
            i = results.index(r)
            ax.annotate(f"{ratio:.2f}x", (i - 0.26, fab[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(results)), names)
    ax.set_ylabel("GB/s")
    s0 = results[0].spec
    ax.set_title(f"throughput: {s0.prefills} prefill + {s0.decodes} decode ({s0.backend}, closed loop)")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    for i, r in enumerate(results):
        v = r.serve
        ax.bar([i - 0.2], [v["transfer_ms_p50"]], width=0.38, color="C0", label="p50" if i == 0 else None)
        ax.bar([i + 0.2], [v["transfer_ms_p99"]], width=0.38, color="C1", label="p99" if i == 0 else None)
    ax.set_xticks(range(len(results)), names)
    ax.set_ylabel("ms per request (issue to landed)")
    events = [e for e, on in (("+1 decode", s0.add_decode), ("prefill killed", s0.kill_prefill)) if on]
    ax.set_title(", ".join(["serve: Poisson arrivals", *events]))
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("kv")
@backend_option
@click.option(
    "--model",
    "models",
    default="llama70b,deepseek-v3",
    show_default=True,
    help="llama70b, deepseek-v3, or both, comma-separated (each runs in turn).",
)
@click.option(
    "--prefills", type=click.IntRange(1, 16), default=2, show_default=True, help="Prefill instances."
)
@click.option(
    "--decodes",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="Decode instances at the start.",
)
@click.option("--no-add-decode", is_flag=True, help="Do not add a decode instance during the serve phase.")
@click.option("--no-kill", is_flag=True, help="Do not kill prefill 0 during the serve phase.")
@click.option(
    "--throughput-s",
    type=click.FloatRange(min=0),
    default=4.0,
    show_default=True,
    help="Closed-loop phase (0: skip).",
)
@click.option(
    "--warmup-s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Not counted, at its start.",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Requests outstanding per decoder, closed loop.",
)
@click.option("--throughput-tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option(
    "--serve-s", type=click.FloatRange(min=0.5), default=9.0, show_default=True, help="Poisson phase."
)
@click.option(
    "--rate", type=click.FloatRange(min=0.01), default=4.0, show_default=True, help="Requests/s per decoder."
)
@click.option("--min-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option(
    "--decode-blocks", type=click.IntRange(min=1), default=256, show_default=True, help="Pages per decoder."
)
@click.option(
    "--prefill-blocks",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Source pages per prefill.",
)
@click.option("--layers", type=click.IntRange(min=1), default=None, help="Override the model's layer count.")
@click.option(
    "--kv-split",
    type=click.Choice(_SPLITS),
    default="stacked",
    show_default=True,
    help="Llama's cache layout.",
)
@click.option(
    "--verify-every",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Byte-compare every N-th request of the serve phase.",
)
@click.option(
    "--verify-throughput",
    is_flag=True,
    help="Byte-compare in the throughput phase too (costs the host's cores and memory bandwidth).",
)
@click.option("--nics", type=click.IntRange(1, 64), default=None, help="NICs per engine.")
@click.option(
    "--liveness-timeout",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds before a silent peer is lost.",
)
@click.option(
    "--ceiling",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A built benchmarks/ceiling/fi_ceiling: run it in the same run.",
)
@click.option("--ceiling-provider", default="shm", show_default=True, help="Provider the ceiling runs on.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=60.0,
    show_default=True,
    help="Seconds any wait may take.",
)
@output_options
def bench_kv(
    backend: str | None,
    models: str,
    prefills: int,
    decodes: int,
    no_add_decode: bool,
    no_kill: bool,
    throughput_s: float,
    warmup_s: float,
    window: int,
    throughput_tokens: int,
    serve_s: float,
    rate: float,
    min_tokens: int,
    max_tokens: int,
    decode_blocks: int,
    prefill_blocks: int,
    layers: int | None,
    kv_split: str,
    verify_every: int,
    verify_throughput: bool,
    nics: int | None,
    liveness_timeout: float,
    ceiling: str | None,
    ceiling_provider: str,
    seed: int,
    timeout: float,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """KV-cache transfer of fabric_apps.kvcache at a model's shape: throughput, then serving.

    \b
    PREFILLS prefill and DECODES decode instances on this host (processes on efa or verbs,
    threads on the simulator) find each other through a KvMembership in one store. Phase 1
    (throughput): each decoder keeps WINDOW requests outstanding; aggregate GB/s, against the
    raw-libfabric ceiling with --ceiling. Phase 2 (serve): Poisson arrivals; a decode instance
    joins at a third, prefill 0 is killed at two thirds. Every page is checked by stamps and
    every N-th byte for byte; the run fails if a page lands wrong, a request fails that did
    not touch the killed prefill, or a page leaks.
    """
    names = _models(models)
    chosen = app_backend(backend)
    module = app_module("fabric_apps.kvcache.bench", "fabric bench kv")
    options: dict[str, Any] = {
        "liveness_interval_s": min(1.0, liveness_timeout / 4),
        "liveness_timeout_s": liveness_timeout,
    }
    if nics is not None:
        options["nics"] = nics
    try:
        specs = [
            module.KvBenchSpec(
                backend=chosen,
                model=name,
                prefills=prefills,
                decodes=decodes,
                add_decode=not no_add_decode,
                kill_prefill=not no_kill,
                throughput_s=throughput_s,
                warmup_s=warmup_s,
                window=window,
                throughput_tokens=throughput_tokens,
                serve_s=serve_s,
                rate=rate,
                min_tokens=min_tokens,
                max_tokens=max_tokens,
                decode_blocks=decode_blocks,
                prefill_blocks=prefill_blocks,
                layers=layers,
                kv_split=kv_split,
                verify_every=verify_every,
                verify_throughput=verify_throughput,
                seed=seed,
                timeout=timeout,
                ceiling=ceiling,
                ceiling_provider=ceiling_provider,
                engine_options=options,
            )
            for name in names
        ]
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    results = []
    for spec in specs:
        try:
            result = module.run_kv_bench(spec)
        except FabricError as exc:
            raise click.ClickException(f"{spec.model}: {type(exc).__name__}: {exc}") from None
        _report(result)
        results.append(result)
    if json_path is not None:
        write_json(json_path, {"kind": "kv", "runs": [r.to_json() for r in results]}, indent=1)
    if plot_path is not None:
        _plot(results, plot_path)
        click.echo(f"wrote {plot_path}")
