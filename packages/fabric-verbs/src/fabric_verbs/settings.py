"""The verbs backend's own knobs, read from ``FABRIC_VERBS_*`` environment variables.

They live here, not in ``fabric_core.FabricSettings``, until fabric-core takes them: the
variable names are already the ones ``FabricSettings`` fields named ``verbs_<name>`` would
read (prefix ``FABRIC_``), so moving them changes no user's environment.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fabric_core.errors import ConfigError

__all__ = ["VerbsSettings", "load_verbs_settings"]


class VerbsSettings(BaseSettings):
    """How the verbs backend picks its devices, ports and GIDs, and sizes its queues."""

    model_config = SettingsConfigDict(env_prefix="FABRIC_VERBS_", extra="forbid", frozen=True)

    device: str | None = Field(
        None,
        description="RDMA devices of the group, in NIC order, comma-separated (e.g. 'mlx5_0,mlx5_3'). "
        "Unset: every device with an ACTIVE port, by name. With fewer devices than NICs, "
        "NIC i uses device i mod count (several domains share a device, e.g. Soft-RoCE).",
    )
    port: Annotated[int, Field(ge=0, le=255)] = Field(
        0, description="Port number on each device; 0: the first ACTIVE port."
    )
    gid_index: Annotated[int, Field(ge=-1, le=255)] = Field(
        -1,
        description="GID table index; -1: on RoCE the RoCE v2 GID of an IPv4 address (else any "
        "routable RoCE v2 GID, then RoCE v1), on InfiniBand the port GID.",
    )
    sq_depth: Annotated[int, Field(ge=16, le=1 << 20)] = Field(
        1024, description="Send queue depth of each RC queue pair (clamped to the device's max_qp_wr)."
    )
    imm_depth: Annotated[int, Field(ge=16, le=1 << 22)] = Field(
        16384,
        description="Imm receives kept posted on each NIC's shared receive queue (clamped to max_srq_wr). "
        "No RNR back-off while the imms in flight towards a NIC stay below it; "
        "peers x sq_depth bounds them.",
    )
    chain: Annotated[int, Field(ge=1, le=64)] = Field(
        16, description="Work requests posted per doorbell (a linked chain of ibv_send_wr)."
    )
    signal_every: Annotated[int, Field(ge=1, le=1 << 20)] = Field(
        16, description="Signal one work request in this many (and the last of every chain)."
    )
    connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        5.0,
        description="Handshake deadline: a peer that has not answered by then is PeerUnreachable "
        "(the handshake resends with exponential backoff until then).",
    )
    traffic_class: Annotated[int, Field(ge=0, le=255)] = Field(
        0, description="Traffic class (RoCE: DSCP << 2 | ECN) of the queue pairs' packets."
    )
    service_level: Annotated[int, Field(ge=0, le=15)] = Field(
        0, description="Service level (InfiniBand SL; RoCE: the priority) of the queue pairs."
    )
    topology: str | None = Field(
        None,
        description="Override detect_topology(): 'cuda:0=mlx5_0,mlx5_1;cuda:1=mlx5_2;cpu=mlx5_0' "
        "(group device = its devices, in NIC order).",
    )

    @field_validator("device", "topology")
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value if value is None or value.strip() else None

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices named by ``device``, in order."""
        if self.device is None:
            return ()
        return tuple(d.strip() for d in self.device.split(",") if d.strip())

    def options(self) -> dict[str, float]:
        """The compiled engine's options (``_verbs.Engine(options=...)``)."""
        return {
            "port": self.port,
            "gid_index": self.gid_index,
            "sq_depth": self.sq_depth,
            "imm_depth": self.imm_depth,
            "chain_max": self.chain,
            "signal_every": self.signal_every,
            "connect_timeout_s": self.connect_timeout_s,
            "traffic_class": self.traffic_class,
            "service_level": self.service_level,
        }


def load_verbs_settings(**overrides: Any) -> VerbsSettings:
    """Settings from the environment, with keyword overrides; bad values raise ``ConfigError``."""
    try:
        return VerbsSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"FABRIC_VERBS_{'.'.join(str(p) for p in e['loc']).upper() or 'SETTINGS'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid fabric-verbs settings: {problems}") from None
