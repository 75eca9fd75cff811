"""The shm endpoint's region table (fabric/region_table.hpp), across real processes:
``packages/fabric-core/tests/native/region_table.cpp``.

libfabric 1.17's shm wedges a writer whose write the target refuses, so the writer reads the
target's table before it posts. The program checks the verdicts and their words (inside a
region: taken; outside it, without remote write, an unknown key: refused, saying which), the
fence of deregistration against a writer in another process (``revoke`` waits for its hold,
then the key is refused), a writer killed while holding (``revoke`` gives up after 1 s and
says so), overflow (a key the table cannot hold is never refused), a table made again under
a live view's name, and, with threads, that no hold outlives the ``revoke`` of its entry.
Built plain, under ThreadSanitizer, and under ASan + UBSan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.parametrize("sanitizer", [None, "thread", "address,undefined"])
def test_the_region_table_refuses_what_the_target_would_and_fences_revocation(
    native_program: Callable[..., Any], sanitizer: str | None
) -> None:
    done = native_program("region_table", sanitizer)(timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "region table: ok" in done.stdout
    assert "fence: revoke waited" in done.stdout
    assert ", 0 violations" in done.stdout
