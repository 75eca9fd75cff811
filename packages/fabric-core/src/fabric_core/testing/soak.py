"""A bounded soak: rounds of mixed traffic between two engines, with faults, checked exactly,
while the processes' resources are sampled.

Each round a writer sends a target every kind of request (sharded and pinned writes, a paged
write, an imm-only write, two-sided messages), each with an imm of its own and into a slot of
its own, and cancels one more write right after submitting it. Every few rounds the writer's
NIC 1 is taken down for the round (where the caller can), so some work requests fail and are
retried on NIC 0. The writer also registers, rekeys and deregisters a scratch region. Then:
every transfer but the cancelled one completes, each imm is counted exactly
``imms_at_target`` times (none missing, none extra), each slot holds exactly its bytes, each
message arrives once. After each round the resident set size, open file descriptors and
threads of every process named in ``pids``, and both engines' registrations, are sampled.

``run_soak`` returns a ``SoakReport``: counts, failures, and per process and resource the
least-squares slope per round after warm-up (the first quarter of the rounds). ``benchmarks/
soak.py`` runs it for minutes; the efa tests run a short one.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api import TransferEngine
from ..errors import TransferCancelled
from ..ops import Pinned, Sharded
from ..transfer import Transfer

__all__ = ["SoakReport", "Sample", "run_soak", "sample_process", "slope"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]
SLOT = 64 * 1024
SLOTS = 8  # per round: sharded, pinned, paged, imm-only, cancelled, and spares
T = 30.0  # every wait is bounded


@dataclass(frozen=True, slots=True)
class Sample:
    round: int
    elapsed_s: float
    rss_kib: dict[str, int]
    fds: dict[str, int]
    threads: dict[str, int]
    registrations: tuple[int, int]


@dataclass
class SoakReport:
    rounds: int = 0
    transfers: int = 0
    messages: int = 0
    cancelled: int = 0
    nic_faults: int = 0
    retries: int = 0
    bytes_verified: int = 0
    problems: list[str] = field(default_factory=list)
    """Wrong counts, wrong bytes, lost or duplicated messages, failed transfers: must be empty."""
    samples: list[Sample] = field(default_factory=list)

    def warm(self) -> list[Sample]:
        """The samples after warm-up (the first quarter of the rounds, at least two)."""
        skip = max(2, len(self.samples) // 4)
        return self.samples[skip:]

    def slopes(self) -> dict[str, dict[str, float]]:
        """Per process, per resource: the least-squares slope per round after warm-up."""
        warm = self.warm()
        out: dict[str, dict[str, float]] = {}
        if len(warm) < 2:
            return out
        xs = [float(s.round) for s in warm]
        for name in warm[0].rss_kib:
            out[name] = {
                "rss_kib_per_round": slope(xs, [float(s.rss_kib[name]) for s in warm]),
                "fds_per_round": slope(xs, [float(s.fds[name]) for s in warm]),
                "threads_per_round": slope(xs, [float(s.threads[name]) for s in warm]),
            }
        return out

    def growth(self, what: str) -> dict[str, float]:
        """Per process: how much ``fds``, ``threads`` or ``rss_kib`` grew after warm-up, as
        the median of the last third of the samples minus that of the first third (a thread
        or descriptor that lives for a moment, caught by one sample, is not growth)."""
        warm = self.warm()
        if len(warm) < 3:
            return {}
        third = len(warm) // 3
        out = {}
        for n in warm[0].fds:
            values = [getattr(s, what)[n] for s in warm]
            out[n] = float(np.median(values[-third:]) - np.median(values[:third]))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "transfers": self.transfers,
            "messages": self.messages,
            "cancelled": self.cancelled,
            "nic_faults": self.nic_faults,
            "retries": self.retries,
            "bytes_verified": self.bytes_verified,
            "problems": self.problems,
            "slopes": self.slopes(),
            "growth_after_warmup": {w: self.growth(w) for w in ("fds", "threads", "rss_kib")},
            "samples": [
                {
                    "round": s.round,
                    "elapsed_s": round(s.elapsed_s, 3),
                    "rss_kib": s.rss_kib,
                    "fds": s.fds,
                    "threads": s.threads,
                    "registrations": list(s.registrations),
                }
                for s in self.samples
            ],
        }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def sample_process(pid: int) -> tuple[int, int, int]:
    """(resident set size in KiB, open file descriptors, threads) of ``pid`` (Linux /proc)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def run_soak(
    writer: TransferEngine,
    target: TransferEngine,
    alloc: Callable[[int], U8],
    *,
    pids: dict[str, int],
    seconds: float | None = None,
    rounds: int | None = None,
    seed: int = 0,
    kill_nic: Callable[[int], None] | None = None,
    restore_nic: Callable[[int], None] | None = None,
    fault_every: int = 4,
    sample_every: int = 1,
    settle: Callable[[], None] = lambda: None,
) -> SoakReport:
    """Soak ``writer`` → ``target`` for ``seconds`` or ``rounds`` (whichever ends first).

    ``alloc(n)``: memory both engines can register (the target's side is read back here).
    ``kill_nic``/``restore_nic``: take the writer's NIC down and back (None: no NIC faults).
    ``settle()``: let stray completions arrive before checking that no extra imm was counted.
    ``sample_every``: rounds between samples (a long run keeps fewer: they are this process's
    memory too).
    """
    if seconds is None and rounds is None:
        raise ValueError("give seconds or rounds")
    rng = random.Random(seed)
    nics = min(writer.num_nics, target.num_nics)
    src, dst = alloc(SLOTS * SLOT), alloc(SLOTS * SLOT)
    src[:] = np.frombuffer(rng.randbytes(SLOTS * SLOT), dtype=np.uint8)
    src_mr, dst_mr = writer.register(src), target.register(dst)
    desc = dst_mr.descriptor
    report = SoakReport()
    start = time.monotonic()
    r = 0
    try:
        while (rounds is None or r < rounds) and (seconds is None or time.monotonic() - start < seconds):
            faulty = kill_nic is not None and nics > 1 and r % fault_every == fault_every - 1
            if faulty:
                assert kill_nic is not None
                kill_nic(1)
                report.nic_faults += 1
            try:
                _round(writer, target, src, dst, src_mr, desc, r, rng, nics, report)
            finally:
                if faulty and restore_nic is not None:
                    restore_nic(1)
            settle()
            # what of the cancelled write landed before cancel returned: consumed, so that
            # the value starts from zero when it comes round again (nothing lands later)
            left = target.counter(_cancelled_imm(r)).value
            if left:
                target.counter(_cancelled_imm(r)).wait(left, timeout=T)
            for imm in _imms(r):
                extra = target.counter(imm).value
                if extra:
                    report.problems.append(f"round {r}: imm {imm} counted {extra} more than imms_at_target")
                    target.counter(imm).wait(extra, timeout=T)  # reported once, not every cycle
            r += 1
            report.rounds = r
            if r % sample_every == 0:
                report.samples.append(_sample(r, time.monotonic() - start, pids, writer, target))
    finally:
        report.retries = writer.stats().retries
        writer.deregister(src_mr)
        target.deregister(dst_mr)
    return report


