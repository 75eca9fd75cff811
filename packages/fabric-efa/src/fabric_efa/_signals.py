"""Keep the process's signal handlers across loading libfabric.

Debian's libfabric links the PSM providers' libraries (libpsm_infinipath, libpsm2), whose
constructors install handlers for SIGINT, SIGSEGV, SIGBUS, SIGILL and SIGABRT when the library
is loaded: they print a backtrace and ``exit(1)``. In a Python process that turns Ctrl-C into
a silent exit with status 1 instead of ``KeyboardInterrupt``, and replaces faulthandler's (and
pytest's) crash reports. ``preserved()`` saves the handlers at the C level before the compiled
module is loaded and puts them back after, whatever a provider library installed meanwhile.
"""

from __future__ import annotations

import ctypes
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["preserved"]

_SIGNALS = tuple(
    int(getattr(signal, name))
    for name in ("SIGINT", "SIGTERM", "SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT", "SIGFPE")
    if hasattr(signal, name)
)
_SIGACTION_BYTES = 512  # larger than any libc's struct sigaction; kept opaque


def _sigaction() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sigaction
    except (AttributeError, OSError):  # not a POSIX libc
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


@contextmanager
def preserved() -> Iterator[None]:
    """Restore the C-level handlers of the fatal and interrupt signals on exit."""
    sigaction = _sigaction()
    saved: list[tuple[int, ctypes.Array[ctypes.c_char]]] = []
    if sigaction is not None:
        for sig in _SIGNALS:
            buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
            if sigaction(sig, None, buf) == 0:
                saved.append((sig, buf))
    try:
        yield
    finally:
        if sigaction is not None:
            for sig, buf in saved:
                sigaction(sig, buf, None)
