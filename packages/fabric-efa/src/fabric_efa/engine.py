"""``EfaEngine``: fabric's contract on libfabric RDM endpoints through the C++ engine core."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fabric_core import cuda
from fabric_core.errors import BackendUnavailable, ConfigError
from fabric_core.models import Capabilities, DomainInfo
from fabric_core.native import HEADER_BYTES, NativeEngine, queue_limits
from fabric_core.settings import FabricSettings

from . import _efa

__all__ = ["EfaEngine", "default_queue_bytes", "default_queue_depth", "nic_domains", "pci_domains"]

logger = logging.getLogger(__name__)

# Endpoints closed in this process (kept by the compiled module, which the fast path reads).
# Writing to one of them would touch freed provider state (the shm provider crashes), so such
# writes fail with PeerUnreachable before posting. Only providers whose addresses name their
# process are guarded: a tcp address is a port, which another process may bind next, so a tcp
# address closed here says nothing about who owns it now. Peers that die in other processes
# are the liveness protocol's to detect.
_PROCESS_SCOPED = frozenset({"shm"})

# From how many pages a thread waiting on a paged transfer of host memory sleeps on it rather
# than draining (running the engine's progress and taking completions itself), per provider.
# On shm the peer is on this host and its progress copies the bytes with the CPU: a waiter
# spinning through a transfer of milliseconds took that CPU from it (and the provider's spin
# locks from their holders). On the 2-core host, 1,024-page requests went from 277-297k to
# 420-442k pages/s in one mode of the machine and from 537-640k to 814-848k in the other
# (alternated runs); 256 pages: 688-713k against 722-747k. Over tcp, where the kernel moves
# the bytes, draining stays: 1,024 pages 214-218k pages/s draining against 181-191k without.
_DRAIN_MAX_PAGES = {"shm": 256}

# The queue depth (``FabricSettings.queue_depth``) where the settings make no choice: writes
# posted and not yet completed per peer and NIC. On shm a target copies its whole queue holding
# the queue's lock, and a sender whose post meets a busy target spins on that lock until the
# batch is done while its other targets starve; two writes per peer keep each post short, so
# several senders' writes interleave across their targets: an RL update (4 trainers, 2
# inference ranks, 2 cores) went from 460-502 ms at 256 to 272-283 ms at 2, and a KV transfer
# did not suffer (6.04 GB/s at 2, 5.77 at 256). Elsewhere (tcp, efa) 256 as before: the depth
# was measured on shm only (docs/backends/efa.md, "Queue depth").
_QUEUE_DEPTH = {"shm": 2}
_QUEUE_DEPTH_ELSEWHERE = 256
# Past the depth, writes to a peer still go while they come to at most these bytes
# (``FabricSettings.queue_bytes``): what a post on shm spins behind is the bytes the target
# copies, so two writes of an RL update's megabytes, but 64 of 64 KiB. A single 64 KiB
# stream held to 2 writes left the target idle between refills (2-core host: 4.2-5.0 GB/s at
# a depth of 2, 8.9-13.4 at 64).
_QUEUE_BYTES = {"shm": 4 << 20}


def default_queue_depth(provider: str) -> int:
    """The queue depth an engine on ``provider`` takes where ``queue_depth`` is None."""
    return _QUEUE_DEPTH.get(provider, _QUEUE_DEPTH_ELSEWHERE)


def default_queue_bytes(provider: str) -> int:
    """The byte allowance past the depth an engine on ``provider`` takes where ``queue_bytes``
    is None (0: none)."""
    return _QUEUE_BYTES.get(provider, 0)


_MR_MODES = {
    1 << 2: "local",
    1 << 3: "raw",
    1 << 4: "virt_addr",
    1 << 5: "allocated",
    1 << 6: "prov_key",
    1 << 7: "mmu_notify",
    1 << 8: "rma_event",
    1 << 9: "endpoint",
    1 << 10: "hmem",
}


def pci_domains(listed: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The domains ``list_domains`` gave that are PCI devices (real NICs: efa), in its order."""
    return [d for d in listed if d.get("pci")]


