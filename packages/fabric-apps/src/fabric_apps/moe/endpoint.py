"""``MoeEndpoint``: what the other ranks need to write into one rank's buffers.

Exchanged once at setup (in process, through a ``torch.distributed`` store with
``fabric_core.Rendezvous``, or any side channel: it is plain bytes).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fabric_core.errors import ConfigError
from fabric_core.models import DomainAddress, MemoryRegionDescriptor

__all__ = ["ENDPOINT_VERSION", "MoeEndpoint"]

logger = logging.getLogger(__name__)

ENDPOINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class MoeEndpoint:
    """One rank of one layer: its engine's address, NIC count and largest message size (the
    counting rule of its writes depends on them), its config fingerprint and the
    descriptors of its three receive buffers."""

    rank: int
    layer: int
    fingerprint: str
    num_nics: int
    max_msg_size: int
    address: DomainAddress
    counts: MemoryRegionDescriptor
    tokens: MemoryRegionDescriptor
    combine: MemoryRegionDescriptor

    def to_bytes(self) -> bytes:
        doc = {
            "moe_endpoint": ENDPOINT_VERSION,
            "rank": self.rank,
            "layer": self.layer,
            "fingerprint": self.fingerprint,
            "num_nics": self.num_nics,
            "max_msg_size": self.max_msg_size,
            "address": str(self.address),
            "counts": self.counts.to_bytes().hex(),
            "tokens": self.tokens.to_bytes().hex(),
            "combine": self.combine.to_bytes().hex(),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> MoeEndpoint:
        """Parse ``to_bytes()``; anything else raises ``ConfigError`` saying what is wrong."""
        try:
            doc = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"not a MoE endpoint: {exc}") from None
        if not isinstance(doc, dict) or doc.get("moe_endpoint") != ENDPOINT_VERSION:
            raise ConfigError(f"not a version-{ENDPOINT_VERSION} MoE endpoint")
        try:
            ints = {k: doc[k] for k in ("rank", "layer", "num_nics", "max_msg_size")}
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()):
                raise ConfigError(f"MoE endpoint: non-integer field in {ints}")
            fingerprint = doc["fingerprint"]
            if not isinstance(fingerprint, str):
                raise ConfigError("MoE endpoint: fingerprint must be a string")
            return cls(
                rank=ints["rank"],
                layer=ints["layer"],
                fingerprint=fingerprint,
                num_nics=ints["num_nics"],
                max_msg_size=ints["max_msg_size"],
                address=DomainAddress.from_hex(doc["address"]),
                counts=MemoryRegionDescriptor.from_bytes(bytes.fromhex(doc["counts"])),
                tokens=MemoryRegionDescriptor.from_bytes(bytes.fromhex(doc["tokens"])),
                combine=MemoryRegionDescriptor.from_bytes(bytes.fromhex(doc["combine"])),
            )
        except KeyError as exc:
            raise ConfigError(f"MoE endpoint: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"MoE endpoint: {exc}") from None
