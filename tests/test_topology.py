"""GPU ↔ NIC ↔ NUMA affinity from sysfs (fabric_core.topology), on a made-up sysfs tree:

socket 0 (NUMA 0, CPUs 0-3)                   socket 1 (NUMA 1, CPUs 4-7)
pci0000:00                                    pci0000:80
└ 00:01.0 ─ 01:00.0 (PCIe switch)              └ 80:01.0 ─ 81:00.0 (PCIe switch)
│            ├ 02:00.0 ─ 03:00.0  GPU 0        │            ├ 82:00.0 ─ 83:00.0  GPU 1
│            └ 02:01.0 ─ 04:00.0  mlx5_0       │            ├ 82:01.0 ─ 84:00.0  mlx5_2
└ 00:02.0 ─ 05:00.0  mlx5_1                    │            └ 82:02.0 ─ 85:00.0  mlx5_3
                                              pci0000:c0 (NUMA 1)
                                              └ c0:01.0 ─ c1:00.0  GPU 2 (no NIC on its bridge)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric_core.errors import ConfigError
from fabric_core.models import Device, DomainInfo
from fabric_core.topology import (
    build_groups,
    find_gpus,
    gpu_domains,
    node_cpus,
    parse_cpulist,
    parse_override,
    pci_distance,
    pci_path,
)

TREE = {
    "0000:03:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", "gpu", 0),
    "0000:04:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", "nic", 0),
    "0000:05:00.0": ("pci0000:00/0000:00:02.0/0000:05:00.0", "nic", 0),
    "0000:83:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0", "gpu", 1),
    "0000:84:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0", "nic", 1),
    "0000:85:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:02.0/0000:85:00.0", "nic", 1),
    "0000:c1:00.0": ("pci0000:c0/0000:c0:01.0/0000:c1:00.0", "gpu", 1),
}
NICS = {
    "mlx5_0": "0000:04:00.0",
    "mlx5_1": "0000:05:00.0",
    "mlx5_2": "0000:84:00.0",
    "mlx5_3": "0000:85:00.0",
}


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    for bdf, (path, kind, node) in TREE.items():
        real = tmp_path / "devices" / path
        real.mkdir(parents=True)
        (real / "vendor").write_text("0x10de\n" if kind == "gpu" else "0x15b3\n")
        (real / "class").write_text("0x030200\n" if kind == "gpu" else "0x020700\n")
        (real / "numa_node").write_text(f"{node}\n")
        (links / bdf).symlink_to(real)
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = tmp_path / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    return tmp_path


def domains() -> list[DomainInfo]:
    return [
        DomainInfo(
            name=f"{name}:1",
            provider="verbs",
            pci_bus_id=bdf,
            numa_node=int(TREE[bdf][2]),
            max_msg_size=1 << 30,
            link_speed_gbps=400.0,
        )
        for name, bdf in NICS.items()
    ]


def names(group_domains: tuple[DomainInfo, ...]) -> list[str]:
    return [d.name for d in group_domains]


def test_pci_paths_and_distances(sysfs: Path) -> None:
    gpu0 = pci_path("0000:03:00.0", sysfs)
    assert gpu0 == ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    same_switch = pci_path("0000:04:00.0", sysfs)
    same_root = pci_path("0000:05:00.0", sysfs)
    other_socket = pci_path("0000:84:00.0", sysfs)
    assert gpu0 and same_switch and same_root and other_socket
    assert pci_distance(gpu0, same_switch) == 4  # up to the switch, down to the NIC
    assert pci_distance(gpu0, same_root) == 6
    assert pci_distance(gpu0, same_switch) < pci_distance(gpu0, same_root) < pci_distance(gpu0, other_socket)
    assert pci_path("0000:99:00.0", sysfs) is None


def test_each_gpu_gets_the_nics_behind_its_switch(sysfs: Path) -> None:
    groups = build_groups(domains(), sysfs)
    by_device = {str(g.device): g for g in groups}
    assert names(by_device["cuda:0"].domains) == ["mlx5_0:1"]
    assert names(by_device["cuda:1"].domains) == ["mlx5_2:1", "mlx5_3:1"]  # ties: both
    assert by_device["cuda:0"].numa_node == 0 and by_device["cuda:0"].cpus == (0, 1, 2, 3)
    assert by_device["cuda:1"].cpus == (4, 5, 6, 7)
    # GPU 2 shares no bridge with any NIC: the NICs of its NUMA node
    assert names(by_device["cuda:2"].domains) == ["mlx5_2:1", "mlx5_3:1"]
    # host memory: every NIC
    assert by_device["cpu"].device == Device() and len(by_device["cpu"].domains) == 4
    assert by_device["cpu"].numa_node is None


def test_cuda_visible_devices_renumbers_the_gpus(sysfs: Path) -> None:
    gpus = find_gpus(sysfs, visible="1,0")
    assert [(g.index, g.pci_bus_id) for g in gpus] == [(0, "0000:83:00.0"), (1, "0000:03:00.0")]
    groups = build_groups(domains(), sysfs, visible="2")
    assert [str(g.device) for g in groups] == ["cuda:0", "cpu"]
    assert names(groups[0].domains) == ["mlx5_2:1", "mlx5_3:1"]


def test_a_host_without_gpus_has_one_host_group(tmp_path: Path) -> None:
    groups = build_groups(domains()[:2], tmp_path)
    assert [str(g.device) for g in groups] == ["cpu"]
    assert groups[0].numa_node == 0 and groups[0].cpus == ()  # no node directory in this tree


def test_the_override_decides_the_groups(sysfs: Path) -> None:
    groups = build_groups(domains(), sysfs, override="cuda:0=mlx5_3,mlx5_0; cpu=mlx5_1")
    assert [(str(g.device), names(g.domains)) for g in groups] == [
        ("cuda:0", ["mlx5_3:1", "mlx5_0:1"]),
        ("cpu", ["mlx5_1:1"]),
    ]
    assert groups[0].numa_node is None and groups[1].cpus == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="mlx5_9, which is not an RDMA device here"):
        build_groups(domains(), sysfs, override="cuda:0=mlx5_9")


@pytest.mark.parametrize("text", ["cuda:0", "cuda:0=", "gpu0=mlx5_0", ";"])
def test_a_malformed_override_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_override(text)


def test_cpulists() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    assert parse_cpulist("x") == ()
    assert node_cpus(None) == ()


def test_a_gpus_domains_are_its_group_and_none_for_a_gpu_sysfs_does_not_show(sysfs: Path) -> None:
    """What an engine on CUDA device ``gpu`` opens by default where the NICs are PCI devices
    (fabric-efa: its EFA devices): the NICs of that GPU's group."""
    assert names(gpu_domains(0, domains(), sysfs)) == ["mlx5_0:1"]
    assert names(gpu_domains(1, domains(), sysfs)) == ["mlx5_2:1", "mlx5_3:1"]
    assert names(gpu_domains(0, domains(), sysfs, visible="1")) == ["mlx5_2:1", "mlx5_3:1"]
    assert gpu_domains(7, domains(), sysfs) == ()
    assert gpu_domains(0, domains(), sysfs / "nowhere") == ()
