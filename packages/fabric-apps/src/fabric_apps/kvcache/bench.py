"""``fabric bench kv``: KV-cache transfer between prefill and decode instances on this host,
at a real model's shape, with instances joining and dying while traffic runs.

P prefill and D decode instances, each with its own engine, find each other through a
``KvMembership`` in one ``torch.distributed`` store. On a compiled backend (efa, verbs) each
instance is a process; on the simulator each is a thread of this process on one
``SimFabric``. The run has two phases:

1. **throughput**: every decoder keeps ``window`` requests of ``throughput_tokens`` tokens
   outstanding (closed loop) for ``throughput_s`` seconds; aggregate GB/s and pages/s count
   the requests that completed after ``warmup_s``. With ``ceiling`` (a built
   ``benchmarks/ceiling/fi_ceiling``) the raw-libfabric ceiling runs at the page's write
   size and at 64 KiB before the instances start and after they exit, in the same run, twice
   each: writing through a buffer the size of a decoder's cache (``kv_working_set``: what the
   KV transfer does to memory) and to one cached offset (``cached``: the most a copy can do).
2. **serve**: Poisson arrivals (``rate`` requests/s per decoder), prompt lengths uniform in
   ``[min_tokens, max_tokens]``, for ``serve_s`` seconds. At a third of it a new decode
   instance joins (``add_decode``); at two thirds prefill 0 is killed (``kill_prefill``:
   SIGKILL of its process, or a crash of its simulated engine). Only requests that touched
   the killed prefill may fail, each with a typed error; every decoder ends with no page
   allocated (``check_no_leaks``).

Every completed request is checked: each page of each layer starts and ends with a stamp
naming (prefill, layer, segment, source page), so a misplaced, missing or truncated page
fails the run; every ``verify_every``-th request of the serve phase (of both phases with
``verify_throughput``) is also compared byte for byte (CRC-32 of each page against the
prefill's table of its source pages). A request whose bytes are wrong fails the benchmark
instead of being timed. Checking runs on a thread of its own beside the decoder's loop; the
byte compare of a Llama request reads its 335 MB once more on the host's cores, which is why
the throughput phase leaves it out unless asked (on two cores it cost a quarter of the rate).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import random
import signal
import statistics
import subprocess
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import numpy as np

from fabric_core.errors import ConfigError, FabricError, TransferTimeout

from .._spawn import child_env, reap
from .decode import KvDecoder, KvReceive
from .errors import Exhausted
from .layout import KvLayout, deepseek_v3, llama31_70b, write_units
from .membership import KvMembership, Member, NoPrefill, PrefillRouter
from .prefill import KvPrefiller, PrefillJob

__all__ = ["MODELS", "KvBenchError", "KvBenchResult", "KvBenchSpec", "run_kv_bench"]

logger = logging.getLogger(__name__)

MODELS: dict[str, Callable[[int], KvLayout]] = {"llama70b": llama31_70b, "deepseek-v3": deepseek_v3}
"""The model shapes: Llama-3.1-70B (80 layers, 8 KV heads x 128, 16-token pages) and
DeepSeek-V3 MLA (61 layers, a 576-wide latent, 64-token pages), both bf16."""

_PREFIX = "kvb"  # store keys of the run; the membership lives under "kvb-members"
_MAGIC = 0x4B  # top byte of every stamp word ("K")


class KvBenchError(FabricError):
    """An instance failed or hung, a page landed wrong, a request failed that touched no
    killed instance, or pages leaked."""


@dataclass(frozen=True)
class KvBenchSpec:
    """What to run (see the module's docstring). ``layers`` overrides the model's layer count
    (small runs); ``engine_options`` go to ``open_engine``."""

    backend: str
    model: str = "llama70b"
    prefills: int = 2
    decodes: int = 1
    add_decode: bool = True
    kill_prefill: bool = True
    throughput_s: float = 4.0
    warmup_s: float = 1.0
    window: int = 2
    throughput_tokens: int = 1024
    serve_s: float = 9.0
    rate: float = 4.0
    min_tokens: int = 128
    max_tokens: int = 1024
    decode_blocks: int = 256
    prefill_blocks: int = 64
    layers: int | None = None
    kv_split: str = "stacked"
    max_inflight: int = 4
    verify_every: int = 4
    verify_throughput: bool = False
    seed: int = 0
    timeout: float = 60.0
    ceiling: str | None = None
    ceiling_provider: str = "shm"
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.prefills < 1 or self.decodes < 1:
            raise ConfigError(f"prefills and decodes must be >= 1, got {self.prefills} and {self.decodes}")
        if self.kill_prefill and self.prefills < 2:
            raise ConfigError("kill_prefill needs at least 2 prefill instances (one must survive)")
        if not (self.throughput_s >= 0 and self.serve_s >= 0 and self.timeout > 0):
            raise ConfigError(
                f"throughput_s and serve_s must be >= 0 and timeout > 0, got {self.throughput_s}, "
                f"{self.serve_s}, {self.timeout}"
            )
        if self.throughput_s > 0 and not 0 <= self.warmup_s < self.throughput_s:
            raise ConfigError(f"warmup_s must be in [0, throughput_s), got {self.warmup_s}")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"layers must be >= 1, got {self.layers}")
        if not self.rate > 0 or self.window < 1 or self.verify_every < 1 or self.max_inflight < 1:
            raise ConfigError("rate must be > 0; window, verify_every and max_inflight >= 1")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        self.layout(1)  # the model and kv_split make a layout (ConfigError if not)
        most = max(self.max_tokens, self.throughput_tokens)
        pages = self.pages(most)
        if pages > self.prefill_blocks or pages > self.decode_blocks:
            raise ConfigError(
                f"a {most}-token prompt needs {pages} pages: raise prefill_blocks ({self.prefill_blocks}) "
                f"and decode_blocks ({self.decode_blocks}) to at least that"
            )

    def layout(self, num_blocks: int) -> KvLayout:
        """The model's layout over ``num_blocks`` pages (with ``layers`` and ``kv_split``)."""
        base = MODELS[self.model](num_blocks)
        if self.model == "llama70b" and self.kv_split != base.kv_split:
            base = llama31_70b(num_blocks, kv_split=self.kv_split)  # type: ignore[arg-type]
        return replace(base, num_layers=self.layers) if self.layers is not None else base

    @functools.cached_property
    def _format(self) -> KvLayout:  # the page format, over one page (per-request arithmetic)
        return self.layout(1)

    def pages(self, tokens: int) -> int:
        return -(-tokens // self._format.block_size)

    def request_bytes(self, pages: int) -> int:
        lay = self._format
        return pages * lay.num_layers * len(lay.segments) * lay.page_bytes


# --- pages: source content, stamps, checks ----------------------------------------------


def source_table(request_id: str, num_pages: int, prefill_blocks: int) -> list[int]:
    """The prefill's block table for a request: distinct source pages drawn from the id, so
    the decoder knows which pages it should have received without being told."""
    rng = random.Random(zlib.crc32(request_id.encode()))
    return rng.sample(range(prefill_blocks), num_pages)


class _Words:
    """The first and last 8-byte words of every page of every segment of every layer, as
    indices into one flat int64 view of the buffer that holds all the layer tensors
    (``_layer_tensors``): a check is one gather over ``[layers, segments, pages]``, not a few
    torch calls per layer and segment (those took a sixth of a core at Llama's rate)."""

    def __init__(self, layout: KvLayout, layers: tuple[tuple[Any, ...], ...]) -> None:
        self.layout = layout
        storage = layers[0][0].untyped_storage()
        base = storage.data_ptr()
        if any(t.untyped_storage().data_ptr() != base for ts in layers for t in ts):
            raise ConfigError("the layer tensors must be views of one buffer (_layer_tensors)")
        whole = _torch().empty(0, dtype=_torch().uint8).set_(storage)
        self.u8: np.ndarray = whole.numpy()
        self.flat: np.ndarray = self.u8[: self.u8.size // 8 * 8].view(np.int64)
        segs = layout.segments
        tensor_at = np.array([[t.data_ptr() - base for t in ts] for ts in layers], np.int64)  # [L, T]
        # byte offset of page 0 of (layer, segment), and each segment's page stride
        self.start = tensor_at[:, [g.tensor for g in segs]] + np.array([g.offset for g in segs], np.int64)
        self.stride = np.array([g.stride for g in segs], np.int64)
        self.layer_bits = (np.arange(len(layers), dtype=np.int64) & 0xFFF) << 36
        self.seg_bits = (np.arange(len(segs), dtype=np.int64) & 0xF) << 32

    def _offsets(self, blocks: Any) -> np.ndarray:
        """Byte offset of each page: ``[layers, segments, len(blocks)]``."""
        b = np.asarray(blocks, dtype=np.int64)
        return self.start[:, :, None] + b[None, None, :] * self.stride[None, :, None]

    def _index(self, blocks: Any) -> tuple[np.ndarray, np.ndarray]:
        head = self._offsets(blocks) // 8
        return head, head + self.layout.page_bytes // 8 - 1

    def _stamps(self, prefill: int, sources: Any) -> np.ndarray:
        """Stamps of (prefill, layer, segment, source page p): p's head word is
        ``"K" prefill layer segment 2p``, its tail word that plus one; ``[layers, segments,
        len(sources)]``."""
        top = (_MAGIC << 56) | ((prefill & 0xFF) << 48)
        src = np.asarray(sources, dtype=np.int64)
        return top + self.layer_bits[:, None, None] + self.seg_bits[None, :, None] + 2 * src[None, None, :]

    def stamp_sources(self, prefill: int) -> None:
        blocks = np.arange(self.layout.num_blocks, dtype=np.int64)
        head, tail = self._index(blocks)
        want = self._stamps(prefill, blocks)
        self.flat[head] = want
        self.flat[tail] = want + 1

    def check(self, prefill: int, pages: Any, sources: Any) -> str | None:
        """None if every page of ``pages`` carries the stamps of source page ``sources``."""
        head, tail = self._index(pages)
        want = self._stamps(prefill, sources)
        got_h, got_t = self.flat[head], self.flat[tail]
        bad = (got_h != want) | (got_t != want + 1)
        if not bad.any():
            return None
        layer, s, i = (int(v[0]) for v in np.nonzero(bad))
        return (
            f"layer {layer} {self.layout.segments[s].name} page {int(pages[i])}: stamps "
            f"{int(got_h[layer, s, i]):#x}/{int(got_t[layer, s, i]):#x}, want source page "
            f"{int(sources[i])} of prefill {prefill}"
        )

    def clear(self, pages: Any) -> None:
        head, tail = self._index(pages)
        self.flat[head] = 0
        self.flat[tail] = 0

    def crcs(self, blocks: Any) -> np.ndarray:
        """CRC-32 of every page: ``[layers, segments, len(blocks)]``."""
        offsets = self._offsets(list(blocks))
        out = np.zeros(offsets.shape, dtype=np.uint32)
        pb, u8 = self.layout.page_bytes, self.u8
        for idx, off in np.ndenumerate(offsets):
            out[idx] = zlib.crc32(u8[off : off + pb].data)
        return out


def _torch() -> Any:
    import torch

    return torch


def _layer_tensors(layout: KvLayout) -> list[Any]:
    """Each layer's tensor(s) in the layout's canonical shape: views of one zeroed buffer."""
    torch = _torch()
    shape = layout.accepted_shapes()[0]
    per = layout.tensors_per_layer
    whole = torch.zeros((layout.num_layers * per, *shape), dtype=getattr(torch, layout.dtype))
    return [
        tuple(whole[layer * per + t] for t in range(per)) if per > 1 else whole[layer]
        for layer in range(layout.num_layers)
    ]


def _source_caches(layout: KvLayout, prefill: int, seed: int) -> list[Any]:
    """Random bits, the same in every process that builds them, then the stamps."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed * 1009 + prefill)
    caches = _layer_tensors(layout)
    for entry in caches:
        for t in entry if isinstance(entry, tuple) else (entry,):
            t.view(torch.int16).random_(generator=g)
    return caches


# --- one instance ---------------------------------------------------------------------------


@dataclass
class _Ctl:
    """How an instance sees the run: the store (flags under ``kvb/``) and, on the simulator,
    the event that says its engine was crashed."""

    store: Any
    timeout: float
    killed: threading.Event | None = None

    def set(self, key: str, value: bytes = b"1") -> None:
        self.store.set(f"{_PREFIX}/{key}", value)

    def flag(self, key: str) -> bool:
        return bool(self.store.check([f"{_PREFIX}/{key}"]))

    def wait(self, key: str, timeout: float | None = None) -> None:
        self.store.wait([f"{_PREFIX}/{key}"], timedelta(seconds=self.timeout if timeout is None else timeout))

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(f"{_PREFIX}/{key}"))

    def dead(self) -> bool:
        return self.killed is not None and self.killed.is_set()


def _prefill_body(spec: KvBenchSpec, index: int, engine: Any, ctl: _Ctl) -> dict[str, Any]:
    """Serve every request that comes, writing all layers at once, until the run ends; then
    drain (finish what is in flight) and leave."""
    layout = spec.layout(spec.prefill_blocks)
    caches = _source_caches(layout, index, spec.seed)
    words = _Words(layout, layout.check(caches))
    words.stamp_sources(index)
    every = list(range(layout.num_blocks))
    ctl.set(f"crc/{index}", words.crcs(every).tobytes())
    pf = KvPrefiller(engine, layout, caches, max_inflight=spec.max_inflight, timeout=spec.timeout)
    members = KvMembership(ctl.store, f"{_PREFIX}-members", timeout=spec.timeout)
    me = members.join("prefill", f"prefill-{index}", pf.address)
    ctl.set(f"ready/prefill-{index}")
    jobs: list[PrefillJob] = []
    outcomes: Counter[str] = Counter()
    quiet_since = time.monotonic()
    draining = False
    try:
        while not ctl.dead():
            if not draining and ctl.flag("end"):
                members.drain(me)
                draining = True
            try:
                req = pf.next_request(0.02)
            except TransferTimeout:
                req = None
            if req is not None:
                quiet_since = time.monotonic()
                table = source_table(req.request_id, req.num_pages, layout.num_blocks)
                try:
                    job = pf.begin(req, table, timeout=spec.timeout)
                    job.write_all()
                    jobs.append(job)
                except FabricError as exc:
                    outcomes[type(exc).__name__] += 1
            still = []
            for job in jobs:
                if not job.done():
                    still.append(job)
                    continue
                err = job.exception(0)
                outcomes["ok" if err is None else type(err).__name__] += 1
            jobs = still
            if draining and not jobs and time.monotonic() - quiet_since > 0.2:
                break
        if ctl.dead():
            return {"killed": True}
        members.leave(me)
        stats = pf.stats()
        return {"outcomes": dict(outcomes), "completed": stats.completed, "failed": stats.failed}
    finally:
        if not ctl.dead():
            pf.close(timeout=5.0)


@dataclass
class _Record:
    rid: str
    phase: str
    prefill: str
    prefill_index: int
    pages: int
    bytes: int
    arrival: float
    issued: float = math.nan
    done: float = math.nan
    error: str | None = None


class _Decoder:
    """One decode instance's traffic: requests out through a ``PrefillRouter``, completions
    back through a queue, each checked and its pages released."""

    def __init__(self, spec: KvBenchSpec, index: int, engine: Any, ctl: _Ctl) -> None:
        self.spec, self.index, self.ctl = spec, index, ctl
        self.layout = spec.layout(spec.decode_blocks)
        caches = _layer_tensors(self.layout)
        self.words = _Words(self.layout, self.layout.check(caches))
        self.dec = KvDecoder(
            engine, self.layout, caches, timeout=spec.timeout, settle_timeout_s=min(30.0, spec.timeout)
        )
        self.members = KvMembership(ctl.store, f"{_PREFIX}-members", timeout=spec.timeout)
        self.router = PrefillRouter(self.dec, self.members, connect_timeout=min(10.0, spec.timeout))
        self.done: queue.SimpleQueue[tuple[_Record, KvReceive, BaseException | None]] = queue.SimpleQueue()
        self.records: list[_Record] = []
        self.outstanding = 0
        self.settled = self.checked = self.verified = 0
        self.problems: list[str] = []
        self.crc: dict[int, np.ndarray] = {}
        self.to_check: queue.SimpleQueue[tuple[_Record, KvReceive, np.ndarray | None] | None] = (
            queue.SimpleQueue()
        )
        self.checker = threading.Thread(target=self._checker, name="kv-bench-checker", daemon=True)
        self.checker.start()
        self.seq = 0
        self.last_refresh = 0.0
        self.me: Member | None = None

    def join(self) -> None:
        self.members.wait_for("prefill", 1 if self.ctl.flag("serve/add") else self.spec.prefills)
        self.me = self.members.join("decode", f"decode-{self.index}", self.dec.address)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_refresh > 0.1:
            self.last_refresh = now
            self.router.refresh()

    def issue(self, phase: str, tokens: int, arrival: float) -> bool:
        """One request; False (nothing taken) if pages or imms or prefills are short now."""
        pages = self.spec.pages(tokens)
        rid = f"d{self.index}-{phase}-{self.seq}"
        try:
            member, handle = self.router.receive(rid, pages)
        except (Exhausted, NoPrefill):
            return False
        self.seq += 1
        rec = _Record(
            rid,
            phase,
            member.name,
            int(member.name.rsplit("-", 1)[1]),
            pages,
            self.spec.request_bytes(pages),
            arrival,
            time.monotonic(),
        )
        self.records.append(rec)
        self.outstanding += 1

        def done(h: KvReceive) -> None:
            self._finished(rec, h, None)

        def failed(h: KvReceive, exc: BaseException) -> None:
            self._finished(rec, h, exc)

        handle.on_done(done)
        handle.on_error(failed)
        return True

    def _finished(self, rec: _Record, handle: KvReceive, exc: BaseException | None) -> None:
        rec.done = time.monotonic()
        self.done.put((rec, handle, exc))

    def collect(self, timeout: float) -> int:
        """Handle the completions that arrive within ``timeout`` (at least one wait)."""
        n = 0
        try:
            item = self.done.get(timeout=max(0.0, timeout))
            while True:
                self._settle(*item)
                n += 1
                item = self.done.get_nowait()
        except queue.Empty:
            return n

    def _settle(self, rec: _Record, handle: KvReceive, exc: BaseException | None) -> None:
        self.outstanding -= 1
        if exc is not None:
            rec.error = type(exc).__name__
            return
        # The pages are checked (and released) by the checker thread, so this loop issues the
        # next request at once: checking is the benchmark's, not the transfer's, and on the
        # caller's thread it left the window short while it ran.
        table = None
        if rec.phase != "tput" or self.spec.verify_throughput:
            self.settled += 1  # requests eligible for the byte compare
            if self.settled % self.spec.verify_every == 0:
                table = self._crc_table(rec.prefill_index)  # the store's client stays on this thread
        self.to_check.put((rec, handle, table))

    def _crc_table(self, prefill: int) -> np.ndarray:
        table = self.crc.get(prefill)
        if table is None:
            raw = self.ctl.get(f"crc/{prefill}")
            lay = self.layout
            table = self.crc[prefill] = np.frombuffer(raw, dtype=np.uint32).reshape(
                lay.num_layers, len(lay.segments), self.spec.prefill_blocks
            )
        return table

    def _checker(self) -> None:
        while (item := self.to_check.get()) is not None:
            rec, handle, table = item
            try:
                sources = source_table(rec.rid, rec.pages, self.spec.prefill_blocks)
                problem = self.words.check(rec.prefill_index, handle.pages, sources)
                self.checked += 1
                if problem is None and table is not None:
                    problem = self._verify(handle, sources, table)
                    self.verified += 1
                if problem is not None:
                    self.problems.append(f"{rec.rid} from {rec.prefill}: {problem}")
                self.words.clear(handle.pages)
            except Exception as exc:  # a broken check must fail the run, not pass it
                self.problems.append(f"{rec.rid}: checking failed: {exc!r}")
            finally:
                handle.release()

    def _verify(self, handle: KvReceive, sources: list[int], table: np.ndarray) -> str | None:
        got = self.words.crcs(handle.pages)
        want = table[:, :, sources]
        if not np.array_equal(got, want):
            layer, seg, i = (int(v[0]) for v in np.nonzero(got != want))
            return f"layer {layer} {self.layout.segments[seg].name} page {int(handle.pages[i])}: bytes differ"
        return None

    def stop_checking(self) -> None:
        """Let the checker finish every page handed to it (and release them), then end it."""
        if self.checker.is_alive():
            self.to_check.put(None)
            self.checker.join(self.spec.timeout)
            if self.checker.is_alive():
                self.problems.append("the page checker did not finish")

    def drain(self, deadline: float) -> None:
        while self.outstanding and time.monotonic() < deadline:
            self.collect(0.05)

    def throughput(self) -> None:
        self.ctl.wait("tput/go")
        while not self.ctl.flag("tput/stop"):
            self.refresh()
            while self.outstanding < self.spec.window and self.issue(
                "tput", self.spec.throughput_tokens, time.monotonic()
            ):
                pass
            self.collect(0.02)
        self.drain(time.monotonic() + self.spec.timeout)

    def serve(self) -> None:
        rng = random.Random(self.spec.seed * 7919 + self.index)
        backlog: list[tuple[float, int]] = []
        next_at = time.monotonic() + rng.expovariate(self.spec.rate)
        while not self.ctl.flag("serve/stop"):
            now = time.monotonic()
            while next_at <= now:
                backlog.append((next_at, rng.randint(self.spec.min_tokens, self.spec.max_tokens)))
                next_at += rng.expovariate(self.spec.rate)
            self.refresh()
            while backlog and self.issue("serve", backlog[0][1], backlog[0][0]):
                backlog.pop(0)
            self.collect(min(0.02, max(0.0, next_at - time.monotonic())))
        for arrival, tokens in backlog:  # arrived, never got pages before the end
            self.records.append(
                _Record(
                    f"d{self.index}-late",
                    "serve",
                    "",
                    -1,
                    self.spec.pages(tokens),
                    0,
                    arrival,
                    error="NotIssued",
                )
            )
        self.drain(time.monotonic() + self.spec.timeout)

    def finish(self) -> dict[str, Any]:
        self.stop_checking()
        if self.outstanding:
            self.problems.append(f"{self.outstanding} requests still outstanding at the end")
        if self.me is not None:
            self.members.drain(self.me)
        idle = self.dec.wait_idle(self.spec.timeout)
        stats = self.dec.stats()
        leak = None
        try:
            self.dec.allocator.check_no_leaks()
        except FabricError as exc:
            leak = str(exc)
        if self.me is not None:
            self.members.leave(self.me)
        return {
            "records": [asdict(r) for r in self.records],
            "checked": self.checked,
            "verified": self.verified,
            "problems": self.problems,
            "idle": idle,
            "leak": leak,
            "pages_used": stats.pages_used,
        }


def _decoder_body(spec: KvBenchSpec, index: int, engine: Any, ctl: _Ctl, late: bool) -> dict[str, Any]:
    d = _Decoder(spec, index, engine, ctl)
    try:
        if late:
            ctl.set(f"ready/decode-{index}")
            ctl.wait("serve/add", spec.timeout + spec.throughput_s + spec.serve_s)
            d.join()
            joined = time.monotonic()
        else:
            d.join()
            joined = time.monotonic()
            ctl.set(f"ready/decode-{index}")
            if spec.throughput_s > 0:
                d.throughput()
            ctl.set(f"tput/done/decode-{index}")
            ctl.wait("serve/go")
        d.serve()
        return {"joined": joined, **d.finish()}
    finally:
        d.stop_checking()
        d.dec.close(timeout=5.0)


# --- the run: processes or threads ------------------------------------------------------------


def _instances(spec: KvBenchSpec) -> list[tuple[str, int, bool]]:
    """(role, index, late) of every instance the run starts."""
    out = [("prefill", i, False) for i in range(spec.prefills)]
    out += [("decode", i, False) for i in range(spec.decodes)]
    if spec.add_decode:
        out.append(("decode", spec.decodes, True))
    return out


def _body(spec: KvBenchSpec, role: str, index: int, late: bool, engine: Any, ctl: _Ctl) -> dict[str, Any]:
    if role == "prefill":
        return _prefill_body(spec, index, engine, ctl)
    return _decoder_body(spec, index, engine, ctl, late)


def _process_instance(spec: KvBenchSpec, role: str, index: int, late: bool, port: int, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    from fabric_core import open_engine

    torch.set_num_threads(1)
    engine = None
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=spec.timeout)
        )
        engine = open_engine(spec.backend, **spec.engine_options)
        conn.send(("ok", _body(spec, role, index, late, engine, _Ctl(store, spec.timeout))))
    except BaseException as exc:
        conn.send(("error", f"{role}-{index}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
    finally:
        if engine is not None:
            engine.close()
        conn.close()


class _Conductor:
    """The parent's side: sets the phase flags on the clock and kills prefill 0."""

    def __init__(
        self, spec: KvBenchSpec, store: Any, kill: Callable[[], None], failed: Callable[[], str | None]
    ):
        self.spec, self.ctl, self.kill, self.failed = spec, _Ctl(store, spec.timeout), kill, failed
        self.marks: dict[str, float] = {}

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            problem = self.failed()
            if problem:
                raise KvBenchError(problem)
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def _await(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.spec.timeout * 2
        while not all(self.ctl.flag(k) for k in keys):
            if time.monotonic() > deadline:
                raise KvBenchError(
                    f"instances not ready before the deadline: {[k for k in keys if not self.ctl.flag(k)]}"
                )
            self._sleep(0.02)

    def run(self) -> dict[str, float]:
        s = self.spec
        self._await([f"ready/{r}-{i}" for r, i, _ in _instances(s)])
        initial = [f"decode-{i}" for i in range(s.decodes)]
        self.marks["tput_go"] = time.monotonic()
        self.ctl.set("tput/go")
        self._sleep(s.throughput_s)
        self.marks["tput_stop"] = time.monotonic()
        self.ctl.set("tput/stop")
        self._await([f"tput/done/{n}" for n in initial])
        self.marks["serve_go"] = time.monotonic()
        self.ctl.set("serve/go")
        if s.add_decode:
            self._sleep(s.serve_s / 3)
            self.marks["add_decode"] = time.monotonic()
            self.ctl.set("serve/add")
        if s.kill_prefill:
            self._sleep(s.serve_s * 2 / 3 - (time.monotonic() - self.marks["serve_go"]))
            self.marks["kill_prefill"] = time.monotonic()
            self.kill()
        self._sleep(s.serve_s - (time.monotonic() - self.marks["serve_go"]))
        self.marks["serve_stop"] = time.monotonic()
        self.ctl.set("serve/stop")
        return self.marks


def _run_processes(spec: KvBenchSpec) -> tuple[dict[str, Any], dict[str, float]]:
    import torch.distributed as dist

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=spec.timeout)
    )
    ctx = mp.get_context("spawn")
    insts = _instances(spec)
    pipes = [ctx.Pipe(duplex=False) for _ in insts]
    procs = [
        ctx.Process(target=_process_instance, args=(spec, r, i, late, store.port, pipes[k][1]), daemon=True)
        for k, (r, i, late) in enumerate(insts)
    ]
    with child_env():
        for p in procs:
            p.start()
    for _, there in pipes:
        there.close()
    names = [f"{r}-{i}" for r, i, _ in insts]
    victim = names.index("prefill-0")
    results: dict[str, Any] = {}
    errors: list[str] = []
    waiting: dict[Any, int] = {here: k for k, (here, _) in enumerate(pipes)}

    def poll(block: float = 0.0) -> None:
        ready: list[Any] = mp_connection.wait(list(waiting), block)
        for here in ready:
            k = waiting.pop(here)
            try:
                status, body = here.recv()
            except EOFError:
                if k == victim and "kill_prefill" in marks:
                    results[names[k]] = {"killed": True}
                    continue
                procs[k].join(5)
                errors.append(f"{names[k]}: exited with code {procs[k].exitcode} and no result")
                continue
            if status == "ok":
                results[names[k]] = body
            else:
                errors.append(body)

    def failed() -> str | None:
        poll()
        return "; ".join(errors) or None

    def kill() -> None:
        marks["kill_prefill"] = time.monotonic()
        os.kill(procs[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]

    marks: dict[str, float] = {}
    try:
        marks.update(_Conductor(spec, store, kill, failed).run())
        deadline = time.monotonic() + spec.timeout * 2
        while waiting and not errors and [k for k in waiting.values() if names[k].startswith("decode")]:
            if time.monotonic() > deadline:
                errors.append("decoders gave no result before the deadline")
                break
            poll(0.1)
        _Ctl(store, spec.timeout).set("end")  # prefills drain and leave
        while waiting and not errors:
            if time.monotonic() > deadline:
                errors.append(f"{[names[k] for k in waiting.values()]}: no result before the deadline")
                break
            poll(0.1)
    finally:
        reap(procs, kill=bool(errors))
    if errors:
        raise KvBenchError("; ".join(errors))
    return results, marks


def _run_threads(spec: KvBenchSpec) -> tuple[dict[str, Any], dict[str, float]]:
    """The simulator: one engine per instance on one ``SimFabric``, instances as threads."""
    import torch.distributed as dist

    from fabric_sim import SimFabric

    fabric = SimFabric(spec.seed)
    nics = int(spec.engine_options.get("nics", 2))
    store = dist.HashStore()  # type: ignore[attr-defined]
    insts = _instances(spec)
    names = [f"{r}-{i}" for r, i, _ in insts]
    engines = [
        fabric.open_engine(nics, **{k: v for k, v in spec.engine_options.items() if k != "nics"})
        for _ in insts
    ]
    killed = {n: threading.Event() for n in names}
    results: dict[str, Any] = {}
    errors: list[str] = []

    def run(k: int) -> None:
        r, i, late = insts[k]
        try:
            results[names[k]] = _body(
                spec, r, i, late, engines[k], _Ctl(store, spec.timeout, killed[names[k]])
            )
        except BaseException as exc:
            if killed[names[k]].is_set():
                results[names[k]] = {"killed": True}
            else:
                errors.append(f"{names[k]}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")

    threads = [
        threading.Thread(target=run, args=(k,), name=f"kv-{names[k]}", daemon=True) for k in range(len(insts))
    ]
    for t in threads:
        t.start()

    def kill() -> None:
        victim = names.index("prefill-0")
        killed["prefill-0"].set()
        fabric.fail_peer(engines[victim])

    try:
        marks = _Conductor(spec, store, kill, lambda: "; ".join(errors) or None).run()
        deadline = time.monotonic() + spec.timeout * 2
        for k, t in enumerate(threads):
            if insts[k][0] == "decode":
                t.join(max(0.0, deadline - time.monotonic()))
        _Ctl(store, spec.timeout).set("end")
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        if hung:
            errors.append(f"{hung}: no result before the deadline")
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.close(timeout=2.0)
    if errors:
        raise KvBenchError("; ".join(errors))
    return results, marks


# --- the ceiling --------------------------------------------------------------------------------


def _ceiling(spec: KvBenchSpec, sizes: list[int], span: int) -> dict[int, float]:
    """GB/s of the raw-libfabric ceiling program at each size (median of its 3 repetitions);
    ``span`` > 0: its writes cycle through buffers of that many bytes, as the KV cache's are."""
    assert spec.ceiling is not None
    cmd = [spec.ceiling, "-p", spec.ceiling_provider, "-s", ",".join(map(str, sizes)), "-r", "3", "-l", "200"]
    cmd += ["-b", str(span)] if span else []
    env = {**os.environ, "FI_TCP_IFACE": os.environ.get("FI_TCP_IFACE", "lo")}
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KvBenchError(f"the ceiling program {spec.ceiling} failed: {exc}") from None
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {int(r["size"]): float(r["gbytes_per_s"]) for r in rows if r.get("kind") == "bandwidth"}


CEILING_MODES = ("kv_working_set", "cached")
"""How the ceiling program is run: its writes cycling through a buffer the size of a
decoder's cache, page by page (what the KV transfer does), and all to offset 0 (source and
target stay in the CPU caches: the most a copy can do)."""


# --- results -------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class KvBenchResult:
    """What a run measured; ``to_json`` for the file, ``summary`` for the report."""

    spec: KvBenchSpec
    throughput: dict[str, Any]
    serve: dict[str, Any]
    ceiling: dict[str, Any] | None
    host: dict[str, Any]
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        lay = self.spec.layout(1)
        return {
            "kind": "kv",
            "spec": asdict(self.spec),
            "layout": {
                "layers": lay.num_layers,
                "block_size": lay.block_size,
                "segments": [s.name for s in lay.segments],
                "page_bytes": lay.page_bytes,
                # the writes per page and layer and their bytes (K and V of an interleaved
                # cache go as one; of a stacked cache, as two in one paged request)
                "write_bytes": [u.length for u in write_units(lay, lay) for _ in u.shifts],
                "bytes_per_token": self.spec.request_bytes(1) // lay.block_size,
            },
            "host": self.host,
            "duration_s": self.duration_s,
            "throughput": self.throughput,
            "ceiling": self.ceiling,
            "serve": self.serve,
        }


def _summarise(
    spec: KvBenchSpec, results: dict[str, Any], marks: dict[str, float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    decoders = {n: r for n, r in results.items() if n.startswith("decode")}
    records = [rec for r in decoders.values() for rec in r["records"]]
    problems = [p for r in decoders.values() for p in r["problems"]]
    lay = spec.layout(1)
    # throughput: requests that completed inside [go + warm-up, stop]
    lo, hi = marks["tput_go"] + spec.warmup_s, marks["tput_stop"]
    tput = [r for r in records if r["phase"] == "tput" and r["error"] is None and lo <= r["done"] <= hi]
    span = max(hi - lo, 1e-9)
    nbytes = sum(r["bytes"] for r in tput)
    npages = sum(r["pages"] for r in tput)
    throughput = {
        "seconds": span,
        "requests": len(tput),
        "tokens_per_request": spec.throughput_tokens,
        "gbytes_per_s": nbytes / span / 1e9,
        "pages_per_s": npages / span,
        "writes_per_s": npages * lay.num_layers * sum(len(u.shifts) for u in write_units(lay, lay)) / span,
        "latency_ms_p50": _pct([(r["done"] - r["issued"]) * 1e3 for r in tput], 0.5),
        "failed": sum(1 for r in records if r["phase"] == "tput" and r["error"] is not None),
    }
    serve = [r for r in records if r["phase"] == "serve"]
    ok = [r for r in serve if r["error"] is None]
    failed = [r for r in serve if r["error"] not in (None, "NotIssued")]
    killed_at = marks.get("kill_prefill")
    expected = [
        r for r in failed if r["prefill"] == "prefill-0" and killed_at is not None and r["done"] >= killed_at
    ]
    unexpected = [r for r in failed if r not in expected] + [
        r for r in records if r["phase"] == "tput" and r["error"] is not None
    ]
    per_decoder = {
        n: {
            "completed": sum(1 for r in d["records"] if r["phase"] == "serve" and r["error"] is None),
            "failed": sum(
                1 for r in d["records"] if r["phase"] == "serve" and r["error"] not in (None, "NotIssued")
            ),
            "joined_s": d["joined"] - marks["serve_go"],
            "pages_used_at_end": d["pages_used"],
            "idle_at_end": d["idle"],
            "leak": d["leak"],
            "checked": d["checked"],
            "verified": d["verified"],
        }
        for n, d in sorted(decoders.items())
    }
    per_prefill = Counter(r["prefill"] for r in ok)
    serve_span = marks["serve_stop"] - marks["serve_go"]
    after_kill = [r for r in ok if killed_at is not None and r["issued"] > killed_at]
    serve_out = {
        "seconds": serve_span,
        "rate_per_decoder": spec.rate,
        "arrived": len(serve),
        "completed": len(ok),
        "failed": len(failed),
        "failed_touching_killed": len(expected),
        "failed_errors": dict(Counter(r["error"] for r in failed)),
        "unexpected_failures": [f"{r['rid']} ({r['prefill']}): {r['error']}" for r in unexpected][:20],
        "not_issued": sum(1 for r in serve if r["error"] == "NotIssued"),
        "completed_after_kill": len(after_kill),
        "gbytes_per_s": sum(r["bytes"] for r in ok) / max(serve_span, 1e-9) / 1e9,
        "transfer_ms_p50": _pct([(r["done"] - r["issued"]) * 1e3 for r in ok], 0.5),
        "transfer_ms_p99": _pct([(r["done"] - r["issued"]) * 1e3 for r in ok], 0.99),
        "end_to_end_ms_p50": _pct([(r["done"] - r["arrival"]) * 1e3 for r in ok], 0.5),
        "end_to_end_ms_p99": _pct([(r["done"] - r["arrival"]) * 1e3 for r in ok], 0.99),
        "per_decoder": per_decoder,
        "per_prefill": dict(sorted(per_prefill.items())),
        # each prefill's jobs by outcome, as it saw them (the killed one reports nothing)
        "prefill_jobs": {n: r.get("outcomes") for n, r in sorted(results.items()) if n.startswith("prefill")},
        "leaked_pages": sum(d["pages_used"] for d in decoders.values()),
        "events_s": {
            k: v - marks["serve_go"] for k, v in marks.items() if k in ("add_decode", "kill_prefill")
        },
        "problems": problems[:20],
    }
    return throughput, serve_out


def run_kv_bench(spec: KvBenchSpec) -> KvBenchResult:
    """Run ``spec``; ``KvBenchError`` if an instance fails or hangs, a page lands wrong, a
    request fails that touched no killed instance, or a page leaks."""
    from fabric_core.cli.bench import host_info

    start = time.perf_counter()
    lay = spec.layout(1)
    sizes = sorted({*(u.length for u in write_units(lay, lay)), 65536})
    span = spec.decode_blocks * spec.request_bytes(1)  # one decoder's whole cache
    spans = {"kv_working_set": span, "cached": 0}
    runs: dict[str, list[dict[int, float]]] = {m: [] for m in CEILING_MODES}
    if spec.ceiling:  # before the instances start and after they exit: nothing else running
        for mode in CEILING_MODES:
            runs[mode].append(_ceiling(spec, sizes, spans[mode]))
    results, marks = _run_threads(spec) if spec.backend == "sim" else _run_processes(spec)
    if spec.ceiling:
        for mode in CEILING_MODES:
            runs[mode].append(_ceiling(spec, sizes, spans[mode]))
    throughput, serve = _summarise(spec, results, marks)
    ceiling: dict[str, Any] | None = None
    if spec.ceiling:
        ceiling = {"provider": spec.ceiling_provider, "program": os.path.basename(spec.ceiling)}
        for mode in CEILING_MODES:
            gbps = {str(s): statistics.median([r[s] for r in runs[mode]]) for s in sizes}
            ceiling[mode] = {
                "span_bytes": spans[mode],
                "runs": {str(s): [r.get(s) for r in runs[mode]] for s in sizes},
                "gbytes_per_s": gbps,
                "ratio": {s: throughput["gbytes_per_s"] / g for s, g in gbps.items() if g},
            }
    result = KvBenchResult(spec, throughput, serve, ceiling, host_info(), time.perf_counter() - start)
    bad = []
    if serve["problems"]:
        bad.append(f"pages landed wrong: {serve['problems'][:3]}")
    if serve["unexpected_failures"]:
        bad.append(f"requests failed that touched no killed instance: {serve['unexpected_failures'][:5]}")
    leaks = {n: d["leak"] for n, d in serve["per_decoder"].items() if d["leak"] or d["pages_used_at_end"]}
    if leaks:
        bad.append(f"pages leaked: {leaks}")
    if bad:
        raise KvBenchError("; ".join(bad))
    return result
