"""The imm layout of MoE dispatch and combine.

An engine counts imms in one 32-bit space with no sender identity, so every imm of this app
names what it counts::

     31        24 23                 13   12   11  10 9                   0
    +------------+---------------------+------+-------+---------------------+
    | tag 0x4D   | layer (11 bits)     | step | phase | source rank (10 b)  |
    +------------+---------------------+------+-------+---------------------+

* **tag** ``0x4D`` ("M") keeps the range apart from the other apps on the same engine
  (kvcache uses ``0x4B56....``);
* **layer** (0..2047) is the channel of one ``MoeAllToAll`` (one buffer set): one per MoE
  layer, or per micro-batch slot when layers share buffers;
* **step** is the parity of the step (a step is dispatch_send → dispatch_recv → combine_send
  → combine_recv). The protocol keeps ranks at most one phase apart (every pair signals in
  dispatch and in combine), so the next step's imms may arrive while a rank still finishes
  this one, but never the step after; parity keeps them on other counters;
* **phase**: 0 token counts, 1 dispatch payload, 2 combine payload (3 reserved);
* **source rank** (0..1023): the rank that sent the write, so a receiver waits per source,
  names that peer in the wait (a dead peer fails the wait at once) and knows exactly how many
  work requests that source sends.
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import NamedTuple

from fabric_core.errors import ConfigError

__all__ = ["IMM_TAG", "MAX_LAYER", "ImmFields", "Phase", "decode_imm", "moe_imm"]

logger = logging.getLogger(__name__)

IMM_TAG = 0x4D
MAX_LAYER = (1 << 11) - 1
_MAX_RANK = (1 << 10) - 1


class Phase(IntEnum):
    COUNTS = 0
    DISPATCH = 1
    COMBINE = 2


class ImmFields(NamedTuple):
    layer: int
    step_parity: int
    phase: Phase
    source: int


def moe_imm(layer: int, step: int, phase: Phase, source: int) -> int:
    """The imm of ``phase`` of ``step`` of ``layer`` sent by rank ``source``."""
    if not 0 <= layer <= MAX_LAYER:
        raise ConfigError(f"layer must be in [0, {MAX_LAYER}], got {layer}")
    if not 0 <= source <= _MAX_RANK:
        raise ConfigError(f"source rank must be in [0, {_MAX_RANK}], got {source}")
    if step < 0:
        raise ConfigError(f"step must be non-negative, got {step}")
    return (IMM_TAG << 24) | (layer << 13) | ((step & 1) << 12) | (int(Phase(phase)) << 10) | source


def decode_imm(imm: int) -> ImmFields:
    """The fields of an imm made by ``moe_imm``; ``ConfigError`` for any other value."""
    if not 0 <= imm < 1 << 32 or imm >> 24 != IMM_TAG or (imm >> 10) & 3 == 3:
        raise ConfigError(f"{imm:#x} is not an imm of fabric_apps.moe")
    return ImmFields((imm >> 13) & MAX_LAYER, (imm >> 12) & 1, Phase((imm >> 10) & 3), imm & _MAX_RANK)
