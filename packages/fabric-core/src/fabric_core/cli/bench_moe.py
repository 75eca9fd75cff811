"""``fabric bench moe``: the MoE app's dispatch and combine against the collectives baseline
(``fabric_apps.moe.bench`` does the work; this is its command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from ._util import app_module, output_options, pyplot, run_app_bench
from .bench import app_backend, backend_option

__all__ = ["bench_moe"]

_ROUTINGS = ("uniform", "skewed", "masked")
_STANDARD = {"decode": 128, "prefill": 4096}


def _shapes(text: str, tokens: int | None) -> tuple[tuple[str, int], ...]:
    if tokens is not None:
        return ((f"{tokens} tokens", tokens),)
    out = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name not in _STANDARD:
            raise click.BadParameter(
                f"unknown shape {name!r}; shapes: {', '.join(_STANDARD)} (or --tokens N)",
                param_hint="'--shapes'",
            )
        out.append((name, _STANDARD[name]))
    if not out:
        raise click.BadParameter("name at least one shape", param_hint="'--shapes'")
    return tuple(out)


def _plot(result: Any, path: Path) -> None:
    plt = pyplot()
    shapes = list(result.times)
    collectives = "NCCL" if result.spec.device == "cuda" else "gloo"
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.0 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        impls = result.times[shape]
        for i, (impl, phases) in enumerate(impls.items()):
            p50 = [phases[ph].p50_us / 1e3 for ph in ("dispatch", "combine")]
            p99 = [phases[ph].p99_us / 1e3 for ph in ("dispatch", "combine")]
            xs = [j + (i - (len(impls) - 1) / 2) * 0.38 for j in range(2)]
            label = "fabric (WriteImm)" if impl == "fabric" else f"all_to_all_single ({collectives})"
            ax.bar(xs, p50, width=0.36, label=label)
            ax.errorbar(
                xs, p50, yerr=[[0, 0], [b - a for a, b in zip(p50, p99, strict=True)]], fmt="none", c="k"
            )
        ax.set_xticks([0, 1], ["dispatch", "combine"])
        ax.set_ylabel("ms (p50, bar to p99)")
        ax.set_title(f"{shape}: {result.spec.ranks} ranks, {result.spec.backend}, {result.spec.device}")
        ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(result: Any) -> None:
    s = result.spec
    where = "threads of this process" if s.backend == "sim" else "processes"
    click.echo(
        f"fabric bench moe: backend {s.backend}, {s.ranks} ranks ({where}), {s.device}, hidden {s.hidden}, "
        f"top-{s.top_k} of {s.experts} experts, bf16, {s.routing} routing, {s.steps} steps "
        f"(+{s.warmup} warm-up), every step checked bit for bit"
    )
    if result.baseline_note:
        click.echo(f"baseline: {result.baseline_note}")
    head = (
        f"{'shape':<10} {'tokens':>6}  {'impl':<10} {'dispatch p50':>12} {'p99':>9} "
        f"{'combine p50':>12} {'p99':>9}"
    )
    click.echo(head)
    click.echo("-" * len(head))
    for shape, impls in result.times.items():
        for impl, ph in impls.items():
            d, c = ph["dispatch"], ph["combine"]
            click.echo(
                f"{shape:<10} {dict(s.shapes)[shape]:>6}  {impl:<10} {_us(d.p50_us):>12} {_us(d.p99_us):>9} "
                f"{_us(c.p50_us):>12} {_us(c.p99_us):>9}"
            )
    for shape in result.times:
        d, c = result.ratio(shape, "dispatch"), result.ratio(shape, "combine")
        if d is not None and c is not None:
            click.echo(f"{shape}: fabric / baseline at p50: dispatch {d:.2f}, combine {c:.2f}")
    click.echo(f"took {result.duration_s:.1f} s")


def _us(us: float) -> str:
    return f"{us:.0f} us" if us < 10_000 else f"{us / 1e3:.1f} ms"


@click.command("moe")
@backend_option
@click.option(
    "--ranks", type=click.IntRange(1, 64), default=2, show_default=True, help="Expert-parallel ranks."
)
@click.option(
    "--shapes",
    default="decode,prefill",
    show_default=True,
    help="decode (128 tokens per rank), prefill (4096), or both.",
)
@click.option(
    "--tokens", type=click.IntRange(min=1), default=None, help="One shape of N tokens per rank instead."
)
@click.option("--hidden", type=click.IntRange(min=1), default=7168, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--routing", type=click.Choice(_ROUTINGS), default="uniform", show_default=True)
@click.option(
    "--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed steps per shape."
)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first."
)
@click.option("--device", type=click.Choice(("cpu", "cuda")), default="cpu", show_default=True)
@click.option("--nics", type=click.IntRange(1, 64), default=None, help="NICs per engine.")
@click.option("--no-baseline", is_flag=True, help="Skip the all_to_all_single baseline.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the inputs and the routing.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=120.0,
    show_default=True,
    help="Seconds any wait may take.",
)
@output_options
def bench_moe(
    backend: str | None,
    ranks: int,
    shapes: str,
    tokens: int | None,
    hidden: int,
    top_k: int,
    experts: int,
    routing: str,
    steps: int,
    warmup: int,
    device: str,
    nics: int | None,
    no_baseline: bool,
    seed: int,
    timeout: float,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """MoE dispatch and combine of fabric_apps.moe against all_to_all_single, in one run.

    \b
    The baseline runs over gloo with host buffers, over NCCL with GPU buffers (--device cuda,
    one GPU per rank; with fewer GPUs it is left out and the report says why).

    \b
    RANKS ranks on this host, every step checked bit for bit against a single-process
    reference. On efa or verbs each rank is a process with its own engine and runs both
    implementations in turn (gloo carries the baseline); on the simulator the fabric ranks are
    threads of this process and the baseline runs in processes afterwards. A phase's time is
    the slower rank's; p50 and p99 over the timed steps.
    """
    chosen_shapes = _shapes(shapes, tokens)
    chosen = app_backend(backend)
    module = app_module("fabric_apps.moe.bench", "fabric bench moe")
    try:
        spec = module.MoeBenchSpec(
            backend=chosen,
            ranks=ranks,
            shapes=chosen_shapes,
            hidden=hidden,
            top_k=top_k,
            experts=experts,
            routing=routing,
            steps=steps,
            warmup=warmup,
            device=device,
            baseline=not no_baseline,
            seed=seed,
            timeout=timeout,
            engine_options={} if nics is None else {"nics": nics},
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    run_app_bench(module.run_moe_bench, spec, _report, _plot, json_path, plot_path)
