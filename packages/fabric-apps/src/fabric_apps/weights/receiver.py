"""The inference side: each inference rank fences "weights of step s landed" on its counters.

A ``WeightsReceiver`` registers the rank's parameter buffer (its layout in
``plan.destination``: the memory the inference engine reads) and knows from the plan how many
imms each source rank's writes of one step carry to it. ``wait_step(step)`` waits, for every
source that writes to this rank, on that source's imm of the step (see
``fabric_apps.weights.imms``) and consumes exactly the planned count: when it returns, every
byte of the step is in place and the engine may read its weights.

Failure: the waits name their source (when the source addresses are known), so a lost
trainer's wait fails as soon as the loss is known (``PeerUnreachable``) instead of at the
deadline; the other sources' waits go on until each has landed, failed or reached the
deadline, and then the step raises ``StepPeerLost`` (or ``StepTimeout`` when only deadlines
passed). The error says which sources completed (``completed``), failed (``failed``) or were
still pending, and the destination's bytes are in a documented mixed state: ranges written
by completed sources hold the new step, ranges of the others hold, byte by byte, the old or
the new value (``plan.destination_ranges(rank, src)`` lists them); ranges no source writes
(alignment gaps, FSDP padding) are never touched. Retry by sending a *later* step once
the fleet is whole: every step rewrites every planned byte. ``wait_step`` may also be called
again for the same step (a longer deadline): it goes on with the sources still pending.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fabric_core.api import TransferEngine
from fabric_core.errors import ConfigError, EngineClosed, FabricError
from fabric_core.models import DomainAddress, MemoryRegion, MemoryRegionDescriptor
from fabric_core.rendezvous import Store

from .errors import step_error
from .plan import TransferPlan
from .spec import FleetSpec

__all__ = ["ReceiveReport", "WeightsReceiver"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ReceiveReport:
    """What one completed ``wait_step`` counted at one destination."""

    step: int
    bytes: int
    """Bytes of the step written into this rank's buffer."""
    imms: int
    sources: int
    seconds: float


