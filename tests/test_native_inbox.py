"""The imm inbox through which the CUDA IPC domain delivers its imms (fabric/imm_inbox.hpp),
across real processes: ``packages/fabric-core/tests/native/inbox.cpp``.

Three forked senders push (imm, count) records while the target drains; one gives its lane
back, one exits without doing so, one is SIGKILLed mid-stream. Every count a sender published
is counted once, with the sender's address, and every lane is free afterwards. A full lane
refuses a push and writes nothing; a full inbox refuses a sender with its reason; both take
traffic again once drained. Built plain, under ThreadSanitizer, and under ASan + UBSan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.parametrize("sanitizer", [None, "thread", "address,undefined"])
def test_the_inbox_counts_every_published_imm_once_across_processes(
    native_program: Callable[..., Any], sanitizer: str | None
) -> None:
    done = native_program("inbox", sanitizer)()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "inbox: ok" in done.stdout
    for k in range(3):
        assert f"sender {k}: published" in done.stdout
