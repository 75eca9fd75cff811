"""``fabric sim``: predicted times of the apps on a cluster model (``fabric_sim.predict``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import click

from ._util import pyplot, write_json

__all__ = ["sim"]

_PRESETS = ("cx7-400g", "efa-p5", "efa-p5en")


def _predict() -> Any:
    try:
        from fabric_sim import predict
    except ImportError as exc:  # fabric-sim or fabric-apps (or torch) missing
        raise click.ClickException(
            f"fabric sim needs fabric-sim and fabric-apps with torch ({exc}): "
            "pip install 'fabric-core[sim,apps]' from a fabric clone"
        ) from None
    return predict


def _plot(pred: Any, path: Path) -> None:
    plt = pyplot()
    phases = list(pred.phases.values())
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 3.6), squeeze=False)
    for ax, ph in zip(axes[0], phases, strict=True):
        done = sorted(t for t in ph.rank_done_s if t > 0)
        scale, unit = (1e6, "µs") if ph.makespan_s < 1e-2 else (1.0, "s")
        ax.plot(range(len(done)), [t * scale for t in done], ".", label="predicted, per rank")
        ref = (pred.reference or {}).get(f"{ph.name}_s")
        if ref:
            ax.axhline(ref * scale, color="tab:red", linestyle="--", label="reference system")
        ax.set_title(f"{pred.scenario} {ph.name} on {pred.cluster} ({pred.ranks} ranks)")
        ax.set_xlabel("ranks, by completion")
        ax.set_ylabel(f"done at ({unit})")
        ax.set_ylim(bottom=0)
        ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _emit(pred: Any, json_path: Path | None, plot_path: Path | None) -> None:
    click.echo(_predict().report(pred))
    if json_path is not None:
        write_json(json_path, pred.to_dict(), indent=1, sort_keys=True, default=str)
    if plot_path is not None:
        _plot(pred, plot_path)
        click.echo(f"wrote {plot_path}")


def _common(fn: Any, *, seeded: bool = True) -> Any:
    fn = click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a plot (PNG).")(fn)
    fn = click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the prediction.")(
        fn
    )
    if seeded:
        fn = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the routing.")(fn)
    return click.option(
        "--cluster",
        type=click.Choice(_PRESETS),
        default="cx7-400g",
        show_default=True,
        help="Cluster preset (fabric_sim.cluster.CLUSTERS).",
    )(fn)


@click.group("sim")
def sim() -> None:
    """Predict the apps' times on a cluster before renting it.

    \b
    The apps' real code runs on the simulator (one engine per rank, in this process), which
    records every work request; a cluster model (max-min fair links, per-request costs,
    latencies, NVLink inside a node) then times them. See docs/sim.md.
    """


@sim.command("moe")
@_common
@click.option("--ep", type=click.IntRange(min=2), default=8, show_default=True, help="Expert-parallel ranks.")
@click.option(
    "--nodes", type=click.IntRange(min=1), help="Whole nodes instead of --ep (EP = nodes x GPUs per node)."
)
@click.option("--tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Tokens per rank.")
@click.option("--hidden", type=click.IntRange(min=1), default=7168, show_default=True)
@click.option("--top-k", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--no-nvlink", is_flag=True, help="Writes inside a node go through the NICs too.")
def moe(
    cluster: str,
    seed: int,
    json_path: Path | None,
    plot_path: Path | None,
    ep: int,
    nodes: int | None,
    tokens: int,
    hidden: int,
    top_k: int,
    experts: int,
    no_nvlink: bool,
) -> None:
    """One MoE decode step (dispatch, combine) of MoeAllToAll at expert parallelism EP."""
    predict = _predict()
    from fabric_core.errors import FabricError

    if nodes is not None:
        from fabric_sim.cluster import cluster_preset

        ep = nodes * cluster_preset(cluster).gpus_per_node
    try:
        pred = predict.predict_moe(
            cluster,
            ep,
            tokens=tokens,
            hidden=hidden,
            top_k=top_k,
            experts=experts,
            seed=seed,
            nvlink=not no_nvlink,
        )
    except FabricError as exc:
        raise click.ClickException(str(exc)) from None
    _emit(pred, json_path, plot_path)


@sim.command("rl")
@_common
@click.option("--train-gpus", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--infer-gpus", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--replica-gpus", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--layers",
    type=click.IntRange(1, 61),
    default=61,
    show_default=True,
    help="Kimi-K2 layers kept (61: all).",
)
@click.option("--staging-mib", type=click.IntRange(min=1), default=256, show_default=True)
def rl(
    cluster: str,
    seed: int,
    json_path: Path | None,
    plot_path: Path | None,
    train_gpus: int,
    infer_gpus: int,
    replica_gpus: int,
    layers: int,
    staging_mib: int,
) -> None:
    """One RL weight update of a Kimi-K2-like model (bf16 training ranks to fp8 inference)."""
    predict = _predict()
    from fabric_core.errors import FabricError

    try:
        pred = predict.predict_rl(
            cluster,
            train_gpus=train_gpus,
            infer_gpus=infer_gpus,
            replica_gpus=replica_gpus,
            layers=layers,
            staging_bytes=staging_mib << 20,
            seed=seed,
        )
    except FabricError as exc:
        raise click.ClickException(str(exc)) from None
    _emit(pred, json_path, plot_path)


@sim.command("kv")
@_common
@click.option(
    "--pairs", type=click.IntRange(min=1), default=8, show_default=True, help="Prefill->decode rank pairs."
)
@click.option(
    "--requests", type=click.IntRange(min=1), default=1, show_default=True, help="Sequences per pair."
)
@click.option(
    "--tokens", type=click.IntRange(min=1), default=8192, show_default=True, help="Tokens per sequence."
)
@click.option(
    "--layer-ms",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Prefill compute per layer (0: every layer already computed).",
)
def kv(
    cluster: str,
    seed: int,
    json_path: Path | None,
    plot_path: Path | None,
    pairs: int,
    requests: int,
    tokens: int,
    layer_ms: float,
) -> None:
    """Prefill->decode transfer of DeepSeek-V3's MLA cache, layer by layer (KvPrefiller, KvDecoder)."""
    predict = _predict()
    pred = predict.predict_kv(
        cluster, pairs=pairs, requests=requests, tokens=tokens, layer_s=layer_ms / 1e3, seed=seed
    )
    _emit(pred, json_path, plot_path)


@sim.command("peak")
@functools.partial(_common, seeded=False)
@click.option(
    "--mib", type=click.IntRange(min=1), default=1024, show_default=True, help="Bytes written (MiB)."
)
def peak(cluster: str, json_path: Path | None, plot_path: Path | None, mib: int) -> None:
    """One GPU's aggregate write bandwidth to another node, over all its NICs."""
    _emit(_predict().predict_peak(cluster, nbytes=mib << 20), json_path, plot_path)
