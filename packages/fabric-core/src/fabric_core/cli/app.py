"""The ``fabric`` command group: logging set-up and the subcommands."""

from __future__ import annotations

import logging

import click

from ..registry import installed_backends
from .bench import bench
from .bench_kv import bench_kv
from .bench_moe import bench_moe
from .bench_rl import bench_rl
from .demo import demo
from .info import info
from .sim import sim

__all__ = ["main"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def setup_logging(level: str) -> None:
    """Log to stderr at ``level`` for fabric's own loggers (core and every installed backend).

    Only the CLI does this: as a library, fabric only attaches NullHandlers.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = {"fabric_core"} | {value.split(":")[0].split(".")[0] for value in installed_backends().values()}
    for name in sorted(names):
        logging.getLogger(name).setLevel(level)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    envvar="FABRIC_LOG_LEVEL",
    default="WARNING",
    show_default=True,
    show_envvar=True,
    help="Level of the fabric loggers (printed to stderr).",
)
@click.version_option(package_name="fabric-core", prog_name="fabric")
def main(log_level: str) -> None:
    """fabric: portable RDMA point-to-point (one-sided WriteImm + ImmCounter).

    \b
    fabric info    what is installed and usable here, and every FABRIC_* setting
    fabric bench   latency / bandwidth sweep between two engines (the simulator if no RDMA);
                   fabric bench moe: MoE dispatch/combine against all_to_all_single
    fabric demo    a narrated tour of the contract on the simulator
    fabric sim     predicted times of the apps on a cluster model (moe, rl, kv, peak)
    """
    setup_logging(log_level.upper())


main.add_command(info)
bench.add_command(bench_moe)
bench.add_command(bench_kv)
bench.add_command(bench_rl)
main.add_command(bench)
main.add_command(demo)
main.add_command(sim)
