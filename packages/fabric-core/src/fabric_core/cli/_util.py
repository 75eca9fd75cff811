"""Helpers shared by the ``fabric`` commands: sizes, versions, and the simulator seen through a Protocol."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol, cast

import click

from ..api import TransferEngine
from ..errors import BackendNotInstalled, FabricError
from ..registry import install_hint

__all__ = [
    "SimFabricLike",
    "app_module",
    "output_options",
    "dist_version",
    "format_count",
    "format_size",
    "import_sim",
    "new_sim_fabric",
    "parse_size",
    "pyplot",
    "size_option",
    "sizes_option",
    "sim_link_presets",
    "write_json",
]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def dist_version(dist: str) -> str:
    """Installed version of distribution ``dist`` ("unknown" if it has no metadata)."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"4KiB"``, ``"64M"``, ``"1G"`` → bytes (binary units); ValueError otherwise."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: use bytes or a K/M/G suffix (binary), e.g. 4096, 4K, 64MiB"
        )
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def format_size(n: int) -> str:
    """Bytes as the largest exact binary unit: ``8 B``, ``4 KiB``, ``64 MiB`` (``1.5 KiB`` if inexact)."""
    for unit, scale in (
        ("EiB", 1 << 60),
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_count(x: float) -> str:
    """A rate or count with three significant digits and a k/M/G suffix."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def size_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """click callback: one size (``4096``, ``4K``, ``64MiB``) or None."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def sizes_option(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """click callback: a comma-separated list of sizes (``8,4K,1M``), sorted, duplicates removed."""
    if value is None:
        return None
    parts = [p for p in value.split(",") if p.strip()]
    if not parts:
        raise click.BadParameter("give at least one size, e.g. 8,4K,1M", ctx, param)
    try:
        return tuple(sorted({parse_size(p) for p in parts}))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


class SimFabricLike(Protocol):
    """What the CLI uses of ``fabric_sim.SimFabric`` (typed here so fabric-core never imports it)."""

    seed: int
    chunk_bytes: int
    now: float
    events: int
    wrs_delivered: int

    def open_engine(self, nics: int = 2, **config: object) -> TransferEngine: ...

    def paused(self) -> AbstractContextManager[None]: ...

    def quiesce(self, timeout: float = 10.0) -> bool: ...


def import_sim() -> Any:
    """The ``fabric_sim`` module, imported on first use; BackendNotInstalled with a hint if absent."""
    try:
        return importlib.import_module("fabric_sim")
    except ModuleNotFoundError as exc:
        if exc.name != "fabric_sim":
            raise
        raise BackendNotInstalled("sim", install_hint("sim")) from None


def new_sim_fabric(seed: int, *, chunk_bytes: int, link: str | None) -> SimFabricLike:
    """A dedicated ``SimFabric`` (not the process-wide one); ``link`` names a link-model preset
    (None: no virtual clock). An unknown preset raises ConfigError naming the presets."""
    sim = import_sim()
    model = sim.link_preset(link) if link is not None else None
    return cast(SimFabricLike, sim.SimFabric(seed, chunk_bytes=chunk_bytes, link=model))


def sim_link_presets() -> list[str]:
    """Names of the simulator's link presets (empty if fabric-sim is not installed)."""
    try:
        sim = import_sim()
    except BackendNotInstalled:
        return []
    return sorted(cast(dict[str, Any], sim.PRESETS))


def write_json(path: Path, doc: Any, **dumps: Any) -> None:
    """Write ``doc`` as JSON to ``path`` (parents made), then say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, **dumps) + "\n")
    click.echo(f"wrote {path}")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a ``ClickException`` naming the install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def app_module(name: str, command: str) -> Any:
    """Import an application's benchmark module, or say how to install what it needs."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # fabric-apps or torch missing
        raise click.ClickException(
            f"{command} needs fabric-apps with torch ({exc}): "
            "pip install 'fabric-core[apps]' torch from a fabric clone"
        ) from None


def output_options(fn: Any) -> Any:
    """``--json PATH`` and ``--plot PATH`` of a benchmark command."""
    fn = click.option(
        "--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Write a plot (PNG)."
    )(fn)
    path = click.Path(dir_okay=False, path_type=Path)
    return click.option("--json", "json_path", type=path, help="Write the results (JSON).")(fn)


def run_app_bench(
    run: Callable[[Any], Any],
    spec: Any,
    report: Callable[[Any], None],
    plot: Callable[[Any, Path], None],
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """Run an application benchmark's ``run(spec)`` (a ``FabricError`` becomes a
    ``ClickException``), print its report, write its JSON and plot where asked."""
    try:
        result = run(spec)
    except FabricError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    report(result)
    if json_path is not None:
        write_json(json_path, result.to_json(), indent=1)
    if plot_path is not None:
        plot(result, plot_path)
        click.echo(f"wrote {plot_path}")
