"""``fabric bench rl``: an RL weight update from trainer ranks to inference ranks, against the
raw-libfabric ceiling measured in the same run (``fabric_apps.weights.bench`` does the work;
this is its command line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError
from ._util import app_module, output_options, pyplot, run_app_bench
from .bench import app_backend, backend_option

__all__ = ["bench_rl"]

_CASTS = ("float8_e4m3fn", "float8_e5m2", "float16")


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _report(result: Any) -> None:
    s, j = result.spec, result.to_json()
    p = j["plan"]
    where = "threads of this process" if s.backend == "sim" else "processes"
    click.echo(
        f"fabric bench rl: backend {s.backend}, {s.trainers} trainer and {s.inference} inference ranks "
        f"({where}), plan {p['digest'][:12]}: {_gib(p['bytes'])} per step in {p['writes']} writes "
        f"({_gib(p['staged_bytes'])} staged), plan {p['serialized_bytes']} bytes serialized"
    )
    click.echo(
        "  bytes per trainer: " + ", ".join(_gib(x) for x in p["bytes_per_source"])
        + "; per inference rank: " + ", ".join(_gib(x) for x in p["bytes_per_destination"])
    )  # fmt: skip
    click.echo(
        "  bytes per NIC (trainers): "
        + "; ".join(" ".join(_gib(x) for x in nics) for nics in p["bytes_per_source_nic"])
        + f"; imbalance (max/mean) sources {p['source_imbalance']:.3f}, source NICs "
        f"{p['source_nic_imbalance']:.3f}, destination NICs {p['destination_nic_imbalance']:.3f}"
    )
    steps = ", ".join(f"{t * 1e3:.0f}" for t in result.step_seconds)
    click.echo(
        f"  update: median {result.median_s * 1e3:.1f} ms ({result.gbytes_per_s:.2f} GB/s) over "
        f"{s.steps} steps [{steps}] ms, +{s.warmup} warm-up; every step checked byte for byte"
    )
    if j["timeline_ms"]:
        tl = sorted(j["timeline_ms"], key=lambda t: max(t["inference_fenced"]))[len(j["timeline_ms"]) // 2]

        def span(xs: list[float]) -> str:
            return f"{min(xs):.0f}-{max(xs):.0f}"

        click.echo(
            f"  median step, ms from the first trainer's start: trainers start "
            f"{span(tl['trainers_started'])}, their writes complete {span(tl['trainers_done'])}, "
            f"inference fences {span(tl['inference_fenced'])}"
        )
    st = j["staging"]
    click.echo(f"  staging: high water {_gib(st['high_water'])} of a {_gib(st['watermark'])} watermark")
    if result.ceiling_gbytes_per_s is not None:
        fan = result.ceiling.get("fan")
        shape = (
            f"the same {s.trainers} -> {s.inference} fan, best size"
            if fan
            else f"best aggregate of 1 and {s.trainers} pairs"
        )
        click.echo(
            f"  raw libfabric ceiling ({result.ceiling['provider']}, {shape}, before and after): "
            f"{result.ceiling_gbytes_per_s:.2f} GB/s; bound {result.bound_s * 1e3:.1f} ms; "
            f"update / bound = {result.ratio:.2f} (target <= 1.25)"
        )
        by = ", ".join(
            f"{p} pair{'s' if p != '1' else ''} {r:.2f}" for p, r in result.ratio_by_pairs().items()
        )
        click.echo(f"  update / bound by independent pairs of the ceiling (one receiver each): {by}")
    click.echo(f"took {result.duration_s:.1f} s")


def _plot(result: Any, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ms = [t * 1e3 for t in result.step_seconds]
    ax.bar(range(len(ms)), ms, label="update (first trainer start to last fence)")
    if result.bound_s is not None:
        ax.axhline(result.bound_s * 1e3, color="k", ls="--", label="bound: bytes / raw ceiling")
        ax.axhline(result.bound_s * 1.25e3, color="r", ls=":", label="1.25 x bound (target)")
    ax.set_xlabel("timed step")
    ax.set_ylabel("ms")
    s = result.spec
    ax.set_title(
        f"RL update {_gib(result.bytes_per_step)}: {s.trainers} -> {s.inference} ranks, {s.backend}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("rl")
@backend_option
@click.option(
    "--trainers", type=click.IntRange(1, 256), default=4, show_default=True, help="Trainer ranks (FSDP)."
)
@click.option(
    "--inference", type=click.IntRange(1, 256), default=2, show_default=True, help="Inference ranks (TP)."
)
@click.option(
    "--model-gib", type=click.FloatRange(min=0.001), default=2.0, show_default=True, help="Model size (bf16)."
)
@click.option("--layers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--cast",
    type=click.Choice(_CASTS),
    default=None,
    help="Inference dtype of the projections (cast at the trainers).",
)
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Timed steps.")
@click.option(
    "--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed steps first."
)
@click.option(
    "--staging-mib",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Staging watermark per trainer.",
)
@click.option(
    "--max-write-kib",
    type=click.IntRange(min=1),
    default=1 << 20,
    show_default=True,
    help="Largest write of the plan (longer copies are cut).",
)
@click.option("--nics", type=click.IntRange(1, 64), default=None, help="NICs per engine.")
@click.option(
    "--ceiling",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A built benchmarks/ceiling/fi_ceiling: run it in the same run (the bound).",
)
@click.option("--ceiling-provider", default="shm", show_default=True, help="Provider the ceiling runs on.")
@click.option(
    "--sender-nice",
    type=click.IntRange(0, 19),
    default=0,
    show_default=True,
    help="Run the trainers, and the ceiling's writers alike, at this nice value (on one host, "
    "the shm receivers' copies then get the CPU the senders would spin on).",
)
@click.option("--explain", is_flag=True, help="Print the plan and exit (nothing is sent).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="Seconds any wait may take.",
)
@output_options
def bench_rl(
    backend: str | None,
    trainers: int,
    inference: int,
    model_gib: float,
    layers: int,
    experts: int,
    cast: str | None,
    steps: int,
    warmup: int,
    staging_mib: int,
    max_write_kib: int,
    nics: int | None,
    ceiling: str | None,
    ceiling_provider: str,
    sender_nice: int,
    explain: bool,
    seed: int,
    timeout: float,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """An RL weight update of fabric_apps.weights: TRAINERS ranks (FSDP) to INFERENCE ranks
    (tensor parallel, experts expert-parallel), every step checked byte for byte.

    \b
    A transformer-like model of --model-gib (dense and MoE layers). On efa or verbs every
    rank is a process with its own engine; on the simulator, a thread. A step's time runs
    from the first trainer's start to the last inference rank's fence. With --ceiling the
    raw-libfabric program runs before and after as the same TRAINERS -> INFERENCE fan (the
    bound: the step's bytes over its best aggregate bandwidth), and as 1 and TRAINERS
    independent pairs for comparison. --explain prints the plan only.
    """
    module = app_module("fabric_apps.weights.bench", "fabric bench rl")
    chosen = "sim" if explain and backend is None else app_backend(backend)
    try:
        spec = module.RlBenchSpec(
            backend=chosen,
            trainers=trainers,
            inference=inference,
            model_bytes=int(model_gib * (1 << 30)),
            layers=layers,
            experts=experts,
            cast=cast,
            steps=steps,
            warmup=warmup,
            staging_bytes=staging_mib << 20,
            max_write_bytes=max_write_kib << 10,
            seed=seed,
            timeout=timeout,
            ceiling=ceiling,
            ceiling_provider=ceiling_provider,
            sender_nice=sender_nice,
            engine_options={} if nics is None else {"nics": nics},
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if explain:
        click.echo(module.plan_for(spec, nics or 1).explain())
        return
    run_app_bench(module.run_rl_bench, spec, _report, _plot, json_path, plot_path)
