"""Shared loopback harness for the peer-library benchmarks (Mooncake, NIXL).

The initiator (this process) writes into a target buffer owned by a second process, spawned with
``multiprocessing``. The two talk over a pipe only for setup, clearing the target buffer and
checking what landed; the timed writes go through the peer library alone.

For each size a window of ``min(--window, BUFFER_BYTES // size)`` writes is posted back to back
and waited for, repeatedly, for ``--seconds``. Local slot ``i`` goes to remote slot
``window - 1 - i``, so neither library can coalesce the window into one large contiguous write.
After the timed writes the target hashes its buffer and the initiator compares that with the
source pattern it sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

SIZES = (4096, 65536, 1 << 20, 16 << 20)
BUFFER_BYTES = 64 << 20
DEFAULT_WINDOW = 64
PIPE_TIMEOUT_S = 30.0
DEADLINE_S = 115.0


@dataclass(frozen=True)
class Slot:
    """Byte offsets of one write: ``local`` in the source buffer, ``remote`` in the target's."""

    local: int
    remote: int


Writer = Callable[[], None]
MakeWriter = Callable[[int, list[Slot]], Writer]

_children: list[BaseProcess] = []
_results = sys.stdout


def slots(size: int, max_window: int) -> list[Slot]:
    """One window's writes: local slot i lands in remote slot window - 1 - i."""
    window = min(max_window, BUFFER_BYTES // size)
    return [Slot(i * size, (window - 1 - i) * size) for i in range(window)]


def source_buffer() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, BUFFER_BYTES, dtype=np.uint8)


def _digest(data: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(data).data, digest_size=16).hexdigest()


def _expected_digest(src: np.ndarray, size: int, window: int) -> str:
    return _digest(src[: window * size].reshape(window, size)[::-1])


def log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def recv(conn: Connection, timeout: float = PIPE_TIMEOUT_S) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the other process within {timeout:.0f} s")
    return conn.recv()


def serve(conn: Connection, buf: np.ndarray) -> None:
    """Target side: answer ``(command, nbytes)`` requests until told to stop or the initiator goes away."""
    while True:
        try:
            command, nbytes = recv(conn, timeout=DEADLINE_S)
        except (EOFError, TimeoutError):
            return
        if command == "clear":
            buf[:] = 0
            conn.send("ok")
        elif command == "digest":
            conn.send(_digest(buf[:nbytes]))
        else:
            return


def _start_watchdog() -> None:
    """End the whole run, target processes included, if it is still going after ``DEADLINE_S``."""

    def expire() -> None:
        log(f"deadline of {DEADLINE_S:.0f} s passed; stopping")
        for child in _children:
            child.kill()
        os._exit(3)

    watchdog = threading.Timer(DEADLINE_S, expire)
    watchdog.daemon = True
    watchdog.start()


@contextmanager
def target_process(main: Callable[..., None], *args: Any) -> Iterator[Connection]:
    """Spawn ``main(conn, *args)`` as the target process; stop it (terminate, then kill) on the way out."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=main, args=(theirs, *args), daemon=True)
    child.start()
    theirs.close()  # so that a target that dies shows up here as EOF, not as silence
    _children.append(child)
    try:
        yield ours
        ours.send(("stop", 0))
        child.join(5)
    finally:
        if child.is_alive():
            child.terminate()
            child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
        _children.remove(child)


def setup(
    description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """Parse the common flags, keep stdout for the JSON lines only, and start the watchdog.

    File descriptor 1 is pointed at stderr, so whatever the libraries print (NIXL logs to stdout)
    cannot mix with the results, which go to a duplicate of the original stdout.
    """
    global _results
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--reps", type=int, default=3, help="sweeps to run; the median per size is reported")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed writing per size per sweep")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="most writes posted per window")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    sys.stdout.flush()
    _results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _start_watchdog()
    return args


def _timed(write: Writer, seconds: float) -> tuple[int, float]:
    """Call ``write`` (one window, waited for) until ``seconds`` pass; return (rounds, elapsed)."""
    rounds = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        write()
        rounds += 1
    return rounds, elapsed


def _sweep(
    conn: Connection, src: np.ndarray, make_writer: MakeWriter, args: argparse.Namespace
) -> dict[int, float]:
    """One pass over SIZES; returns GB/s per size, each checked against the target's bytes."""
    rates = {}
    for size in SIZES:
        window = slots(size, args.window)
        conn.send(("clear", 0))
        recv(conn)
        write = make_writer(size, window)
        write()  # warm-up: connection setup and first-touch costs stay out of the timing
        rounds, elapsed = _timed(write, args.seconds)
        conn.send(("digest", len(window) * size))
        if recv(conn) != _expected_digest(src, size, len(window)):
            raise RuntimeError(f"target buffer does not match the source pattern at size {size}")
        rates[size] = rounds * len(window) * size / elapsed / 1e9
        log(f"  {size:>9} B: {rates[size]:7.3f} GB/s ({rounds} windows of {len(window)} in {elapsed:.2f} s)")
    return rates


def run(
    conn: Connection,
    src: np.ndarray,
    make_writer: MakeWriter,
    args: argparse.Namespace,
    labels: dict[str, str],
) -> None:
    """Run ``args.reps`` sweeps and print one JSON line per size: ``labels`` plus the medians."""
    runs: dict[int, list[float]] = {size: [] for size in SIZES}
    for rep in range(args.reps):
        log(f"{labels['peer']} ({labels['transport']}) sweep {rep + 1}/{args.reps}")
        for size, rate in _sweep(conn, src, make_writer, args).items():
            runs[size].append(rate)
    for size, rates in runs.items():
        gbps = statistics.median(rates)
        row = {
            **labels,
            "size": size,
            "window": len(slots(size, args.window)),
            "gbytes_per_s": round(gbps, 4),
            "writes_per_s": round(gbps * 1e9 / size, 1),
            "reps": args.reps,
        }
        _results.write(json.dumps(row) + "\n")