# Imm values come round again every CYCLE rounds: the counter table keeps a count per value
# ever used, so fresh values each round would grow memory by design, not by a leak.
CYCLE = 32


def _imms(r: int) -> range:
    base = 1000 + (r % CYCLE) * 16
    return range(base, base + SLOTS)


def _cancelled_imm(r: int) -> int:
    """The imm of round ``r``'s cancelled write: its count is whatever landed before cancel."""
    return _imms(r)[4]


def _round(
    writer: TransferEngine,
    target: TransferEngine,
    src: U8,
    dst: U8,
    src_mr: Any,
    desc: Any,
    r: int,
    rng: random.Random,
    nics: int,
    report: SoakReport,
) -> None:
    imm = list(_imms(r))
    dst[:] = 0
    lengths = [rng.randint(1, SLOT) for _ in range(SLOTS)]
    checks: list[tuple[Transfer, int, int, int]] = []  # transfer, imm, slot, length
    # sharded write, pinned write (last NIC), paged write (16 pages of 1 KiB, shuffled), imm only
    t = writer.submit_write(src_mr, 0, lengths[0], desc, 0, imm=imm[0], routing=Sharded())
    checks.append((t, imm[0], 0, lengths[0]))
    t = writer.submit_write(src_mr, SLOT, lengths[1], desc, SLOT, imm=imm[1], routing=Pinned(nics - 1))
    checks.append((t, imm[1], 1, lengths[1]))
    pages = np.array(rng.sample(range(16), 16), dtype=np.int64)
    t = writer.submit_paged_write(
        src_mr, pages, 1024, desc, pages, 1024, 1024, src_offset=2 * SLOT, dst_offset=2 * SLOT, imm=imm[2]
    )
    checks.append((t, imm[2], 2, 16 * 1024))
    t = writer.submit_imm(desc, imm[3])
    checks.append((t, imm[3], -1, 0))
    # a write cancelled at once: it may land in part, then nothing more of it
    doomed = writer.submit_write(src_mr, 4 * SLOT, SLOT, desc, 4 * SLOT, imm=imm[4])
    doomed.cancel(T)
    report.cancelled += 1
    # two more sharded writes over every NIC, and messages
    for k in (5, 6):
        t = writer.submit_write(src_mr, k * SLOT, lengths[k], desc, k * SLOT, imm=imm[k], routing=Sharded())
        checks.append((t, imm[k], k, lengths[k]))
    payloads = [rng.randbytes(rng.randint(1, 200)) for _ in range(3)]
    sends = [writer.submit_send(target.address, p) for p in payloads]
    # a scratch registration on the writer, rekeyed and dropped (registrations must not leak)
    scratch = writer.register(np.zeros(4096, dtype=np.uint8))
    writer.deregister(writer.rekey(scratch))
    landed: list[tuple[Transfer, int, int, int]] = []
    for t, i, slot, length in checks:
        err = t.exception(T)
        if err is not None:
            report.problems.append(f"round {r}: imm {i} failed: {type(err).__name__}: {err}")
            continue
        landed.append((t, i, slot, length))
    # every other round, one joint wait for all of them (it takes each count exactly once too)
    if r % 2:
        target.wait_counts([(i, t.imms_at_target) for t, i, _s, _n in landed], timeout=T)
    else:
        for t, i, _s, _n in landed:
            target.counter(i).wait(t.imms_at_target, timeout=T)
    for _t, i, slot, length in landed:
        report.transfers += 1
        if slot >= 0:
            lo = slot * SLOT
            if slot == 2:  # paged: the pages land where their indices say, 1 KiB each
                ok = np.array_equal(dst[lo : lo + 16 * 1024], src[lo : lo + 16 * 1024])
            else:
                ok = (
                    np.array_equal(dst[lo : lo + length], src[lo : lo + length])
                    and not dst[lo + length : lo + SLOT].any()
                )
            if not ok:
                report.problems.append(f"round {r}: slot {slot} (imm {i}) does not hold exactly its bytes")
            else:
                report.bytes_verified += length
    err = doomed.exception(T)
    if err is not None and not isinstance(err, TransferCancelled):
        report.problems.append(
            f"round {r}: the cancelled write failed otherwise: {type(err).__name__}: {err}"
        )
    for t in sends:
        err = t.exception(T)
        if err is not None:
            report.problems.append(f"round {r}: a message failed: {type(err).__name__}: {err}")
    got = sorted(target.recv(timeout=T).data for _ in sends)
    if got != sorted(payloads):
        report.problems.append(
            f"round {r}: messages {len(got)} arrived, not the {len(payloads)} sent, once each"
        )
    report.messages += len(got)


def _sample(
    r: int, elapsed: float, pids: dict[str, int], writer: TransferEngine, target: TransferEngine
) -> Sample:
    rss, fds, threads = {}, {}, {}
    for name, pid in pids.items():
        rss[name], fds[name], threads[name] = sample_process(pid)
    regs = (writer.stats().registrations, target.stats().registrations)
    return Sample(r, elapsed, rss, fds, threads, regs)
