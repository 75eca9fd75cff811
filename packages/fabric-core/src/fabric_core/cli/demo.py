"""``fabric demo``: a narrated walk through the WriteImm / ImmCounter contract on the simulator."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import click
import numpy as np

from ..api import TransferEngine
from ..errors import ConfigError, FabricError, TransferTimeout
from ..models import MemoryRegionDescriptor
from ..ops import Sharded
from ..transfer import Transfer
from ._util import SimFabricLike, format_size, new_sim_fabric

__all__ = ["demo"]

REGION = 1 << 20
OOO_WRITES = 6
OOO_BYTES = 64 << 10
PAGE = 4096
PAGE_ORDER = (7, 2, 5, 0, 3, 6, 1, 4)


def _say(title: str, *lines: str) -> None:
    click.echo(f"\n== {title}")
    for line in lines:
        click.echo(f"   {line}")


def _ids(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)


class _Arrivals:
    """Imms recorded in the order callbacks fire; ``done`` is set after ``expected`` of them."""

    def __init__(self, expected: int) -> None:
        self.order: list[int] = []
        self.expected = expected
        self.done = threading.Event()
        self._lock = threading.Lock()

    def record(self, imm: int) -> None:
        with self._lock:
            self.order.append(imm)
            if len(self.order) == self.expected:
                self.done.set()

    def on_count(self, imm: int) -> Callable[[], None]:
        """A callback for ``ImmCounter.expect``."""
        return lambda: self.record(imm)

    def on_done(self, imm: int) -> Callable[[Transfer], None]:
        """A callback for ``Transfer.on_done``."""
        return lambda _transfer: self.record(imm)


def _config_error(attempt: Callable[[], object]) -> str:
    try:
        attempt()
    except ConfigError as exc:
        return f"ConfigError: {exc}"
    return "no error (unexpected)"


def _walk(fabric: SimFabricLike, writer: TransferEngine, target: TransferEngine, seed: int) -> None:
    caps = writer.capabilities
    _say(
        "1. Two engines",
        f"writer and target each have {caps.num_nics} simulated NICs on one in-process fabric (seed {seed}).",
        "In a real job each engine lives in its own process, usually on its own host.",
        f"writer address {writer.address}, target address {target.address}",
        f"capabilities: max message {format_size(caps.max_msg_size)}, {caps.imm_bits}-bit imms, "
        f"ordered={caps.ordered} (no backend promises any order)",
    )

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, REGION, dtype=np.uint8)
    dst = np.zeros(REGION, dtype=np.uint8)
    src_mr, dst_mr = writer.register(src), target.register(dst)
    wire = dst_mr.descriptor.to_bytes()
    desc = MemoryRegionDescriptor.from_bytes(wire)
    _say(
        "2. Register memory",
        f"writer.register(src) and target.register(dst): {format_size(REGION)} each, on every NIC.",
        f"The target's descriptor is {len(wire)} bytes (descriptor.to_bytes()): base, length and one remote",
        "key per NIC. It is all a writer needs; send it out of band (e.g. with fabric_core.Rendezvous).",
    )

    length = 256 << 10
    transfer = writer.submit_write(src_mr, 0, length, desc, 0, imm=1, routing=Sharded())
    n = transfer.imms_at_target
    target.counter(1).wait(n, timeout=10)
    transfer.wait(timeout=10)
    ok = np.array_equal(dst[:length], src[:length])
    _say(
        "3. A sharded write with an imm",
        f"t = writer.submit_write(src, 0, {length}, desc, imm=1, routing=Sharded())",
        f"It is cut into one shard per NIC, each work request carrying the imm: t.imms_at_target == {n}.",
        f"The target knows the write is whole only when target.counter(1).wait({n}) returns;",
        "a single imm says nothing about the other shards.",
        f"Waited for {n} counts: the {length} bytes landed {'intact' if ok else 'CORRUPTED'}; "
        "t.wait() then confirms completion at the writer.",
    )

    imms = list(range(10, 10 + OOO_WRITES))
    at_target, at_writer = _Arrivals(OOO_WRITES), _Arrivals(OOO_WRITES)
    with fabric.paused():
        for i, imm in enumerate(imms):
            off = 512 * 1024 + i * OOO_BYTES
            t = writer.submit_write(src_mr, off, OOO_BYTES, desc, off, imm=imm)
            target.counter(imm).expect(t.imms_at_target, at_target.on_count(imm))
            t.on_done(at_writer.on_done(imm))
        held = sum(target.counter(imm).value for imm in imms)
    if not (at_target.done.wait(10) and at_writer.done.wait(10)):
        raise click.ClickException("the out-of-order writes did not complete within 10 s")
    shuffled = at_target.order != imms
    _say(
        "4. Nothing is ordered",
        f"Inside fabric.paused() the writer posted {OOO_WRITES} writes of {format_size(OOO_BYTES)} "
        f"with imms {_ids(imms)};",
        f"the target had counted {held} of them when the pause ended. Then:",
        f"  posted:                {_ids(imms)}",
        f"  counted at the target: {_ids(at_target.order)}",
        f"  completed at writer:   {_ids(at_writer.order)}",
        (
            "Counts arrived in another order than the writes were posted"
            if shuffled
            else "This time the counts happened to arrive in posting order (other seeds shuffle them)"
        )
        + (
            "; the writer saw its completions in yet another order."
            if at_writer.order != at_target.order
            else "; the writer saw its completions in that same order."
        ),
        f"Chunks of one write land shuffled too ({format_size(fabric.chunk_bytes)} chunks here): "
        "read data only after its count.",
    )

    pages = len(PAGE_ORDER)
    base = 512 * 1024
    dst[base : base + pages * PAGE] = 0
    transfer = writer.submit_paged_write(
        src_mr, list(range(pages)), PAGE, desc, list(PAGE_ORDER), PAGE, PAGE, dst_offset=base, imm=20
    )
    target.counter(20).wait(transfer.imms_at_target, timeout=10)
    transfer.wait(timeout=10)
    landed = all(
        np.array_equal(dst[base + p * PAGE : base + (p + 1) * PAGE], src[i * PAGE : (i + 1) * PAGE])
        for i, p in enumerate(PAGE_ORDER)
    )
    _say(
        "5. A paged write",
        f"t = writer.submit_paged_write(src, range({pages}), {PAGE}, desc, {list(PAGE_ORDER)}, {PAGE},",
        f"                              page_length={PAGE}, dst_offset={base}, imm=20)",
        f"moves {pages} pages of {format_size(PAGE)} to the destination page numbers given, one work request",
        f"(and one imm) per page: t.imms_at_target == {transfer.imms_at_target}. "
        f"Every page in place: {'yes' if landed else 'NO'}.",
    )

    before = writer.stats().submitted
    bad_range = _config_error(lambda: writer.submit_write(src_mr, 0, 4096, desc, REGION - 1024, imm=1))
    bad_imm = _config_error(lambda: writer.submit_write(src_mr, 0, 8, desc, imm=1 << 32))
    timeout = "no error: an imm 99 was counted (unexpected)"
    try:
        target.counter(99).wait(1, timeout=0.05)
    except TransferTimeout as exc:
        timeout = str(exc)
    _say(
        "6. Errors",
        "A bad request raises ConfigError at once, from the submit call itself:",
        f"writer.submit_write(src, 0, 4096, desc, dst_offset={REGION - 1024}, imm=1)",
        f"  -> {bad_range}",
        "writer.submit_write(src, 0, 8, desc, imm=2**32)",
        f"  -> {bad_imm}",
        f"Nothing was posted: writer.stats().submitted is {writer.stats().submitted}, as before ({before}).",
        "A wait that is not satisfied in time raises TransferTimeout with expected and received counts:",
        "target.counter(99).wait(1, timeout=0.05)",
        f"  -> TransferTimeout: {timeout}",
    )
    writer.deregister(src_mr)
    target.deregister(dst_mr)


@click.command()
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the simulated fabric.")
def demo(seed: int) -> None:
    """A narrated walk through the fabric contract on the simulator (about a second).

    Opens two engines with 2 NICs each, registers memory, makes a sharded write with an imm
    and waits for its count at the target, shows that completions arrive out of order, makes
    a paged write, and shows what a bad request raises.
    """
    try:
        fabric = new_sim_fabric(seed, chunk_bytes=16 << 10, link=None)
        writer = fabric.open_engine(2)
        target = fabric.open_engine(2)
    except FabricError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        _walk(fabric, writer, target, seed)
    except FabricError as exc:
        raise click.ClickException(f"the demo failed: {type(exc).__name__}: {exc}") from None
    finally:
        writer.close(timeout=5.0)
        target.close(timeout=5.0)
    stats = writer.stats()
    _say(
        "7. Close",
        "writer.close() drains in-flight work, then deregisters and stops. Writer stats: "
        f"{stats.submitted} requests, {stats.work_requests} work requests, {stats.bytes_written} bytes.",
    )