def nic_domains(
    listed: Sequence[Mapping[str, Any]],
    nics: int,
    names: str | None,
    provider: str,
    near: Sequence[str] = (),
) -> list[str]:
    """The provider domain each of ``nics`` NICs opens ("" for the provider's first), from the
    domains the provider lists (``_efa.list_domains``) and ``efa_domains`` (``names``): the
    named ones, NIC i on name i mod count; unset, the provider's domains on PCI devices (real
    NICs: an EFA device each) where there are several: those ``near`` the engine's GPU where
    given (its topology group), else all of them, NIC i on the i-th mod count; else "" for
    every NIC (shm, tcp: several endpoints on one domain emulate several NICs)."""
    known = [str(d["name"]) for d in listed]
    if names is not None:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        missing = [n for n in wanted if n not in known]
        if not wanted or missing:
            raise ConfigError(
                f"efa_domains names {', '.join(missing) or 'no domain'}, which provider {provider!r} does "
                f"not offer here (it has: {', '.join(known) or 'none'})"
            )
        return [wanted[i % len(wanted)] for i in range(nics)]
    physical = [str(d["name"]) for d in pci_domains(listed)]
    if len(physical) > 1:
        chosen = [n for n in near if n in physical] or physical
        return [chosen[i % len(chosen)] for i in range(nics)]
    return [""] * nics