class WeightsReceiver:
    """Rank ``rank`` of the destination fleet: fences each step's writes into ``buffer``.

    ``buffer``: this rank's parameter buffer (``plan.destination.layout(rank)``; a contiguous
    numpy array or torch tensor, registered here for remote writes) or a ``MemoryRegion`` of
    ``engine`` already registered writable. ``sources[s]``, if given, is source rank ``s``'s
    address: waits then fail at once when that source is lost. ``timeout`` is the default
    deadline of ``wait_step`` in seconds. Publish ``descriptor`` to the senders.
    """

    def __init__(
        self,
        engine: TransferEngine,
        plan: TransferPlan,
        rank: int,
        buffer: Any,
        sources: Sequence[DomainAddress] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        S, D = plan.source.world_size, plan.destination.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < D:
            raise ConfigError(f"destination rank {rank!r} is outside [0, {D})")
        if engine.num_nics != plan.options.num_nics:
            raise ConfigError(
                f"the plan routes over {plan.options.num_nics} NICs, this engine has {engine.num_nics}"
            )
        self._timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        if not self._timeout > 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        if sources is not None:
            sources = tuple(sources)
            if len(sources) != S or not all(isinstance(a, DomainAddress) for a in sources):
                raise ConfigError(f"sources must be the {S} source ranks' DomainAddress, in rank order")
        self.engine, self.plan, self.rank = engine, plan, rank
        self.sources: tuple[DomainAddress, ...] | None = sources
        need = plan.destination.layout(rank).nbytes
        if isinstance(buffer, MemoryRegion):
            if not buffer.writable:
                raise ConfigError("the destination region must be registered writable")
            self.region, self._owns = buffer, False
        else:
            self.region, self._owns = engine.register(buffer, writable=True), True
        if self.region.length < need:
            self._release()
            raise ConfigError(
                f"destination rank {rank}'s buffer is {self.region.length} bytes, its layout needs {need}"
            )
        self.expected = plan.expected_imms(rank)
        """Imms per source rank per step (sources absent send this rank nothing)."""
        mask = plan.columns["dst_rank"] == rank
        self.bytes_per_step = int(plan.columns["length"][mask].sum())
        self._step = -1
        self._remaining: dict[int, int] = {}
        self._done = True
        self._clean = dict.fromkeys(self.expected, -1)
        self._busy = threading.Lock()
        self._closed = False

    @property
    def descriptor(self) -> MemoryRegionDescriptor:
        """What the senders need to write into this rank's buffer."""
        return self.region.descriptor

    @property
    def last_step(self) -> int:
        """The step most recently waited for (complete or not)."""
        return self._step

    @property
    def pending_sources(self) -> tuple[int, ...]:
        """Sources whose part of ``last_step`` has not been counted."""
        return tuple(sorted(self._remaining))

    def replace_source(self, rank: int, address: DomainAddress) -> None:
        """Source ``rank`` came back at ``address`` (a restarted trainer rank): its waits name
        that address from the next ``wait_step`` on."""
        S = self.plan.source.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < S:
            raise ConfigError(f"source rank {rank!r} is outside [0, {S})")
        if not isinstance(address, DomainAddress):
            raise ConfigError(f"address must be a DomainAddress, got {type(address).__name__}")
        if self.sources is None:
            raise ConfigError("this receiver was built without source addresses: there is nothing to replace")
        with self._busy:
            sources = list(self.sources)
            sources[rank] = address
            self.sources = tuple(sources)

    # --- setup through a torch.distributed Store ------------------------------------------
    @classmethod
    def connect(
        cls,
        engine: TransferEngine,
        store: Store,
        *,
        rank: int,
        destination: FleetSpec,
        buffer: Any,
        prefix: str = "fabric-weights",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> WeightsReceiver:
        """Register ``buffer``, join the exchange under ``prefix`` in ``store`` (once), compute
        the plan and build the receiver (see ``WeightsSender.connect``)."""
        from ._exchange import exchange

        region = engine.register(buffer, writable=True)
        try:
            ex = exchange(
                store,
                side="destination",
                rank=rank,
                spec=destination,
                engine=engine,
                options=None,
                descriptor=region.descriptor,
                prefix=prefix,
                timeout=timeout,
            )
            receiver = cls(engine, ex.plan, rank, region, ex.addresses, timeout=timeout)
        except BaseException:
            if not engine.closed:
                engine.deregister(region)
            raise
        receiver._owns = True
        return receiver

    # --- the fence -------------------------------------------------------------------------
    def wait_step(self, step: int, timeout: float | None = None) -> ReceiveReport:
        """Block until every byte of ``step`` destined here has landed (see the module doc).

        Inside a running event loop use ``await wait_step_async(step)``.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.wait_step_async(step, timeout))
        raise ConfigError("wait_step blocks: inside an event loop, await wait_step_async instead")

    async def wait_step_async(self, step: int, timeout: float | None = None) -> ReceiveReport:
        """Awaitable ``wait_step``."""
        limit = self._timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if not self._busy.acquire(blocking=False):
            raise ConfigError("another wait_step is in progress on this receiver")
        try:
            if self._closed:
                raise EngineClosed("this WeightsReceiver is closed")
            if step < self._step or (step == self._step and self._done):
                raise ConfigError(f"step {step} was already waited for (last step {self._step})")
            if step > self._step:
                self._begin(step)
            return await self._wait(step, limit)
        finally:
            self._busy.release()

    def _begin(self, step: int) -> None:
        period = self.plan.imms.period
        for src in self.expected:
            if step - period > self._clean[src]:
                # the value comes back while counts of its last use were never accounted for
                self._drain_value(src, step - period, warn=True)
        self._step, self._done = step, False
        self._remaining = dict(self.expected)

    def _drain_value(self, src: int, step: int, *, warn: bool = False) -> None:
        counter = self.engine.counter(self.plan.imm(step, src))
        left = counter.value
        if left:
            counter.wait(left, timeout=1.0)
            log = logger.warning if warn else logger.debug
            log(
                "weights: drained %d stale imms of source %d, step %d, at destination %d",
                left,
                src,
                step,
                self.rank,
            )

    def _settled(self, src: int, step: int) -> None:
        """``src`` completed ``step`` here: it finished every earlier step's writes before it
        started this one, so counts of earlier steps it left on their values are final."""
        period = self.plan.imms.period
        for old in range(max(self._clean[src] + 1, step - period + 1), step):
            self._drain_value(src, old)
        self._clean[src] = step

    async def _wait(self, step: int, limit: float) -> ReceiveReport:
        t0 = time.monotonic()
        imms = {src: self.plan.imm(step, src) for src in self._remaining}
        tasks = {
            src: asyncio.ensure_future(
                self.engine.counter(imms[src]).wait_async(
                    n, limit, peer=self.sources[src] if self.sources is not None else None
                )
            )
            for src, n in self._remaining.items()
        }
        failed: dict[int, BaseException] = {}
        try:
            if tasks:
                # every source settles (lands, fails, or reaches the deadline): the error then
                # says exactly whose bytes are in place, and no write of the step is left landing
                await asyncio.wait(tasks.values())
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()  # our caller was cancelled: a cancelled wait consumes nothing
            for src, task in tasks.items():
                if not task.done() or task.cancelled():
                    continue
                exc = task.exception()
                if exc is None:
                    del self._remaining[src]
                    self._settled(src, step)
                else:
                    failed[src] = exc
        if failed or self._remaining:
            pending_src = tuple(sorted(set(self._remaining) - set(failed)))
            raise step_error(
                step=step,
                side="destination",
                rank=self.rank,
                failed=failed,
                completed=tuple(sorted(set(self.expected) - set(self._remaining))),
                pending=pending_src,
                expected={imms[s]: self._remaining[s] for s in self._remaining},
                received={imms[s]: self.engine.counter(imms[s]).value for s in self._remaining},
            )
        self._done = True
        return ReceiveReport(
            step,
            self.bytes_per_step,
            sum(self.expected.values()),
            len(self.expected),
            time.monotonic() - t0,
        )

    # --- lifecycle ---------------------------------------------------------------------------
    def _release(self) -> None:
        if self._owns and not self.engine.closed:
            try:
                self.engine.deregister(self.region)
            except FabricError as exc:
                logger.debug("weights: deregistering the destination buffer: %s", exc)

    def close(self) -> None:
        """Deregister the buffer (if this receiver registered it). Idempotent; the engine
        stays open. Writes of a step still in flight then fail at their senders."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def __enter__(self) -> WeightsReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<WeightsReceiver rank {self.rank}: {sum(self.expected.values())} imms from "
            f"{len(self.expected)} sources per step, last step {self._step}>"
        )
