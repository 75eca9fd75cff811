"""Engine configuration, read from ``FABRIC_*`` environment variables and keyword arguments."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError

__all__ = ["FabricSettings", "load_settings"]


class FabricSettings(BaseSettings):
    """Every knob of fabric. ``fabric info`` prints each with its description and value."""

    model_config = SettingsConfigDict(env_prefix="FABRIC_", extra="forbid", frozen=True)

    backend: str = Field(
        "auto",
        description="Backend to open: 'auto' (efa, then verbs), 'efa', 'verbs' or 'sim'.",
    )
    nics: Annotated[int, Field(ge=1, le=64)] | None = Field(
        None,
        description="NICs per domain group (None: every NIC the topology gives the group; "
        "the simulator defaults to 2).",
    )
    max_msg_size: Annotated[int, Field(ge=64)] | None = Field(
        None,
        description="Cap on one work request's bytes, below the provider's own limit. "
        "Larger shards are split; each piece carries the imm.",
    )
    timeout_s: Annotated[float, Field(gt=0)] = Field(
        60.0,
        description="Default deadline in seconds of every transfer (past it the transfer "
        "fails with TransferTimeout), and of Transfer.wait, counter waits, recv and close() "
        "draining, when a call gives none.",
    )
    liveness_interval_s: Annotated[float, Field(ge=0)] = Field(
        1.0,
        description="Probe a peer that in-flight work or a counter wait depends on after this "
        "many seconds without a sign of life from it (0: never probe; transport errors still "
        "count). Compiled backends.",
    )
    liveness_timeout_s: Annotated[float, Field(gt=0)] = Field(
        10.0,
        description="A peer that leaves a liveness probe unanswered this long is lost: its "
        "transfers fail with PeerUnreachable, waits naming it fail, its connection state is "
        "dropped. A compiled engine whose progress stays inside one provider call this long "
        "closes itself (EngineWedged).",
    )
    queue_depth: Annotated[int, Field(ge=0, le=1 << 20)] | None = Field(
        None,
        description="Writes posted to the provider and not yet completed, at most, per peer and "
        "NIC (0: as many as the provider takes; None: the backend's choice, 2 on efa's shm "
        "provider, 256 on its others and on verbs). The rest wait in the engine, per peer, so "
        "other peers' traffic goes on. On shm 2 takes an RL update from about 480 to about 280 "
        "ms on 2 cores (docs/backends/efa.md). Compiled backends.",
    )
    queue_bytes: Annotated[int, Field(ge=0, le=1 << 40)] | None = Field(
        None,
        description="Past ``queue_depth``, a write to a peer is still posted while that peer's "
        "posted writes and it come to at most this many bytes per NIC and no other peer has "
        "writes posted (0: the depth alone holds; None: the backend's choice, 4 MiB on efa's shm "
        "provider, 0 elsewhere). A stream of small writes to one peer then keeps its target "
        "busy where large ones, and writes spread over peers, stay at the depth. Compiled "
        "backends.",
    )
    recv_depth: Annotated[int, Field(ge=1, le=1 << 16)] = Field(
        64, description="Receive buffers kept posted for two-sided control messages."
    )
    max_send_size: Annotated[int, Field(ge=64, le=1 << 24)] = Field(
        65536, description="Largest two-sided control message in bytes."
    )
    chaos_seed: int | None = Field(
        None,
        description="Shuffle shard posting and completion delivery with this seed "
        "(compiled backends), to exercise consumers unordered on in-order providers.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="Level of the 'fabric_core' loggers when set up by the CLI."
    )
    efa_provider: str = Field(
        "efa",
        description="libfabric provider of the efa backend: 'efa' on AWS; 'shm' (one host) or "
        "'tcp;ofi_rxm' (set FI_TCP_IFACE) anywhere else. Same code path.",
    )
    efa_nic_addrs: str | None = Field(
        None,
        description="Comma-separated local addresses, one per NIC: NIC i binds to the i-th "
        "(providers that bind to an IP interface, as tcp: one interface per NIC). Default: "
        "the provider's choice.",
    )
    efa_domains: str | None = Field(
        None,
        description="The provider's domains (NICs) of the group, in NIC order, comma-separated "
        "(e.g. 'rdmap16s27-rdm,rdmap32s27-rdm'; `fabric info` lists them). With fewer than "
        "NICs, NIC i takes domain i mod count. Default: where the provider lists several "
        "domains on PCI devices (efa: one per EFA device), NIC i takes the i-th of them; "
        "otherwise every NIC opens the provider's first (shm, tcp: endpoints emulate NICs).",
    )
    efa_topology: str | None = Field(
        None,
        description="Override of the efa backend's detect_topology(): "
        "'cuda:0=DOMAIN[,DOMAIN...];cuda:1=...;cpu=...'. Default: each GPU with the provider's "
        "PCI domains closest to it (fabric_core.topology), then a host group with all of them.",
    )
    efa_cuda_ipc: bool = Field(
        True,
        description="On one host (provider 'shm'), carry CUDA memory between processes with "
        "CUDA IPC copies (NVLink or the GPU's copy engines) on the engine's own stream; the imm "
        "follows through the provider once the bytes are in place.",
    )
    efa_delivery_markers: bool = Field(
        True,
        description="On shm, confirm the small writes of multi-write requests with delivery "
        "markers (one delivery-complete control frame behind many writes that shm applies in "
        "order) instead of asking each for delivery complete, which shm sends one at a time "
        "per peer. Off: every write delivery complete.",
    )
    efa_eager_max: Annotated[int, Field(ge=0, le=16384)] = Field(
        4096,
        description="On tcp;ofi_rxm, a write of up to this many bytes that is its request's "
        "only work request goes as a control frame to the target's engine, which copies it "
        "into the region, counts its imm and acknowledges it; the write completes on that "
        "acknowledgement. tcp's delivery-complete write pays an acknowledgement the target's "
        "provider sends before it reports the imm. 0: every write through the provider. "
        "Both sides must run a fabric that knows these frames.",
    )
    efa_list_pages: Annotated[int, Field(ge=1, le=8)] = Field(
        4,
        description="On tcp;ofi_rxm, the pages of a paged request to one NIC go up to this "
        "many per write: one write scattering them, whose imm the target counts once per "
        "page. Capped at the provider's iov limits; 1: every page its own write. Both sides "
        "must run a fabric of the same wire protocol.",
    )
    efa_strict_mr: bool = Field(
        False,
        description="A test mode: register every local buffer handed to the provider and pass "
        "its descriptor, as the efa provider wants (FI_MR_LOCAL), whatever the provider says, "
        "and check each post's descriptor against the endpoint's own registrations. A post "
        "that names no registration, another endpoint's, a closed one or one that does not "
        "cover its buffer aborts the process with the reason on stderr. Runs efa's "
        "registration rules on shm and tcp;ofi_rxm, which ignore descriptors.",
    )
    worker_cpu: int | None = Field(
        None, description="Pin the engine's worker thread to this CPU (compiled backends)."
    )
    sim_seed: int = Field(0, description="Simulator: seed of every reordering decision.")
    sim_chunk_bytes: Annotated[int, Field(ge=1)] = Field(
        65536,
        description="Simulator: largest chunk a write is cut into; chunks land in shuffled "
        "order so partial data is visible before the imm.",
    )
    sim_link: str | None = Field(
        None,
        description="Simulator: link-model preset for a virtual clock "
        "(e.g. 'cx7-400g', 'efa-p5'); unset means no timing model.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def load_settings(**overrides: Any) -> FabricSettings:
    """Settings from the environment, with keyword overrides; bad values raise ConfigError."""
    try:
        return FabricSettings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid fabric settings: {problems}") from None
