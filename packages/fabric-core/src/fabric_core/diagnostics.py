"""Hang diagnostics for a running process: ``install_state_dump`` and ``fabric info --pending``.

Every engine opened in this process is tracked (weakly). A process that calls
``install_state_dump()`` writes the ``dump_state()`` of each of its open engines to
``state_path(pid)`` when it receives the signal (``SIGUSR1`` by default); ``fabric info
--pending PID`` sends that signal and prints the file. The handler runs in the main thread
between bytecodes: a main thread blocked in a fabric wait still gets there (waits wake every
100 ms to let signal handlers run).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import weakref
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, FabricError

if TYPE_CHECKING:
    from .api import TransferEngine

__all__ = ["dump_all", "install_state_dump", "request_state", "state_path"]

_engines: weakref.WeakSet[TransferEngine] = weakref.WeakSet()
_lock = threading.Lock()


def track(engine: TransferEngine) -> None:
    """Remember an engine of this process (engines call it when they open)."""
    with _lock:
        _engines.add(engine)


def open_engines() -> list[TransferEngine]:
    """Every engine of this process that is still open."""
    with _lock:
        return [e for e in _engines if not e.closed]


def dump_all() -> list[dict[str, Any]]:
    """``dump_state()`` of every open engine of this process."""
    out = []
    for engine in open_engines():
        try:
            out.append(engine.dump_state())
        except FabricError as exc:  # closed under us
            out.append({"error": str(exc)})
    return out


def state_path(pid: int, directory: str | os.PathLike[str] | None = None) -> Path:
    """Where process ``pid`` writes its state when signalled."""
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    return base / f"fabric-state-{pid}.json"


def install_state_dump(signum: int = signal.SIGUSR1, directory: str | os.PathLike[str] | None = None) -> Path:
    """On ``signum``, write every open engine's ``dump_state()`` to ``state_path(pid)``.

    Call from the main thread (Python's rule for signal handlers). Returns the path.
    """
    path = state_path(os.getpid(), directory)

    def handler(_signum: int, _frame: FrameType | None) -> None:
        doc = {"pid": os.getpid(), "time": time.time(), "engines": dump_all()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(path)  # atomic: a reader never sees half a file

    try:
        signal.signal(signum, handler)
    except ValueError as exc:  # not the main thread
        raise ConfigError(f"install_state_dump must be called from the main thread: {exc}") from None
    return path


def request_state(
    pid: int,
    signum: int = signal.SIGUSR1,
    timeout: float = 5.0,
    directory: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Signal process ``pid`` and return the state it writes (``install_state_dump``)."""
    path = state_path(pid, directory)
    before = path.stat().st_mtime_ns if path.exists() else None
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        raise ConfigError(f"no process {pid}") from None
    except PermissionError:
        raise ConfigError(f"not allowed to signal process {pid}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            doc: dict[str, Any] = json.loads(path.read_text())
            return doc
        time.sleep(0.02)
    raise FabricError(
        f"process {pid} wrote no state to {path} within {timeout:g} s: it must call "
        "fabric_core.diagnostics.install_state_dump() (and its main thread must be running Python "
        "or waiting in fabric)"
    )