def _near_gpu(listed: Sequence[Mapping[str, Any]], provider: str, sysfs: str = "/sys") -> list[str]:
    """The names of the provider's PCI domains closest to this thread's CUDA device (its
    ``detect_topology`` group), where there are several and a GPU; else none."""
    import os

    from fabric_core.topology import gpu_domains

    physical = pci_domains(listed)
    if len(physical) < 2 or not cuda.available():
        return []
    infos = domain_infos(physical, provider, 1)
    near = gpu_domains(cuda.current_device(), infos, sysfs, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [d.name for d in near]


def domain_infos(listed: Sequence[Mapping[str, Any]], provider: str, max_msg_size: int) -> list[DomainInfo]:
    """A ``DomainInfo`` per domain the provider lists (``detect_topology``): its PCI function,
    NUMA node and link speed where the provider gives them."""
    from fabric_core.topology import numa_node_of

    out = []
    for d in listed:
        pci = str(d.get("pci") or "") or None
        speed = int(d.get("speed_bps") or 0)
        details: dict[str, str | int | bool] = {"fabric": str(d.get("fabric", ""))}
        if d.get("device"):
            details["device"] = str(d["device"])
        out.append(
            DomainInfo(
                name=str(d["name"]),
                provider=provider,
                link_speed_gbps=speed / 1e9 if speed else None,
                numa_node=numa_node_of(pci) if pci else None,
                pci_bus_id=pci,
                max_msg_size=max_msg_size,
                details=details,
            )
        )
    return out


def _details(info: dict[str, Any]) -> dict[str, str | int | bool]:
    """The provider's limits as ``fabric info`` shows them."""
    mode = int(info["mr_mode"])
    major, minor = _efa.libfabric_version()
    return {
        "libfabric": f"{major}.{minor}",
        "fabric": str(info["fabric"]),
        "mr_mode": "|".join(name for bit, name in _MR_MODES.items() if mode & bit) or "basic",
        "inject_bytes": int(info["inject_size"]),
        "tx_depth": int(info["tx_size"]),
        "cq_data_bytes": int(info["cq_data_size"]),
        # small writes of multi-write requests confirmed by delivery markers (shm), instead of
        # each asking for delivery complete (docs/backends/efa.md)
        "delivery_markers": bool(info["delivery_markers"]),
        # local registration as the efa provider wants it, checked at every post (a test mode)
        "strict_mr": bool(info["strict_mr"]),
        # lone writes of up to this many bytes go as eager frames to the target's engine (tcp)
        "eager_max": int(info["eager_max"]),
        # a paged request's pages go up to this many a write, one imm counting them all (tcp)
        "list_pages": int(info["list_pages"]),
        # the engines' control-frame version: every engine of a job must speak the same
        "wire_protocol": int(info["wire_protocol"]),
    }


def _probe_cuda(core: Any, hmem: bool, ipc: bool = False) -> tuple[bool, str]:
    """Whether CUDA memory registers on this provider, and why not. A provider may report
    FI_HMEM from a libfabric built without CUDA (its registrations then fail with ENOSYS):
    one registration of a small device buffer at open tells, so that ``cuda_memory`` is
    true only where it works and CUDA tensors are refused at registration elsewhere.
    ``ipc``: the engine carries CUDA memory over CUDA IPC itself (fabric/cuda_ipc.hpp)."""
    if not cuda.available():
        return False, cuda.unavailable_reason() or "no CUDA GPU"
    if not hmem and not ipc:
        return False, "the provider has no FI_HMEM"
    try:
        with cuda.device_buffer(4096, cuda.current_device()) as ptr:
            handle, _keys = core.register_memory(ptr, 4096, True)
            core.deregister(handle)
    except RuntimeError as exc:
        return False, f"this libfabric cannot register CUDA memory ({exc})"
    return True, ""


class EfaEngine(NativeEngine):
    """One domain group of ``settings.nics`` endpoints on ``settings.efa_provider``."""

    def __init__(self, settings: FabricSettings) -> None:
        nics = settings.nics or 1
        provider = settings.efa_provider
        sources = [a.strip() for a in settings.efa_nic_addrs.split(",")] if settings.efa_nic_addrs else []
        if sources and (len(sources) != nics or not all(sources)):
            raise ConfigError(
                f"efa_nic_addrs names {len(sources)} address(es) for {nics} NIC(s): give one per NIC"
            )
        listed = _efa.list_domains(provider)
        near = _near_gpu(listed, provider) if settings.efa_domains is None else []
        domains = nic_domains(listed, nics, settings.efa_domains, provider, near)
        # One host (shm): CUDA memory over CUDA IPC, which the provider then need not carry.
        ipc = provider == "shm" and settings.efa_cuda_ipc and cuda.available()
        try:
            core = _efa.Engine(
                provider,
                nics,
                settings.chaos_seed,
                -1 if settings.worker_cpu is None else settings.worker_cpu,
                settings.recv_depth,
                settings.max_send_size + HEADER_BYTES,
                sources,
                cuda.available() and not ipc,  # FI_HMEM only where there is GPU memory to register
                cuda.current_device() if ipc else -1,
                settings.efa_delivery_markers,
                settings.efa_strict_mr,
                domains,
                settings.efa_eager_max,
                settings.efa_list_pages,
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                "efa", f"cannot open {nics} endpoint(s) on provider {provider!r}: {exc}"
            ) from exc
        info: dict[str, Any] = core.provider_info()
        self.provider_info = info
        max_msg = int(info["max_msg_size"]) or (1 << 30)
        max_msg = min(max_msg, 1 << 62, settings.max_msg_size or (1 << 62))
        details = _details(info)
        cuda_ok, why = _probe_cuda(core, bool(info["hmem"]), bool(info["cuda_ipc"]))
        carried = "yes (CUDA IPC)" if info["cuda_ipc"] else "yes"
        details["cuda_memory"] = carried if cuda_ok else f"no: {why}"
        if info["cuda_ipc"]:  # how CUDA IPC writes move: kernel launches per poll, imms via the inbox
            ways = (("cuda_copy_kernel", "cuda_copy_kernel_off"), ("cuda_imm_inbox", "cuda_inbox_off"))
            for key, off in ways:
                details[key] = f"no: {info[off]}" if info[off] else "yes"
        by_name = {str(d["name"]): d for d in listed}
        # the names efa_domains takes (FABRIC_EFA_DOMAINS): what `fabric info` shows a user
        details["provider_domains"] = ", ".join(by_name) or "none"
        depth = default_queue_depth(str(info["provider"]))
        allowance = default_queue_bytes(str(info["provider"]))
        details["queue_depth"], details["queue_bytes"] = queue_limits(settings, depth, allowance)
        for a in core.addresses():  # an address can be reused
            _efa.reopen_address(a)
        super().__init__(
            settings,
            core,
            Capabilities(
                backend="efa",
                num_nics=nics,
                max_msg_size=max_msg,
                max_send_size=settings.max_send_size,
                cuda_memory=cuda_ok,
            ),
            [
                DomainInfo(
                    name=f"{domains[i] or info['domain']}#{i}",
                    provider=str(info["provider"]),
                    max_msg_size=max_msg,
                    pci_bus_id=str(by_name.get(domains[i] or info["domain"], {}).get("pci") or "") or None,
                    details=details,
                )
                for i in range(nics)
            ],
            guarded=str(info["provider"]) in _PROCESS_SCOPED,
            where=f"provider {info['provider']}",
            queue_depth=depth,
            queue_bytes=allowance,
            drain_max_pages=_DRAIN_MAX_PAGES.get(str(info["provider"])),
        )

    def _is_closed(self, address: bytes) -> bool:
        return bool(_efa.is_closed(address))

    def _mark_closed(self, address: bytes) -> None:
        _efa.close_address(address)
