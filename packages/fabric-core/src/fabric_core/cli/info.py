"""``fabric info``: installed backends, what they can do here, and every ``FABRIC_*`` setting."""

from __future__ import annotations

import json
import os
import platform
import textwrap
from dataclasses import dataclass
from typing import Any

import click
from pydantic_core import PydanticUndefined

from .. import diagnostics, registry
from ..api import API_VERSION
from ..errors import BackendNotInstalled, ConfigError, FabricError
from ..settings import FabricSettings, load_settings
from ._util import dist_version, format_size

__all__ = ["backend_report", "info", "settings_report"]


def _env_name(field: str) -> str:
    prefix = str(FabricSettings.model_config.get("env_prefix", ""))
    return f"{prefix}{field}".upper()


def _env_lookup(name: str) -> str | None:
    """The variable's raw value; pydantic-settings matches names case-insensitively."""
    if name in os.environ:
        return os.environ[name]
    matches = [v for k, v in os.environ.items() if k.upper() == name]
    return matches[0] if matches else None


def settings_report() -> tuple[list[dict[str, Any]], str | None]:
    """One entry per ``FabricSettings`` field (name, env, description, default, env_value, value)
    and the error that makes the environment invalid, if any."""
    try:
        current: FabricSettings | None = load_settings()
        error = None
    except ConfigError as exc:
        current, error = None, str(exc)
    rows = []
    for name, spec in FabricSettings.model_fields.items():
        default = None if spec.default is PydanticUndefined else spec.default
        env = _env_name(name)
        rows.append(
            {
                "name": name,
                "env": env,
                "description": spec.description or "",
                "default": default,
                "env_value": _env_lookup(env),
                "value": getattr(current, name) if current is not None else None,
            }
        )
    return rows, error


@dataclass(slots=True)
class _Backend:
    name: str
    entry_point: str | None
    distribution: str | None = None
    version: str | None = None
    available: bool = False
    reason: str = ""
    capabilities: dict[str, Any] | None = None
    capabilities_error: str | None = None
    topology: list[dict[str, Any]] | None = None
    topology_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "installed": self.entry_point is not None,
            "entry_point": self.entry_point,
            "distribution": self.distribution,
            "version": self.version,
            "available": self.available,
            "reason": self.reason,
            "capabilities": self.capabilities,
            "capabilities_error": self.capabilities_error,
            "topology": self.topology,
            "topology_error": self.topology_error,
        }


def _describe(name: str, entry_point: str | None, settings: FabricSettings | None) -> _Backend:
    out = _Backend(name, entry_point)
    if entry_point is None:
        out.reason = registry.probe(name).reason
        return out
    try:
        cls = registry.load_backend(name)
    except FabricError as exc:
        out.reason = str(exc)
        return out
    out.distribution, out.version = cls.distribution, registry.backend_version(cls)
    result = cls.probe()
    out.available, out.reason = result.available, result.reason
    if not result.available:
        return out
    if settings is None:
        out.topology_error = out.capabilities_error = "FABRIC_* settings are invalid (see settings_error)"
        return out
    try:
        out.topology = [g.model_dump(mode="json") for g in cls.detect_topology(settings)]
    except Exception as exc:  # a backend's detection failing must not hide the rest of the report
        out.topology_error = f"{type(exc).__name__}: {exc}"
    try:
        engine = cls.open(settings.model_copy(update={"backend": name}))
    except Exception as exc:
        out.capabilities_error = f"{type(exc).__name__}: {exc}"
    else:
        try:
            out.capabilities = engine.capabilities.model_dump(mode="json")
        finally:
            engine.close(timeout=5.0)
    return out


def backend_report(only: str | None = None) -> list[dict[str, Any]]:
    """Every installed backend (and the known ones that are not), probed; capabilities and
    topology for the available ones. ``only`` restricts it to one backend name."""
    installed = registry.installed_backends()
    names = sorted(set(installed) | set(registry.AUTO_ORDER) | {"sim"})
    if only is not None:
        if only not in installed:
            try:
                registry.load_backend(only)  # ConfigError for a name no backend has
            except BackendNotInstalled:
                pass  # a known backend that is not installed: reported with its install hint
        names = [only]
    try:
        settings: FabricSettings | None = load_settings()
    except ConfigError:
        settings = None
    return [_describe(name, installed.get(name), settings).to_json() for name in names]


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def _echo_backend(b: dict[str, Any]) -> None:
    if not b["installed"]:
        click.echo(f"  {b['name']}: not installed\n      {b['reason']}")
        return
    state = "available" if b["available"] else "UNAVAILABLE"
    click.echo(f"  {b['name']}: {state} ({b['reason']})")
    click.echo(f"      distribution {b['distribution']} {b['version']}, entry point {b['entry_point']}")
    caps = b["capabilities"]
    if caps is not None:
        flags = [k for k in ("host_memory", "cuda_memory", "ordered", "virtual_clock") if caps.get(k)]
        click.echo(
            f"      capabilities: {caps['num_nics']} NICs, max message {format_size(caps['max_msg_size'])}, "
            f"{caps['imm_bits']}-bit imms, max send {format_size(caps['max_send_size'])}"
            + (f", {', '.join(flags)}" if flags else "")
        )
    elif b["capabilities_error"]:
        click.echo(f"      capabilities: could not open an engine: {b['capabilities_error']}")
    for i, group in enumerate(b["topology"] or []):
        device = group["device"]
        dev = "cpu" if device["kind"] == "cpu" else f"cuda:{device['index']}"
        numa = group["numa_node"] if group["numa_node"] is not None else "-"
        cpus = f"{len(group['cpus'])} CPUs" if group["cpus"] else "CPUs -"
        click.echo(
            f"      topology group {i}: device {dev}, NUMA {numa}, {cpus}, {len(group['domains'])} NICs"
        )
        for d in group["domains"]:
            speed = f"{d['link_speed_gbps']:g} Gbit/s" if d["link_speed_gbps"] is not None else "speed -"
            numa = d["numa_node"] if d["numa_node"] is not None else "-"
            click.echo(
                f"        {d['name']}: provider {d['provider']}, {speed}, max message "
                f"{format_size(d['max_msg_size'])}, NUMA {numa}, PCI {d['pci_bus_id'] or '-'}"
            )
            if d.get("details"):
                click.echo("          " + ", ".join(f"{k} {v}" for k, v in d["details"].items()))
    if b["topology_error"]:
        click.echo(f"      topology: detection failed: {b['topology_error']}")


