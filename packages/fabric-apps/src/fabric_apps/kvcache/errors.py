"""Errors of the KV-cache application, placed in fabric_core's error tree.

Transport failures keep fabric_core's own types (``PeerUnreachable``, ``TransferTimeout``,
``RemoteAccessError``, ``EngineClosed``); these add what only the application knows.
"""

from __future__ import annotations

from fabric_core.errors import ConfigError, EngineClosed, EngineWedged, FabricError, TransportError

__all__ = [
    "Exhausted",
    "ImmsExhausted",
    "PageLeak",
    "PageStateError",
    "PagesExhausted",
    "RequestAborted",
    "RequestCancelled",
]


class Exhausted(FabricError):
    """A pool ran dry; nothing was taken from it."""


class PagesExhausted(Exhausted):
    """The page allocator has fewer free pages than asked for; no page was allocated."""


class ImmsExhausted(Exhausted):
    """Every imm value of the decoder's pool is held by a request or still being reclaimed."""


class PageStateError(ConfigError):
    """A page was freed twice, never allocated, or is out of range; nothing was freed."""


class PageLeak(FabricError):
    """``PageAllocator.check_no_leaks`` found pages still allocated (listed per owner)."""


class RequestCancelled(FabricError):
    """The request was cancelled (by the decoder's caller, or by the decoder at the prefill)."""


class RequestAborted(TransportError):
    """The prefill instance gave the request up (``PrefillJob.abort``); ``message`` says why."""


def engine_gone(what: str, cause: EngineClosed) -> EngineClosed:
    """The error of work in flight when the engine under it closed (``cause``: what the engine
    raised). An engine that closed itself stuck in the provider keeps saying so."""
    if isinstance(cause, EngineWedged):
        return EngineWedged(f"{what}: {cause}", stalled_s=cause.stalled_s)
    return EngineClosed(what)
