"""``python -m fabric_core.cli``: the same as the ``fabric`` command."""

from __future__ import annotations

from .app import main

if __name__ == "__main__":
    main(prog_name="fabric")