def _echo_settings(rows: list[dict[str, Any]], error: str | None) -> None:
    click.echo("Settings (FABRIC_* environment variables):")
    for r in rows:
        if r["env_value"] is None:
            value, source = r["value"] if error is None else r["default"], "default"
        else:
            value = r["value"] if error is None else r["env_value"]
            source = f"set in the environment; default {_show(r['default'])}"
        click.echo(f"  {r['env']}={_show(value)}  ({source})")
        for line in textwrap.wrap(r["description"], 96):
            click.echo(f"      {line}")
    if error is not None:
        click.echo(f"  error: {error}")


def _pending(pid: int, as_json: bool) -> None:
    try:
        doc = diagnostics.request_state(pid)
    except FabricError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"process {doc['pid']}: {len(doc['engines'])} open engine(s)")
    for e in doc["engines"]:
        if "error" in e:
            click.echo(f"  (engine: {e['error']})")
            continue
        click.echo(f"\n  engine {e['backend']} {e['address']}")
        click.echo(f"    in-flight transfers: {len(e['requests'])}")
        for r in e["requests"]:
            left = r.get("outstanding_per_nic", r.get("outstanding"))
            deadline = r.get("deadline_in_s")
            due = "no deadline" if deadline is None else f"deadline in {deadline:.1f} s"
            early = ", failed early" if r.get("failed_early") else ""
            click.echo(
                f"      #{r['id']} age {r['age_s']:.2f} s, {due}, imm {r.get('imm')}, "
                f"work requests left {left}, peers {', '.join(r['peers'])}{early}"
            )
        click.echo(f"    counter waiters: {len(e['waiters'])}")
        for w in e["waiters"]:
            click.echo(
                f"      imm {w['imm']:#x}: expected {w['expected']}, received {w['received']}"
                + (f", peer {w['peer']}" if w.get("peer") else "")
            )
        click.echo(f"    peers: {len(e['peers'])}")
        for p in e["peers"]:
            facts = ", ".join(f"{k} {v}" for k, v in p.items() if k != "address")
            click.echo(f"      {p['address']}: {facts}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
@click.option("--backend", "only", metavar="NAME", default=None, help="Report on this backend only.")
@click.option("--env", "env_only", is_flag=True, help="Only the FABRIC_* settings section.")
@click.option(
    "--pending",
    "pending_pid",
    metavar="PID",
    type=int,
    default=None,
    help="Instead: what is outstanding in the running process PID (its in-flight transfers, "
    "counter waiters and peers), which must have called "
    "fabric_core.diagnostics.install_state_dump(); it is sent SIGUSR1.",
)
def info(as_json: bool, only: str | None, env_only: bool, pending_pid: int | None) -> None:
    """Show installed backends, whether they can run here, their capabilities and topology,
    and every FABRIC_* setting with its description, current value and default.

    Exits with status 1 when the FABRIC_* environment holds an invalid value (the report is
    still printed, with the error).
    """
    if pending_pid is not None:
        _pending(pending_pid, as_json)
        return
    rows, error = settings_report()
    backends: list[dict[str, Any]] = []
    if not env_only:
        try:
            backends = backend_report(only)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="'--backend'") from None
        except FabricError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        doc: dict[str, Any] = {
            "fabric_core": {"version": dist_version("fabric-core"), "api_version": API_VERSION},
            "python": platform.python_version(),
            "platform": platform.platform(),
        }
        if not env_only:
            doc["backends"] = backends
        doc["settings"] = rows
        doc["settings_error"] = error
        click.echo(json.dumps(doc, indent=2))
    else:
        if not env_only:
            click.echo(
                f"fabric-core {dist_version('fabric-core')} (backend API {API_VERSION}), "
                f"Python {platform.python_version()} on {platform.platform()}"
            )
            click.echo("\nBackends:")
            for b in backends:
                _echo_backend(b)
            click.echo("")
        _echo_settings(rows, error)
    if error is not None:
        click.get_current_context().exit(1)
