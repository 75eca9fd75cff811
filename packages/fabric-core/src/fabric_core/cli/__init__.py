"""The ``fabric`` command-line tool (``fabric info``, ``fabric bench``, ``fabric demo``)."""

from __future__ import annotations

from .app import main

__all__ = ["main"]
