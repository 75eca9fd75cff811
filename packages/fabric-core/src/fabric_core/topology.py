"""GPU ↔ NIC ↔ NUMA affinity from sysfs, for the backends' ``detect_topology`` (verbs: RDMA
devices; efa: the provider's domains on PCI devices).

Each GPU gets the NICs closest to it on the PCIe tree (fewest hops to a common bridge: a NIC
behind the GPU's own PCIe switch beats one behind the same root port, which beats one on
the same NUMA node, which beats the rest), ties included. The CPUs of a group are those of
the GPU's NUMA node. A backend's override setting (``FABRIC_VERBS_TOPOLOGY``,
``FABRIC_EFA_TOPOLOGY``) replaces all of it.

Every function takes the sysfs root, so the tests run on a made-up tree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fabric_core.errors import ConfigError
from fabric_core.models import Device, DomainInfo, TopologyGroup

__all__ = [
    "Gpu",
    "build_groups",
    "numa_node_of",
    "find_gpus",
    "gpu_domains",
    "node_cpus",
    "parse_cpulist",
    "parse_override",
    "pci_distance",
    "pci_path",
]

_BDF = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_ROOT = re.compile(r"^pci[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}$")
_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")  # VGA, 3D controller
_FAR = 1 << 20  # distance between functions under different host bridges


@dataclass(frozen=True, slots=True)
class Gpu:
    """A CUDA device as sysfs shows it."""

    index: int
    pci_bus_id: str
    numa_node: int | None


def pci_path(bdf: str, sysfs: str | os.PathLike[str] = "/sys") -> tuple[str, ...] | None:
    """The chain from the host bridge to ``bdf`` (``('pci0000:00', '0000:00:01.0', ..., bdf)``)."""
    link = Path(sysfs) / "bus" / "pci" / "devices" / bdf
    try:
        real = link.resolve(strict=True)
    except OSError:
        return None
    parts = [p for p in real.parts if _BDF.match(p) or _ROOT.match(p)]
    return tuple(parts) if parts and parts[-1].lower() == bdf.lower() else None


def pci_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Hops from ``a`` up to their closest common bridge and down to ``b``."""
    if not a or not b or a[0] != b[0]:
        return _FAR
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return (len(a) - common) + (len(b) - common)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _numa(value: str | None) -> int | None:
    if value is None or not value.lstrip("-").isdigit():
        return None
    n = int(value)
    return n if n >= 0 else None


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``'0-3,8,10-11'`` → ``(0, 1, 2, 3, 8, 10, 11)``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return ()
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def node_cpus(node: int | None, sysfs: str | os.PathLike[str] = "/sys") -> tuple[int, ...]:
    if node is None:
        return ()
    text = _read(Path(sysfs) / "devices" / "system" / "node" / f"node{node}" / "cpulist")
    return parse_cpulist(text) if text else ()


def find_gpus(sysfs: str | os.PathLike[str] = "/sys", visible: str | None = None) -> list[Gpu]:
    """NVIDIA GPUs in PCI bus order (CUDA's order with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``),
    renumbered by ``visible`` (``CUDA_VISIBLE_DEVICES``) when it lists indices."""
    root = Path(sysfs) / "bus" / "pci" / "devices"
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    found: list[tuple[str, int | None]] = []
    for bdf in entries:
        vendor = _read(root / bdf / "vendor")
        cls = _read(root / bdf / "class") or ""
        if vendor == _NVIDIA and cls.startswith(_GPU_CLASSES):
            found.append((bdf, _numa(_read(root / bdf / "numa_node"))))
    order = list(range(len(found)))
    if visible is not None and visible.strip():
        picks = [v.strip() for v in visible.split(",")]
        if all(p.isdigit() for p in picks):
            order = [int(p) for p in picks if int(p) < len(found)]
    return [Gpu(i, found[k][0], found[k][1]) for i, k in enumerate(order)]


def numa_node_of(bdf: str, sysfs: str | os.PathLike[str] = "/sys") -> int | None:
    """The NUMA node of the PCI function ``bdf``, where sysfs knows it."""
    return _numa(_read(Path(sysfs) / "bus" / "pci" / "devices" / bdf / "numa_node"))


