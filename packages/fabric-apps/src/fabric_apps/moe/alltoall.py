"""``MoeAllToAll``: expert-parallel dispatch and combine over one-sided WriteImm.

One instance per rank per buffer set. Each step is four calls, in order:

1. ``dispatch_send(x, topk_idx, topk_weights)``: write this rank's token counts to every rank
   (one scatter through the peer group, one imm per destination), then each token once to
   every rank that owns at least one of its experts (packed per destination: one write per
   destination, sharded over the NICs);
2. ``dispatch_recv(timeout)``: wait, per source rank, for its count and then for exactly the
   work requests its payload write carries; return the tokens grouped by local expert;
3. ``combine_send(expert_outputs)``: write the output rows back to their tokens' origin,
   packed (one write per origin, sharded over the NICs, at the rows the origin announced in
   its count record; an imm-only write where a rank has nothing for an origin, so every pair
   of ranks signals in every phase);
4. ``combine_recv(timeout)``: wait, per rank, for exactly its writes; return the top-k
   weighted sum (``weighted_sum``: float32, ascending k).

The send halves never block on the network and the receive halves are separate calls, so a
caller overlaps them with compute, and runs micro-batches on separate instances (separate
``layer`` ids). See ``docs/apps/moe.md`` for the protocol, buffer layout and imm layout.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import numpy as np
import torch

from fabric_core.api import TransferEngine
from fabric_core.errors import (
    ConfigError,
    EngineClosed,
    FabricError,
    PeerUnreachable,
    TransferTimeout,
    TransportError,
)
from fabric_core.models import MemoryRegion
from fabric_core.ops import (
    ImmRequest,
    ScatterRequest,
    ScatterTarget,
    Sharded,
    ShardPeers,
    WriteRequest,
    plan_request,
)
from fabric_core.rendezvous import Rendezvous
from fabric_core.transfer import Transfer

from ._routing import check_inputs, combine_positions, destinations, group_received, weighted_sum
from .config import MoeConfig
from .endpoint import MoeEndpoint
from .errors import MoeProtocolError, MoeStateError, StepAborted
from .imms import MAX_LAYER, Phase, moe_imm
from .result import DispatchResult

__all__ = ["DEFAULT_TIMEOUT_S", "MoeAllToAll"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""Deadline of a receive half (and of draining the previous step's sends) when none is given."""

# one count record, origin -> destination q (int64 each): tokens sent to q, step, and where
# in the origin's combine buffer q writes its rows back (first row, rows)
_COUNT_BYTES = 32
_IDLE, _DISPATCHED, _RECEIVED, _COMBINING = "idle", "dispatched", "received", "combining"
_SHARD_PEERS = ShardPeers()
_SETTLE_S = 0.005  # how long a receive half gives its own sends to end (a GPU copy: ~50 us)

# layer ids in use per engine: two live instances on one engine must not share imms
_claims: weakref.WeakKeyDictionary[TransferEngine, set[int]] = weakref.WeakKeyDictionary()
_claims_lock = threading.Lock()


