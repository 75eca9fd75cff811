"""The imm scheme of the weight update: one imm value per (step, source rank).

An engine counts imms in one 32-bit space with no sender identity, so the value itself says
who sent what for which step. A plan owns the 2**24 values ``[base, base + 2**24)`` (by default
``0x57000000``, "W"; the top byte keeps it apart from other applications on the same engine,
e.g. the KV cache's ``0x4B56....``). Inside that range::

    imm(step, source) = base + ((step mod 2**step_bits) << source_bits) + source

with ``source_bits = max(1, ceil(log2(num_sources)))`` and ``step_bits = 24 - source_bits``
(256 training ranks: 16 step bits, so a value comes back after 65536 steps).

Why per source and per step:

* **per step**: a write of step ``s`` that lands late is counted on step ``s``'s values, never
  on step ``s + 1``'s, so a late or failed step is never mistaken for the next one;
* **per source**: a destination waits on one counter per source that writes to it, naming
  that source, so a lost trainer fails the wait at once with ``PeerUnreachable`` and the
  destination knows exactly which sources' bytes have landed (see ``WeightsReceiver``).

A sender never has two steps in flight, and every destination byte has exactly one writer
in the plan (the same every step), so bytes of step ``s`` can never land over bytes of a later
step. Counts a destination did not consume (a step it skipped or gave up) are drained when
that source next completes a later step there, long before the value comes back.
"""

from __future__ import annotations

from dataclasses import dataclass

from fabric_core.errors import ConfigError

__all__ = ["DEFAULT_IMM_BASE", "IMM_SPAN_BITS", "ImmScheme"]

DEFAULT_IMM_BASE = 0x5700_0000
IMM_SPAN_BITS = 24
"""A plan uses ``2**24`` consecutive imm values starting at its base."""
_MIN_STEP_BITS = 4


@dataclass(frozen=True, slots=True)
class ImmScheme:
    """Imm values of a plan with ``num_sources`` source ranks, from ``base``."""

    base: int = DEFAULT_IMM_BASE
    num_sources: int = 1

    def __post_init__(self) -> None:
        for name, v in (("imm base", self.base), ("num_sources", self.num_sources)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an int, got {v!r}")
        span = 1 << IMM_SPAN_BITS
        if self.base < 0 or self.base % span or self.base + span > 1 << 32:
            raise ConfigError(
                f"imm base {self.base:#x} must be a multiple of {span:#x} below 2**32 "
                "(a plan owns 2**24 consecutive values)"
            )
        if self.num_sources < 1:
            raise ConfigError(f"num_sources must be positive, got {self.num_sources}")
        if IMM_SPAN_BITS - self.source_bits < _MIN_STEP_BITS:
            raise ConfigError(f"{self.num_sources} source ranks leave too few imm bits for the step")

    @property
    def source_bits(self) -> int:
        return max(1, (self.num_sources - 1).bit_length())

    @property
    def step_bits(self) -> int:
        return IMM_SPAN_BITS - self.source_bits

    @property
    def period(self) -> int:
        """Steps after which a value comes back."""
        return 1 << self.step_bits

    def imm(self, step: int, source: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        if not 0 <= source < self.num_sources:
            raise ConfigError(f"source rank {source} is outside [0, {self.num_sources})")
        return self.base + ((step % self.period) << self.source_bits) + source

    def decode(self, imm: int) -> tuple[int, int] | None:
        """``(step mod period, source)`` of a value of this scheme, None if it is not one."""
        off = imm - self.base
        if not 0 <= off < 1 << IMM_SPAN_BITS:
            return None
        source = off & ((1 << self.source_bits) - 1)
        if source >= self.num_sources:
            return None
        return off >> self.source_bits, source

    def describe(self) -> str:
        return f"imm = {self.base:#010x} + ((step mod 2**{self.step_bits}) << {self.source_bits}) + source"
