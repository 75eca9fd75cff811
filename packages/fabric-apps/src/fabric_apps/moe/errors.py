"""Errors of the MoE app, placed in fabric_core's error tree.

Transport failures keep fabric_core's own types: a dead peer is ``PeerUnreachable``, a peer
that never sends is ``TransferTimeout`` (with expected and received counts), both raised by
the receive half that waits on it. These add what only the app knows.
"""

from __future__ import annotations

from fabric_core.errors import ConfigError, FabricError, TransportError

__all__ = ["MoeProtocolError", "MoeStateError", "StepAborted"]


class MoeStateError(ConfigError):
    """A half was called out of order (each step is dispatch_send, dispatch_recv,
    combine_send, combine_recv) or with data that does not match the step."""


class StepAborted(TransportError):
    """An earlier step of this ``MoeAllToAll`` failed (its cause is ``__cause__``): counts
    and buffers may hold that step's leftovers, so the instance refuses further work. Close it
    and build a new one (another ``layer`` id) once the ranks agree to go on."""


class MoeProtocolError(FabricError):
    """A peer wrote something this rank cannot accept (a count for another step, more tokens
    than ``max_tokens``, an expert id out of range): the ranks disagree on config or order."""
