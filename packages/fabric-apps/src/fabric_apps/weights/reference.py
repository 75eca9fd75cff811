"""The single-process torch reference of a reshard, and deterministic parameter contents.

The reference never uses the planner: a rank's piece is cut from the full tensor with torch
(``narrow``, ``reshape``, indexing) by the definitions of the shardings in
``fabric_apps.weights.spec``. Tests and ``fabric bench rl`` hold an update to it byte for
byte.

For models too large to hold whole in every process, ``Pattern`` gives each parameter a
deterministic content computed from the global element index alone, so each rank fills its
own piece (a source) or checks it (a destination) without the full tensor, from the
sharding's runs (which the tests check against the torch reference).
"""

from __future__ import annotations

import zlib
from typing import Any

from .spec import ExpertPlacement, FleetSpec, FsdpShard, ParamSpec, Replicated, TensorParallel

__all__ = ["FLOATS", "Pattern", "full_tensors", "real_elements", "shard"]

FLOATS = frozenset({"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"})


def _torch() -> Any:
    from . import _torch as t

    return t.module()


def full_tensors(spec: FleetSpec, seed: int) -> dict[str, Any]:
    """One full tensor per parameter in the fleet's dtype, drawn from ``seed`` (floats are
    finite and small, so every cast of them is exact to compare)."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in spec.params:
        if p.dtype in FLOATS:
            out[p.name] = (torch.randn(p.shape, generator=g) * 4).to(getattr(torch, p.dtype))
        else:
            out[p.name] = torch.randint(0, 100, p.shape, generator=g).to(getattr(torch, p.dtype))
    return out


def _group(world: int, replicas: int, rank: int) -> tuple[int, int]:
    g = world // replicas
    return g, rank % g


def shard(full: Any, p: ParamSpec, world: int, rank: int) -> Any:
    """Rank ``rank``'s local piece of ``full`` under ``p.sharding`` (FSDP: padded with zeros)."""
    torch = _torch()
    s = p.sharding
    if isinstance(s, Replicated):
        return full.clone()
    if isinstance(s, FsdpShard):
        g, i = _group(world, s.replicas, rank)
        flat = full.reshape(-1)
        c = -(-flat.numel() // g)
        out = torch.zeros(c, dtype=full.dtype)
        piece = flat[i * c : (i + 1) * c]
        out[: piece.numel()] = piece
        return out
    if isinstance(s, TensorParallel):
        g, i = _group(world, s.replicas, rank)
        parts = torch.split(full, list(s.sections), s.dim) if s.sections else (full,)
        mine = []
        for part in parts:  # a fused tensor: each part cut on its own, the rank's slices concatenated
            size = part.shape[s.dim]
            c = -(-size // g)
            lo = min(i * c, size)
            mine.append(part.narrow(s.dim, lo, min(lo + c, size) - lo))
        return torch.cat(mine, s.dim).contiguous()
    assert isinstance(s, ExpertPlacement)
    return full[torch.tensor(list(s.experts[rank]), dtype=torch.long)].contiguous()


def real_elements(p: ParamSpec, world: int, rank: int) -> int:
    """Elements of rank ``rank``'s local piece that are parameter data (not FSDP padding)."""
    local = p.sharding.local_shape(p.shape, world, rank)
    n = 1
    for d in local:
        n *= d
    if isinstance(p.sharding, FsdpShard):
        _g, i = _group(world, p.sharding.replicas, rank)
        return max(0, min(n, p.numel - i * n))
    return n


class Pattern:
    """Parameter contents as a function of (parameter, global element index), for models
    of any size: element ``g`` of parameter ``p`` is ``table[(g + salt(p)) % period]``, a
    fixed draw of the integers -8..8 (exact in every dtype, fp8 included). A piece written to
    the wrong place, cast wrongly or not written at all does not match (the period is a
    prime, so no row length of a real model is a multiple of it)."""

    period = 65521

    def __init__(self, seed: int = 0, block: int = 1 << 22) -> None:
        torch = _torch()
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(-8, 9, (self.period,), generator=g, dtype=torch.int8)
        reps = -(-(block + self.period) // self.period)
        self._table = first.repeat(reps)  # periodic: any window of `block` elements is a slice
        self._block = block
        self._typed: dict[str, Any] = {}

    def _of(self, dtype: str) -> Any:
        t = self._typed.get(dtype)
        if t is None:
            torch = _torch()
            t = self._typed[dtype] = self._table.to(torch.float32).to(getattr(torch, dtype))
        return t

    @staticmethod
    def salt(name: str) -> int:
        return zlib.crc32(name.encode())

    def _pieces(self, p: ParamSpec, world: int, rank: int) -> Any:
        """(local start, global start, length) of every piece of ``rank``'s part of ``p``, in
        blocks of at most the table's window."""
        runs = p.sharding.runs(p.shape, world, rank)
        salt = self.salt(p.name)
        for start, length, local in zip(
            runs.start.tolist(), runs.length.tolist(), runs.local.tolist(), strict=True
        ):
            done = 0
            while done < length:
                n = min(self._block, length - done)
                yield local + done, (start + done + salt) % self.period, n
                done += n

    def fill(self, views: dict[str, Any], spec: FleetSpec, rank: int) -> None:
        """Write rank ``rank``'s pieces into its ``views`` (``LocalLayout.views``); padding
        is left alone."""
        for p in spec.params:
            flat, table = views[p.name].reshape(-1), self._of(p.dtype)
            for lo, at, n in self._pieces(p, spec.world_size, rank):
                flat[lo : lo + n].copy_(table[at : at + n])

    def mismatch(self, views: dict[str, Any], spec: FleetSpec, rank: int) -> str | None:
        """None if rank ``rank``'s ``views`` hold exactly their pieces, else what differs."""
        torch = _torch()
        for p in spec.params:
            flat, table = views[p.name].reshape(-1), self._of(p.dtype)
            for lo, at, n in self._pieces(p, spec.world_size, rank):
                got = flat[lo : lo + n]
                if not torch.equal(got, table[at : at + n]):
                    bad = int((got != table[at : at + n]).nonzero()[0, 0])
                    return (
                        f"rank {rank}: {p.name} element {lo + bad} (local) is {got[bad].item()}, "
                        f"expected {table[at + bad].item()}"
                    )
        return None
