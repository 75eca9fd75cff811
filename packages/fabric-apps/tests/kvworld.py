"""Helpers of the KV-cache tests: engines on a private simulated fabric, caches, byte checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fabric_apps.kvcache import KvDecoder, KvLayout, KvPrefiller, KvReceive, PrefillJob
from fabric_core import TransferEngine
from fabric_sim import SimFabric

T = 10.0  # every wait in these tests is bounded by this many seconds
SENTINEL = 0xEE
Bytes = np.ndarray[Any, np.dtype[np.uint8]]


def byte_view(t: Any) -> Bytes:
    """The bytes of a contiguous numpy array or torch CPU tensor, as a writable uint8 view."""
    if isinstance(t, torch.Tensor):
        out: Bytes = t.reshape(-1).view(torch.uint8).numpy()
        return out
    return np.asarray(t).reshape(-1).view(np.uint8)


def make_caches(layout: KvLayout, *, fill: int | None = None, seed: int = 0) -> list[Any]:
    """One layer entry per layer in the layout's canonical shape (torch for bfloat16).

    ``fill`` sets every byte; otherwise bytes are random and never the sentinel.
    """
    rng = np.random.default_rng(seed)
    shape = layout.accepted_shapes()[0]
    layers: list[Any] = []
    for _ in range(layout.num_layers):
        tensors = []
        for _name in layout.tensor_names:
            if layout.dtype == "bfloat16":
                t: Any = torch.empty(shape, dtype=torch.bfloat16)
            else:
                t = np.empty(shape, dtype=np.dtype(layout.dtype))
            b = byte_view(t)
            if fill is None:
                b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
                b[b == SENTINEL] = SENTINEL + 1
            else:
                b[:] = fill
            tensors.append(t)
        layers.append(tensors[0] if len(tensors) == 1 else tuple(tensors))
    return layers


def page(layout: KvLayout, caches: list[Any], layer: int, seg: int, p: int) -> Bytes:
    """The bytes of page ``p`` of segment ``seg`` of ``layer``."""
    s = layout.segments[seg]
    entry = caches[layer]
    tensor = entry[s.tensor] if isinstance(entry, tuple) else entry
    start = s.offset + p * s.stride
    return byte_view(tensor)[start : start + layout.page_bytes]


def snapshot(caches: list[Any]) -> list[Bytes]:
    out = []
    for entry in caches:
        for t in entry if isinstance(entry, tuple) else (entry,):
            out.append(byte_view(t).copy())
    return out


def check_pages(
    dlayout: KvLayout, dcaches: list[Any], dpages: Any, playout: KvLayout, pcaches: list[Any], ppages: Any
) -> None:
    """Every decoder page ``dpages[i]`` equals prefill page ``ppages[i]``, in every layer and segment."""
    assert len(dpages) == len(ppages)
    for layer in range(dlayout.num_layers):
        for si, seg in enumerate(dlayout.segments):
            pi = [s.name for s in playout.segments].index(seg.name)
            for d, p in zip(dpages, ppages, strict=True):
                got = page(dlayout, dcaches, layer, si, int(d))
                want = page(playout, pcaches, layer, pi, int(p))
                assert np.array_equal(got, want), f"layer {layer} {seg.name} page {d} != prefill page {p}"


def expected_image(
    dlayout: KvLayout, before: list[Any], writes: list[tuple[Any, Any]], playout: KvLayout, pcaches: list[Any]
) -> list[Bytes]:
    """The decoder's bytes after ``writes`` ((decoder pages, prefill pages) pairs) land on ``before``."""
    image = [
        byte_view(t).copy() for entry in before for t in (entry if isinstance(entry, tuple) else (entry,))
    ]
    per = dlayout.tensors_per_layer
    for dpages, ppages in writes:
        for layer in range(dlayout.num_layers):
            for seg in dlayout.segments:
                pi = [s.name for s in playout.segments].index(seg.name)
                for d, p in zip(dpages, ppages, strict=True):
                    start = seg.offset + int(d) * seg.stride
                    image[layer * per + seg.tensor][start : start + dlayout.page_bytes] = page(
                        playout, pcaches, layer, pi, int(p)
                    )
    return image


class World:
    """Engines on one private ``SimFabric``; closes everything it made."""

    def __init__(self, seed: int, *, chunk_bytes: int = 64) -> None:
        self.fabric = SimFabric(seed, chunk_bytes=chunk_bytes)
        self._engines: list[TransferEngine] = []
        self._apps: list[KvDecoder | KvPrefiller] = []

    def engine(self, nics: int = 2) -> TransferEngine:
        e = self.fabric.open_engine(nics)
        self._engines.append(e)
        return e

    def decoder(
        self, layout: KvLayout, *, nics: int = 2, fill: int = SENTINEL, **kw: Any
    ) -> tuple[KvDecoder, list[Any]]:
        caches = make_caches(layout, fill=fill)
        d = KvDecoder(self.engine(nics), layout, caches, timeout=T, **kw)
        self._apps.append(d)
        return d, caches

    def prefiller(
        self, layout: KvLayout, *, nics: int = 2, seed: int = 1, **kw: Any
    ) -> tuple[KvPrefiller, list[Any]]:
        caches = make_caches(layout, seed=seed)
        p = KvPrefiller(self.engine(nics), layout, caches, timeout=T, **kw)
        self._apps.append(p)
        return p, caches

    def close(self) -> None:
        for app in reversed(self._apps):
            app.close(timeout=2.0)
        for e in reversed(self._engines):
            e.close(timeout=2.0)


def serve(prefiller: KvPrefiller, src: dict[str, Any], n: int) -> list[PrefillJob]:
    """Take ``n`` requests, begin each with ``src[request_id]`` and write every layer,
    layer by layer across the jobs (as a batch of sequences would be computed)."""
    jobs = []
    for _ in range(n):
        req = prefiller.next_request(T)
        jobs.append(prefiller.begin(req, src[req.request_id], timeout=T))
    for layer in range(prefiller.layout.num_layers):
        for job in jobs:
            job.write_layer(layer)
    return jobs


def eventually(pred: Callable[[], bool], timeout: float = T) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes (for state settled by other threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return pred()


def wait_all(handles: list[KvReceive]) -> None:
    for h in handles:
        h.wait(T)
