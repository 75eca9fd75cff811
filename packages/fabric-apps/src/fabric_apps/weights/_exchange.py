"""Setup through a ``torch.distributed`` Store: metadata from both fleets, gathered once.

Keys, under ``prefix``:

=====================  ===========  ==========================================================
key                    written by   value
=====================  ===========  ==========================================================
``src/spec``           source 0     the source ``FleetSpec`` (JSON)
``src/options``        source 0     the ``PlanOptions`` (JSON)
``src/<rank>``         each source  spec digest, address, NIC count, ``max_msg_size``
``dst/spec``           dest 0       the destination ``FleetSpec`` (JSON)
``dst/<rank>``         each dest    spec digest, address, NIC count, descriptor
``plan``               source 0     the plan's digest
=====================  ===========  ==========================================================

Every rank computes the plan itself from the gathered metadata (no rank sends it to the
others), with ``num_nics`` from the engines and ``max_write_bytes`` capped at the smallest
``max_msg_size`` among the senders, then checks its digest against source rank 0's. Use one
prefix per pairing of fleets (a job id in it): keys are never overwritten.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

from fabric_core.api import TransferEngine
from fabric_core.errors import ConfigError, PeerUnreachable
from fabric_core.models import DomainAddress, MemoryRegionDescriptor
from fabric_core.rendezvous import Store

from .plan import PlanOptions, TransferPlan, make_plan
from .spec import FleetSpec

__all__ = ["Exchanged", "exchange"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Exchanged:
    plan: TransferPlan
    addresses: tuple[DomainAddress, ...]
    """Source ranks' main addresses, in rank order."""
    descriptors: tuple[MemoryRegionDescriptor, ...]
    """Destination ranks' descriptors, in rank order (empty at a destination)."""


class _Keys:
    def __init__(self, store: Store, prefix: str, deadline: float) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"prefix must be a non-empty str, got {prefix!r}")
        self.store, self.prefix, self.deadline = store, prefix, deadline

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def set(self, value: str, *parts: str) -> None:
        self.store.set(self.key(*parts), value)

    def get(self, *parts: str) -> bytes:
        key = self.key(*parts)
        left = max(0.001, self.deadline - time.monotonic())
        try:
            self.store.wait([key], timedelta(seconds=left))
        except Exception as exc:  # each store raises its own types on timeout
            raise PeerUnreachable(f"{key!r} was not published in time ({exc})") from exc
        return bytes(self.store.get(key))

    def json(self, *parts: str) -> Any:
        try:
            return json.loads(self.get(*parts))
        except ValueError as exc:
            raise ConfigError(f"{self.key(*parts)!r} is not JSON: {exc}") from None


def exchange(
    store: Store,
    *,
    side: Literal["source", "destination"],
    rank: int,
    spec: FleetSpec,
    engine: TransferEngine,
    options: PlanOptions | None,
    descriptor: MemoryRegionDescriptor | None,
    prefix: str,
    timeout: float,
) -> Exchanged:
    """Publish this rank's metadata, gather what it needs and compute the plan."""
    if not isinstance(spec, FleetSpec):
        raise ConfigError(f"spec must be a FleetSpec, got {type(spec).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world_size:
        raise ConfigError(f"{side} rank {rank!r} is outside [0, {spec.world_size})")
    keys = _Keys(store, prefix, time.monotonic() + timeout)
    tag = "src" if side == "source" else "dst"
    me: dict[str, Any] = {
        "spec": spec.digest(),
        "address": engine.address.raw.hex(),
        "nics": engine.num_nics,
        "max_msg_size": engine.capabilities.max_msg_size,
    }
    if descriptor is not None:
        me["descriptor"] = descriptor.to_bytes().hex()
    if rank == 0:
        keys.set(spec.to_json(), tag, "spec")
        if side == "source":
            keys.set(json.dumps((options or PlanOptions()).to_dict(), sort_keys=True), "src", "options")
    keys.set(json.dumps(me, sort_keys=True), tag, str(rank))

    src_spec = FleetSpec.from_json(keys.get("src", "spec"))
    dst_spec = FleetSpec.from_json(keys.get("dst", "spec"))
    if (src_spec if side == "source" else dst_spec).digest() != spec.digest():
        raise ConfigError(f"{side} rank {rank}'s FleetSpec differs from {side} rank 0's")
    opts = PlanOptions.from_dict(keys.json("src", "options"))
    srcs = [keys.json("src", str(r)) for r in range(src_spec.world_size)]
    peers = srcs
    dsts: list[Any] = []
    if side == "source":
        dsts = [keys.json("dst", str(r)) for r in range(dst_spec.world_size)]
        peers = srcs + dsts
    odd = sorted({int(p["nics"]) for p in peers} - {engine.num_nics})
    if odd:
        raise ConfigError(
            f"every rank of both fleets must have the same NIC count: this one has {engine.num_nics}, "
            f"others have {odd}"
        )
    max_write = min([opts.max_write_bytes] + [int(p["max_msg_size"]) for p in srcs])
    plan = make_plan(src_spec, dst_spec, replace(opts, num_nics=engine.num_nics, max_write_bytes=max_write))
    digest = plan.digest()
    if side == "source" and rank == 0:
        keys.set(digest, "plan")
    elif keys.get("plan").decode() != digest:
        raise ConfigError(
            f"{side} rank {rank} computed another plan than source rank 0: are both running the same "
            "fabric-apps version?"
        )
    logger.debug("weights: %s rank %d joined plan %s", side, rank, digest[:12])
    try:
        addresses = tuple(DomainAddress(raw=bytes.fromhex(p["address"])) for p in srcs)
        descriptors = tuple(MemoryRegionDescriptor.from_bytes(bytes.fromhex(p["descriptor"])) for p in dsts)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"malformed rank metadata in the store: {exc}") from None
    return Exchanged(plan, addresses, descriptors)