def parse_override(text: str, setting: str = "FABRIC_VERBS_TOPOLOGY") -> list[tuple[Device, tuple[str, ...]]]:
    """``'cuda:0=mlx5_0,mlx5_1;cpu=mlx5_2'`` → ``[(cuda:0, ('mlx5_0', 'mlx5_1')), (cpu, ('mlx5_2',))]``.
    ``setting`` names the variable it came from in errors."""
    out: list[tuple[Device, tuple[str, ...]]] = []
    for entry in text.split(";"):
        if not entry.strip():
            continue
        device, sep, nics = entry.partition("=")
        names = tuple(n.strip() for n in nics.split(",") if n.strip())
        if not sep or not names:
            raise ConfigError(
                f"{setting} entry {entry.strip()!r} is not 'DEVICE=NIC[,NIC...]' "
                "(e.g. 'cuda:0=mlx5_0,mlx5_1;cpu=mlx5_2')"
            )
        out.append((Device.parse(device.strip()), names))
    if not out:
        raise ConfigError(f"{setting} is empty")
    return out


def _common_numa(domains: Sequence[DomainInfo]) -> int | None:
    nodes = {d.numa_node for d in domains}
    return nodes.pop() if len(nodes) == 1 else None


def _closest(
    gpu: Gpu, gpu_path: tuple[str, ...] | None, nics: Sequence[DomainInfo], sysfs: str
) -> list[DomainInfo]:
    def score(d: DomainInfo) -> tuple[int, int]:
        path = pci_path(d.pci_bus_id, sysfs) if d.pci_bus_id else None
        hops = pci_distance(gpu_path, path) if gpu_path and path else _FAR
        other_node = 0 if gpu.numa_node is not None and d.numa_node == gpu.numa_node else 1
        # under a common host bridge: hops decide; otherwise the NUMA node does
        return (hops if hops < _FAR else _FAR + other_node, other_node)

    scores = [score(d) for d in nics]
    best = min(scores)
    return [d for d, s in zip(nics, scores, strict=True) if s == best]


def build_groups(
    domains: Sequence[DomainInfo],
    sysfs: str | os.PathLike[str] = "/sys",
    override: str | None = None,
    visible: str | None = None,
    setting: str = "FABRIC_VERBS_TOPOLOGY",
    noun: str = "an RDMA device",
) -> list[TopologyGroup]:
    """The domain groups: one per GPU with its closest NICs (or per ``override`` entry), and a
    host-memory group with every NIC. ``domains`` are the NICs, named ``device`` or
    ``device:port``; an override names the ``device``. ``setting`` names the override's
    variable and ``noun`` what a NIC is, in errors."""
    sysfs = os.fspath(sysfs)
    by_device = {d.name.split(":")[0]: d for d in domains}
    if override is not None:
        groups = []
        for device, names in parse_override(override, setting):
            missing = [n for n in names if n not in by_device]
            if missing:
                raise ConfigError(
                    f"{setting} names {', '.join(missing)}, which is not {noun} "
                    f"here (present: {', '.join(sorted(by_device)) or 'none'})"
                )
            members = tuple(by_device[n] for n in names)
            node = _common_numa(members)
            groups.append(
                TopologyGroup(device=device, numa_node=node, domains=members, cpus=node_cpus(node, sysfs))
            )
        return groups
    groups = []
    for gpu in find_gpus(sysfs, visible):
        members = tuple(_closest(gpu, pci_path(gpu.pci_bus_id, sysfs), domains, sysfs)) if domains else ()
        if members:
            groups.append(
                TopologyGroup(
                    device=Device(kind="cuda", index=gpu.index),
                    numa_node=gpu.numa_node,
                    domains=members,
                    cpus=node_cpus(gpu.numa_node, sysfs),
                )
            )
    if domains:
        node = _common_numa(domains)
        groups.append(TopologyGroup(numa_node=node, domains=tuple(domains), cpus=node_cpus(node, sysfs)))
    return groups


def gpu_domains(
    gpu: int,
    domains: Sequence[DomainInfo],
    sysfs: str | os.PathLike[str] = "/sys",
    visible: str | None = None,
) -> tuple[DomainInfo, ...]:
    """The NICs of CUDA device ``gpu``'s group (those closest to it, as ``build_groups`` picks
    them), or ``()`` where sysfs shows no such GPU."""
    want = Device(kind="cuda", index=gpu)
    for group in build_groups(domains, sysfs, visible=visible):
        if group.device == want:
            return group.domains
    return ()