class MoeAllToAll:
    """Dispatch and combine of one MoE layer (or of several run one after another on the
    same buffers) for one rank.

    ``layer`` (0..2047) goes into every imm: instances that are in flight at the same time
    (layers with their own buffers, micro-batches) need distinct ids; one engine refuses two
    live instances with the same id. Buffers are allocated and registered here, once, sized
    for the worst case (``MoeConfig.buffer_bytes()``). Call ``connect`` (or
    ``connect_rendezvous``) once with every rank's ``endpoint`` before the first step.

    Not thread-safe: one caller thread per instance (a concurrent call raises
    ``MoeStateError``). Any transport failure fails the call that meets it with
    ``PeerUnreachable``, ``TransferTimeout`` or another ``TransportError``; later calls raise
    ``StepAborted``.
    """

    def __init__(
        self,
        engine: TransferEngine,
        config: MoeConfig,
        *,
        layer: int = 0,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(config, MoeConfig):
            raise ConfigError(f"config must be a MoeConfig, got {type(config).__name__}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= MAX_LAYER:
            raise ConfigError(f"layer must be an int in [0, {MAX_LAYER}], got {layer!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        self.engine, self.config, self.layer, self.timeout = engine, config, layer, float(timeout)
        with _claims_lock:
            held = _claims.setdefault(engine, set())
            if layer in held:
                raise ConfigError(
                    f"layer id {layer} is already used by a live MoeAllToAll on this engine: "
                    "instances in flight together need distinct ids (their imms would collide)"
                )
            held.add(layer)
        self._owner = config.owner_array()  # the owning rank of each expert
        self._regions: list[MemoryRegion] = []
        try:
            self._allocate()
        except BaseException:
            self._release()
            raise
        self._peers: tuple[MoeEndpoint, ...] = ()
        self._count_targets: tuple[ScatterTarget, ...] = ()
        self._group: Any = None
        self._count_imms: tuple[int, ...] = ()
        self._imm_cache: dict[tuple[int, int, int], int] = {}
        self._step = 0
        self._state = _IDLE
        self._broken: BaseException | None = None
        self._closed = False
        self._busy = threading.Lock()
        self._committed = False
        self._dispatch_xfers: list[Transfer] = []
        self._combine_xfers: list[Transfer] = []
        # per step: inputs kept for the combine, and what the combine sends and expects
        self._idx = torch.empty(0, config.top_k, dtype=torch.int64)
        self._weights = torch.empty(0, config.top_k, dtype=torch.float32)
        self._pairs_from = [0] * config.world_size  # combine rows each rank sends back
        self._rows = 0
        self._row_order = np.zeros(0, dtype=np.int64)  # rows packed by origin rank
        self._pos = torch.empty(0, dtype=torch.int64)  # each (t, k) slot's row in recv_combine
        self._rows_to: list[int] = []  # rows per origin rank
        self._rows_at: list[int] = []  # first row of each origin's in its combine buffer

    # --- buffers ------------------------------------------------------------------
    def _allocate(self) -> None:
        c = self.config
        w, t, k, h = c.world_size, c.max_tokens, c.top_k, c.hidden
        rec, meta = c.record_bytes, c.meta_bytes
        dev = torch.device(c.device)
        # count records live in host memory whatever the device: the host builds and reads
        # them, so a GPU layer copies none of them and waits for no stream before sending
        self._send_counts = torch.zeros(w, _COUNT_BYTES // 8, dtype=torch.int64)
        self._recv_counts = torch.zeros(w, _COUNT_BYTES // 8, dtype=torch.int64)
        # the large buffers are sized for the worst case and never read before written: left
        # uninitialised, the host pages nobody touches are never backed (EP64 at H=7168 holds
        # ~0.6 GB of buffers per rank, of which a decode step touches a few percent)
        # records are packed by destination rank, back to back (rank q's tokens, ascending,
        # then rank q + 1's), so each destination takes one write
        self._send_tokens = torch.empty(w * t, rec, dtype=torch.uint8, device=dev)
        self._recv_tokens = torch.empty(w * t, rec, dtype=torch.uint8, device=dev)
        self._send_combine = torch.empty(max(1, c.max_pairs), h, dtype=c.dtype, device=dev)
        # the origin's combine rows, packed by serving rank (combine_positions)
        self._recv_combine = torch.empty(t * k, h, dtype=c.dtype, device=dev)
        # record views: int32 header (source token, K expert ids), then the hidden state
        self._send_meta = self._send_tokens[:, :meta].view(torch.int32)
        self._send_hidden = self._send_tokens[:, meta : meta + c.token_bytes].view(c.dtype)
        self._recv_meta = self._recv_tokens[:, :meta].view(torch.int32)
        self._recv_hidden = self._recv_tokens[:, meta : meta + c.token_bytes].view(c.dtype)
        # pinned host staging for what the GPU needs from the host: a copy from pageable
        # memory waits for the stream (a sync per copy), one from pinned memory is queued
        # behind it. "send": a dispatch's tokens to pack and their packed headers (one copy)
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_np: dict[str, np.ndarray[Any, Any]] = {}
        if dev.type == "cuda":
            for name, n in (
                ("send", w * t * (1 + meta // 8)),
                ("pos", t * k),
                ("rows", w * t),
                ("order", max(1, c.max_pairs)),
            ):
                self._staging[name] = torch.empty(n, dtype=torch.int64, pin_memory=True)
                self._staging_np[name] = self._staging[name].numpy()
        reg = self._register
        self._send_counts_np = self._send_counts.numpy()  # the records are written through this
        self._send_counts_mr = reg(self._send_counts, False)
        self._recv_counts_mr = reg(self._recv_counts, True)
        self._send_tokens_mr = reg(self._send_tokens, False)
        self._recv_tokens_mr = reg(self._recv_tokens, True)
        self._send_combine_mr = reg(self._send_combine, False)
        self._recv_combine_mr = reg(self._recv_combine, True)

    def _to_device(self, array: np.ndarray[Any, Any], slot: str) -> torch.Tensor:
        """``array`` (int64, 1-D) on the layer's device: through its pinned staging slot on a
        GPU, written by numpy (one slot per use in a step; every step syncs the stream before
        the slots are written again)."""
        staging = self._staging.get(slot)
        if staging is None:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        n = array.size
        self._staging_np[slot][:n] = array
        return staging[:n].to(self._send_tokens.device, non_blocking=True)

    def _upload_records(
        self, tok: np.ndarray[Any, Any], meta: np.ndarray[Any, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dispatch's tokens to pack (int64 ``[N]``) and their packed headers (int32
        ``[N, meta_bytes / 4]``) on the layer's device: on a GPU in one copy from the pinned
        "send" slot (the headers ride as int64 words)."""
        staging = self._staging.get("send")
        if staging is None:
            return torch.from_numpy(tok.astype(np.int64)), torch.from_numpy(meta)
        n, words = tok.size, meta.size // 2
        buf = self._staging_np["send"]
        buf[:n] = tok
        buf[n : n + words] = meta.view(np.int64).reshape(-1)
        dev = staging[: n + words].to(self._send_tokens.device, non_blocking=True)
        return dev[:n], dev[n:].view(torch.int32).view(n, meta.shape[1])

    def _buffers_ready(self) -> None:
        """GPU buffers: what the current stream queued into them must be done before the
        transport reads them (a NIC, or a CUDA IPC copy on the engine's own stream, waits for
        no stream of ours). Host buffers: nothing to wait for."""
        if self._send_tokens.is_cuda:
            torch.cuda.current_stream(self._send_tokens.device).synchronize()

    def _register(self, tensor: torch.Tensor, writable: bool) -> MemoryRegion:
        region = self.engine.register(tensor, writable=writable)
        self._regions.append(region)
        return region

    @property
    def endpoint(self) -> MoeEndpoint:
        """What the other ranks need (pass every rank's to ``connect``)."""
        e = self.engine
        return MoeEndpoint(
            rank=self.config.rank,
            layer=self.layer,
            fingerprint=self.config.fingerprint(),
            num_nics=e.num_nics,
            max_msg_size=e.capabilities.max_msg_size,
            address=e.address,
            counts=self._recv_counts_mr.descriptor,
            tokens=self._recv_tokens_mr.descriptor,
            combine=self._recv_combine_mr.descriptor,
        )

    @property
    def step(self) -> int:
        """Steps completed (a step ends with ``combine_recv``)."""
        return self._step

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.config.local_experts()

    def expert_output_buffer(self, rows: int) -> torch.Tensor:
        """A ``[rows, hidden]`` view of the registered combine send buffer: experts may write
        their outputs here and pass it to ``combine_send``, which then copies nothing."""
        if not 0 <= rows <= self._send_combine.shape[0]:
            raise ConfigError(f"rows must be in [0, {self._send_combine.shape[0]}], got {rows}")
        return self._send_combine[:rows]

    # --- setup --------------------------------------------------------------------
    def connect(self, endpoints: Sequence[MoeEndpoint | bytes]) -> None:
        """Take every rank's endpoint (rank order, this rank's included) and resolve the peers
        once (a peer group of all ranks). ``ConfigError`` if any disagrees with this rank."""
        self._check_usable()
        if self._peers:
            raise MoeStateError("already connected")
        c = self.config
        eps = [MoeEndpoint.from_bytes(e) if isinstance(e, (bytes, bytearray)) else e for e in endpoints]
        if len(eps) != c.world_size:
            raise ConfigError(f"expected {c.world_size} endpoints (one per rank), got {len(eps)}")
        mine = self.endpoint
        for r, ep in enumerate(eps):
            if not isinstance(ep, MoeEndpoint):
                raise ConfigError(f"endpoint {r} must be a MoeEndpoint or its bytes, got {type(ep).__name__}")
            if ep.rank != r:
                raise ConfigError(f"endpoint {r} is rank {ep.rank}'s: pass them in rank order")
            if ep.fingerprint != mine.fingerprint:
                raise ConfigError(f"rank {r} has another layer config (fingerprint {ep.fingerprint})")
            if ep.layer != self.layer:
                raise ConfigError(f"rank {r} uses layer id {ep.layer}, this rank {self.layer}")
            if ep.num_nics != mine.num_nics:
                raise ConfigError(
                    f"rank {r} has {ep.num_nics} NICs, this rank {mine.num_nics}: they must match"
                )
            if ep.max_msg_size < 1:
                raise ConfigError(f"rank {r} reports max_msg_size {ep.max_msg_size}")
        if eps[c.rank] != mine:
            raise ConfigError(f"endpoint {c.rank} is not this instance's")
        self._group = self.engine.peer_group([ep.address for ep in eps])
        self._peers = tuple(eps)
        # where this rank's count record for each rank goes (the same every step)
        self._count_targets = tuple(
            ScatterTarget(p.counts, _COUNT_BYTES, q * _COUNT_BYTES, c.rank * _COUNT_BYTES)
            for q, p in enumerate(eps)
        )
        # what each source's count scatter gives this rank, by the contract's counting rule
        self._count_imms = tuple(
            self._expected(
                ep,
                ScatterRequest(
                    self._send_counts_mr,
                    tuple(
                        ScatterTarget(p.counts, _COUNT_BYTES, q * _COUNT_BYTES, ep.rank * _COUNT_BYTES)
                        for q, p in enumerate(eps)
                    ),
                    moe_imm(self.layer, 0, Phase.COUNTS, ep.rank),
                    ShardPeers(),
                ),
                target=c.rank,
            )
            for ep in eps
        )
        logger.debug("moe layer %d rank %d connected to %d ranks", self.layer, c.rank, c.world_size)

    def connect_rendezvous(self, rendezvous: Rendezvous) -> None:
        """``connect`` through a ``torch.distributed`` store (``fabric_core.Rendezvous``): every
        rank publishes its endpoint under ``moe-layer<id>`` and gathers the others'."""
        c = self.config
        if rendezvous.rank != c.rank or rendezvous.world_size != c.world_size:
            raise ConfigError(
                f"rendezvous is rank {rendezvous.rank} of {rendezvous.world_size}, the layer "
                f"rank {c.rank} of {c.world_size}"
            )
        self.connect(rendezvous.all_gather(f"moe-layer{self.layer}", self.endpoint.to_bytes()))

    # --- counting rule ------------------------------------------------------------
    @staticmethod
    def _expected(sender: MoeEndpoint, request: Any, target: int = 0) -> int:
        """How many imms ``target`` of ``request`` counts when ``sender`` posts it: the
        contract's rule with the sender's NIC count and largest message size."""
        return plan_request(request, sender.num_nics, sender.max_msg_size).imms_per_target[target]

    def _payload_imms(self, phase: Phase, source: int, pages: int) -> int:
        """Imms of source's write of ``pages`` packed records (dispatch) or ``pages`` packed
        rows (combine)."""
        key = (int(phase), source, pages)
        hit = self._imm_cache.get(key)
        if hit is not None:
            return hit
        c, ep = self.config, self._peers[source]
        imm = moe_imm(self.layer, 0, phase, source)
        request: WriteRequest | ImmRequest
        if phase == Phase.DISPATCH:
            rec = c.record_bytes
            request = WriteRequest(
                self._send_tokens_mr, 0, pages * rec, self._recv_tokens_mr.descriptor,
                source * c.max_tokens * rec, imm, Sharded(),
            )  # fmt: skip
        elif pages:
            request = WriteRequest(
                self._send_combine_mr, 0, pages * c.token_bytes, self._recv_combine_mr.descriptor, 0, imm,
                Sharded(),
            )  # fmt: skip
        else:
            request = ImmRequest(self._recv_combine_mr.descriptor, imm)
        n = self._expected(ep, request)
        self._imm_cache[key] = n
        return n

    # --- state --------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise MoeStateError("this MoeAllToAll is closed")
        if self._broken is not None:
            raise StepAborted(
                f"moe layer {self.layer} rank {self.config.rank}: step {self._step} failed "
                f"({type(self._broken).__name__}: {self._broken}); build a new instance"
            ) from self._broken

    @contextmanager
    def _call(self, name: str, state: str) -> Iterator[None]:
        """Run one half: refuse it out of order or concurrently; a failure poisons the
        instance (its step's counts and buffers cannot be trusted any more)."""
        self._check_usable()
        if not self._peers:
            raise MoeStateError(f"{name} before connect()")
        if not self._busy.acquire(blocking=False):
            raise MoeStateError(f"{name} while another call on this instance is running")
        try:
            if self._state != state:
                raise MoeStateError(
                    f"{name} called in state {self._state!r}: each step is dispatch_send, "
                    "dispatch_recv, combine_send, combine_recv"
                )
            self._committed = False
            try:
                yield
            except BaseException as exc:
                # a caller mistake found before anything was posted or consumed leaves the
                # instance as it was; anything else (transport, or past that point) poisons it
                if not self._committed and not isinstance(
                    exc, (TransportError, EngineClosed, MoeProtocolError)
                ):
                    raise
                self._broken = exc
                logger.debug(
                    "moe layer %d rank %d: step %d failed: %s", self.layer, self.config.rank, self._step, exc
                )
                raise
        finally:
            self._busy.release()

    def _drain(self, xfers: list[Transfer], deadline: float) -> None:
        """Wait for the sends that last used a buffer we are about to overwrite."""
        for x in xfers:
            x.wait(max(0.0, deadline - time.monotonic()))
        xfers.clear()

    def _settle(self, xfers: list[Transfer], deadline: float) -> None:
        """Give this step's own sends a moment (``_SETTLE_S``) to end, before the host work
        that follows: their completions are then handed to Python here, by this thread,
        rather than by the engine's completion thread in the middle of that work (two threads
        taking turns at the GIL cost a decode step hundreds of microseconds on an H200 host).
        Sends still under way after it are left to the next drain, so a send stuck behind a
        dead peer's (shm completes an endpoint's operations in order) delays nothing. A send
        that failed raises here, naming its rank."""
        until = min(deadline, time.monotonic() + _SETTLE_S)
        for x in xfers:
            left = until - time.monotonic()
            if left <= 0:
                break
            if not x.done():
                try:
                    x.exception(left)
                except TransferTimeout:
                    break
        self._raise_failed_sends(xfers)

    def _raise_failed_sends(self, xfers: list[Transfer]) -> None:
        """Raise the error of a send of this step that already failed, naming its rank."""
        for x in xfers:
            if not x.done():
                continue
            exc = x.exception(0)
            if exc is None:
                continue
            if not isinstance(exc, TransportError):
                raise exc
            where = f"moe layer {self.layer} step {self._step} rank {self.config.rank}"
            raise type(exc)(
                f"{where}: a write to {self._who(exc.peer)} failed: {exc}",
                peer=exc.peer,
                nic=exc.nic,
                transfer_id=exc.transfer_id,
            ) from exc

    def _who(self, peer: str | None) -> str:
        """The rank whose address is ``peer`` (an error's hex address), as errors name it."""
        ranks = [r for r, p in enumerate(self._peers) if peer is not None and str(p.address) == peer]
        return f"rank {ranks[0]}" if ranks else "a peer"

    def _deadline(self, timeout: float | None) -> float:
        limit = self.timeout if timeout is None else timeout
        if not limit >= 0:
            raise ConfigError(f"timeout must be non-negative, got {timeout!r}")
        return math.inf if math.isinf(limit) else time.monotonic() + limit

    def _wait_all(self, phase: Phase, wants: Sequence[tuple[int, int]], deadline: float, what: str) -> None:
        """Wait until each ``(source, n)`` of ``wants`` has counted ``n`` imms of ``phase``.

        One joint wait (``TransferEngine.wait_counts``, each entry naming its source as the
        peer), so the first dead source fails the call at once, whatever its rank; at the
        deadline nothing is consumed and ``TransferTimeout`` lists each missing source's imm
        with the counts it expected and received.
        """
        source: dict[int, int] = {}  # imm -> the source rank it waits for
        waits = []
        for src, n in wants:
            if n > 0:
                imm = moe_imm(self.layer, self._step, phase, src)
                source[imm] = src
                waits.append((imm, n, self._peers[src].address))
        if not waits:
            return
        where = f"moe layer {self.layer} step {self._step} rank {self.config.rank}"
        limit = math.inf if math.isinf(deadline) else max(0.0, deadline - time.monotonic())
        try:
            self.engine.wait_counts(waits, limit)
        except PeerUnreachable as exc:
            raise PeerUnreachable(
                f"{where}: {self._who(exc.peer)} is gone ({what}): {exc}", peer=exc.peer
            ) from exc
        except TransferTimeout as exc:
            missing = ", ".join(str(source[imm]) for imm in sorted(exc.expected, key=source.__getitem__))
            raise TransferTimeout(
                f"{where}: {what} from rank(s) {missing} incomplete at the deadline",
                expected=exc.expected,
                received=exc.received,
                peer=exc.peer,
            ) from exc

    # --- dispatch -----------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Send this rank's tokens: ``x`` ``[T, H]`` (T <= max_tokens, T may be 0),
        ``topk_idx`` ``[T, K]`` expert ids (-1: no expert), ``topk_weights`` ``[T, K]`` (kept
        here for the combine). Returns once everything is posted."""
        with self._call("dispatch_send", _IDLE):
            c = self.config
            x, idx, weights = check_inputs(c, x, topk_idx, topk_weights)
            deadline = self._deadline(None)
            self._committed = True  # from here on, buffers change and writes go out
            self._drain(self._dispatch_xfers, deadline)
            mask_t, pair_rank_t = destinations(c, idx)
            # the host's index work in numpy (views of the CPU tensors): a few microseconds an
            # operation where torch takes ten or more, and a decode step is mostly such operations
            mask, pair_rank = mask_t.numpy(), pair_rank_t.numpy()
            per_rank = mask.sum(0)
            pairs = np.bincount(pair_rank[pair_rank >= 0], minlength=c.world_size)
            # the count records (host memory): sent before the tokens are packed, so the
            # receivers learn what to expect while this rank's GPU still packs
            counts = self._send_counts_np
            counts[:, 0], counts[:, 1], counts[:, 2], counts[:, 3] = (
                per_rank,
                self._step,
                np.cumsum(pairs) - pairs,
                pairs,
            )
            self._idx, self._weights = idx, weights
            self._pairs_from = pairs.tolist()
            me, rec, eng = c.rank, c.record_bytes, self.engine
            xfers = self._dispatch_xfers
            xfers.append(
                eng.submit_scatter(
                    self._send_counts_mr,
                    self._count_targets,
                    imm=moe_imm(self.layer, self._step, Phase.COUNTS, me),
                    routing=_SHARD_PEERS,
                    group=self._group,
                )
            )
            # records, packed by destination rank: rank q's tokens, ascending, at rows
            # [first[q], first[q] + n_q) of the send buffer. The headers (int32 source token,
            # K expert ids) are built and packed on the host; on a GPU they travel with the
            # list of tokens to pack in one copy, then two kernels place them and gather the
            # hidden states (a host-bound decode step pays per call, not per byte)
            first = np.cumsum(per_rank) - per_rank
            _q_of, tok = np.nonzero(mask.T)  # (q, token), q-major
            if tok.size:
                meta = np.zeros((tok.size, c.meta_bytes // 4), dtype=np.int32)
                meta[:, 0] = tok
                meta[:, 1 : 1 + c.top_k] = idx.numpy()[tok]
                tok_dev, meta_dev = self._upload_records(tok, meta)
                n_all = int(tok.size)
                self._send_meta[:n_all].copy_(meta_dev)
                src = x if x.device == tok_dev.device else x.to(tok_dev.device)
                self._send_hidden[:n_all].copy_(src.index_select(0, tok_dev))
            self._buffers_ready()
            imm = moe_imm(self.layer, self._step, Phase.DISPATCH, me)
            for q, p in enumerate(self._peers):
                n = int(per_rank[q])
                if n == 0:
                    continue
                xfers.append(
                    eng.submit_write(
                        self._send_tokens_mr,
                        int(first[q]) * rec,
                        n * rec,
                        p.tokens,
                        me * c.max_tokens * rec,
                        imm=imm,
                        routing=Sharded(),
                    )
                )
            # where the combine brings back each (t, k) slot: worked out now, while the tokens
            # are on their way
            self._pos = self._to_device(combine_positions(c, idx)[0].numpy().reshape(-1), "pos")
            self._state = _DISPATCHED

    def dispatch_recv(self, timeout: float | None = None) -> DispatchResult:
        """Wait for every rank's tokens (``timeout`` s for the whole call; None: the
        instance's) and return them grouped by local expert."""
        with self._call("dispatch_recv", _DISPATCHED):
            c = self.config
            deadline = self._deadline(timeout)
            self._committed = True  # waits consume counts
            self._raise_failed_sends(self._dispatch_xfers)
            w, tmax = c.world_size, c.max_tokens
            self._wait_all(Phase.COUNTS, list(enumerate(self._count_imms)), deadline, "token counts")
            counts = self._recv_counts.numpy().copy()
            records = counts.tolist()
            for r, (n_r, step_r, _first, _rows) in enumerate(records):
                if step_r != self._step:
                    raise MoeProtocolError(
                        f"rank {r} sent the count of its step {step_r}, this rank is at step "
                        f"{self._step}: every rank must run the same steps in the same order"
                    )
                if not 0 <= n_r <= tmax:
                    raise MoeProtocolError(f"rank {r} announced {n_r} tokens (max_tokens {tmax})")
            n_np = counts[:, 0].copy()
            wants = [
                (r, self._payload_imms(Phase.DISPATCH, r, rec[0])) for r, rec in enumerate(records) if rec[0]
            ]
            self._wait_all(Phase.DISPATCH, wants, deadline, "tokens")
            self._settle(self._dispatch_xfers, deadline)
            src_np = np.repeat(np.arange(w, dtype=np.int64), n_np)
            rows_np = src_np * tmax + (np.arange(src_np.size) - (np.cumsum(n_np) - n_np)[src_np])
            meta = self._received_headers(rows_np)
            src_token, ids = meta[:, 0].astype(np.int64), meta[:, 1 : 1 + c.top_k].astype(np.int64)
            self._check_records(src_token, ids)
            result = group_received(
                c, c.rank, torch.from_numpy(src_np), torch.from_numpy(src_token), torch.from_numpy(ids),
                self._recv_hidden, torch.from_numpy(rows_np), torch.from_numpy(n_np),
            )  # fmt: skip
            # the combine's plan: the rows of each origin, packed, to the rows it announced
            src_rank = result.src_rank.numpy()
            rows_to = np.bincount(src_rank, minlength=w).tolist()
            for r, (_n, _step, first_row, announced) in enumerate(records):
                if announced != rows_to[r]:
                    raise MoeProtocolError(
                        f"rank {r} expects {announced} combine rows from this rank, its tokens "
                        f"make {rows_to[r]} here: the ranks disagree on placement"
                    )
                if first_row < 0 or first_row + rows_to[r] > tmax * c.top_k:
                    raise MoeProtocolError(f"rank {r} announced combine rows outside its buffer")
            self._rows = result.num_rows
            self._row_order = np.argsort(src_rank, kind="stable")
            self._rows_to, self._rows_at = rows_to, [rec[2] for rec in records]
            self._raise_failed_sends(self._dispatch_xfers)
            self._state = _RECEIVED
            return result

    def _received_headers(self, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The int32 headers of the received records at ``rows`` (``[N, meta_bytes / 4]``),
        on the host. From a GPU: one gather there, one copy back (the stream is synced)."""
        headers: np.ndarray[Any, Any]
        if not self._recv_meta.is_cuda:
            headers = self._recv_meta.numpy()[rows]
        else:
            headers = self._recv_meta.index_select(0, self._to_device(rows, "rows")).cpu().numpy()
        return headers

    def _check_records(self, token: np.ndarray[Any, Any], expert: np.ndarray[Any, Any]) -> None:
        """What the records received claim, checked before anything is grouped by it (in
        numpy: a few small array operations, each a fraction of a torch call's cost)."""
        c = self.config
        if not token.size:
            return
        if token.min() < 0 or token.max() >= c.max_tokens:
            raise MoeProtocolError("a received token names a source index outside [0, max_tokens)")
        if expert.min() < -1 or expert.max() >= c.num_experts:
            raise MoeProtocolError("a received token names an expert outside [-1, num_experts)")
        mine = (self._owner[np.maximum(expert, 0)] == c.rank) & (expert >= 0)
        if not mine.any(axis=1).all():
            raise MoeProtocolError(
                "a received token has no expert on this rank: the ranks disagree on placement"
            )

    # --- combine ------------------------------------------------------------------
    def combine_send(self, expert_outputs: torch.Tensor) -> None:
        """Send the experts' outputs back: ``[num_rows, hidden]`` in the row order of the
        ``DispatchResult`` (e.g. ``expert_output_buffer(num_rows)`` filled in place)."""
        with self._call("combine_send", _RECEIVED):
            c = self.config
            y = expert_outputs
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != (self._rows, c.hidden):
                got = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise MoeStateError(
                    f"expert_outputs must be [{self._rows}, {c.hidden}] for this step, got {got}"
                )
            if y.dtype != c.dtype:
                raise ConfigError(f"expert_outputs has dtype {y.dtype}, the layer's dtype is {c.dtype}")
            deadline = self._deadline(None)
            self._committed = True
            self._drain(self._combine_xfers, deadline)
            if self._rows:
                # pack by origin rank (inside each origin: expert id, then token, the order the
                # origin's combine_positions expects); on a GPU, one gather kernel
                order = self._to_device(self._row_order, "order")
                packed = self._send_combine[: self._rows]
                if y.data_ptr() == self._send_combine.data_ptr():  # filled in place: copy first
                    packed.copy_(y.index_select(0, order))
                else:
                    torch.index_select(y, 0, order, out=packed)
            self._buffers_ready()
            tb, eng, me = c.token_bytes, self.engine, c.rank
            imm = moe_imm(self.layer, self._step, Phase.COMBINE, me)
            start = 0
            for r, p in enumerate(self._peers):
                n = self._rows_to[r]
                if n:
                    xfer = eng.submit_write(
                        self._send_combine_mr, start * tb, n * tb, p.combine, self._rows_at[r] * tb,
                        imm=imm, routing=Sharded(),
                    )  # fmt: skip
                else:  # nothing for this origin: one imm still says "this rank is done"
                    xfer = eng.submit_imm(p.combine, imm)
                start += n
                self._combine_xfers.append(xfer)
            self._state = _COMBINING

    def combine_recv(self, timeout: float | None = None) -> torch.Tensor:
        """Wait for every rank's outputs for this rank's tokens and return ``[T, hidden]``:
        per token, the top-k weighted sum in float32 in ascending k, cast to the dtype."""
        with self._call("combine_recv", _COMBINING):
            c = self.config
            deadline = self._deadline(timeout)
            self._committed = True
            self._raise_failed_sends(self._combine_xfers)
            wants = [
                (q, self._payload_imms(Phase.COMBINE, q, self._pairs_from[q])) for q in range(c.world_size)
            ]
            self._wait_all(Phase.COMBINE, wants, deadline, "expert outputs")
            self._settle(self._combine_xfers, deadline)
            t = int(self._idx.shape[0])
            y = self._recv_combine.index_select(0, self._pos)
            out = weighted_sum(y.view(t, c.top_k, c.hidden), self._weights, self._idx, c.dtype)
            self._raise_failed_sends(self._combine_xfers)
            self._step += 1
            self._state = _IDLE
            return out

    # --- lifecycle ----------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` s for this rank's sends, deregister the buffers (unless the
        engine is closed already) and free the layer id. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for x in self._dispatch_xfers + self._combine_xfers:
            try:
                x.wait(max(0.0, deadline - time.monotonic()))
            except FabricError:
                pass
        self._dispatch_xfers.clear()
        self._combine_xfers.clear()
        self._release()

    def _release(self) -> None:
        if not self.engine.closed:
            for region in self._regions:
                try:
                    self.engine.deregister(region)
                except (EngineClosed, ConfigError):
                    pass
        self._regions.clear()
        with _claims_lock:
            _claims.get(self.engine, set()).discard(self.layer)

    def __enter__(self) -> MoeAllToAll:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<MoeAllToAll layer={self.layer} rank={c.rank}/{c.world_size} step={self._step} "
            f"state={self._state}{' broken' if self._broken else ''}>"
        )
