"""The engine core's liveness probes against a peer that cannot answer at once (seconds).

``packages/fabric-core/tests/native/liveness.cpp`` runs two engines over in-memory NICs: the
target of an imm waits naming the writer, so it probes it, while the writer's sends are
refused (-EAGAIN: on shm, its queue full of writes). The answer must wait for the provider,
not be dropped, the prober must ask again, and a probe left over from an earlier wait must
not condemn the peer when a new wait begins; a peer that is really gone still fails the wait
within the probe timeout. Case 4: a submit posts from the caller's thread only when asked
to (the Python binding asks only with the GIL released: a provider call can block, on shm
for good if a peer died holding its queue lock). Case 5: a worker stuck inside such a call
makes neither ``dump``, a fence, a cancel nor ``close`` wait for ever: ``close`` returns
false after its bound, the engine says it is wedged, and its completion side is released.
Case 8: the queue depth (``queue_depth``) holds each peer to its share of posted writes
without holding up the others. Case 9: a peer of this process that closes (an shm endpoint
whose memory goes with it) is neither posted to by writes that waited behind the depth nor
left before the writes it took are reaped (both crashed the efa suite at depth 2).
Case 10: writes the domain leaves out of the queue depth (the CUDA IPC domain's copies into
a peer's GPU memory) are neither held by it nor take from it. Case 12: a write the transport
fails without a reason (as tcp does over a refused key) is held while the target is asked
what it registered under the key: a refusal becomes kRemoteAccess saying why, a write the
target would have taken fails as it did, a target that cannot answer costs 1 s, and the
engine's dump lists the question while it is out. Case 13: a paged request as list ops (the
CUDA IPC domain's form) lands every page, counts one imm per page, fails whole on a refused
page, and is reordered under chaos. Case 14: while a thread spins on a counter, completions
are held back from the completion thread (which would take the GIL just as that thread
returns to Python) for a bounded time, and a thread that drains takes them itself. Case 15:
while a thread spins on a counter the worker steps aside (the spinner is the only poller), and
the last spinner to stop hands progress back to it where work is in flight, the waiter goes
to sleep or another waiter is queued, not where it leaves satisfied with nothing in flight and
nothing else waiting. Case 16: a step that completed
nothing but kept the provider busy (tcp reading a write's bytes in the target's polls) counts
as work, so the worker does not nap between such polls, and naps again once they are quick;
meanwhile a dump still gets the progress lock (the worker lets a waiting thread in). Case 17:
a target whose polls move the writes' bytes (``target_copies``, as on shm) lingers after
work while its yields find the CPU free, counts every write once, and still naps once idle.
Case 18: the queue depth's byte allowance lets small writes to a peer go past the depth
while they fit, but not while writes to another peer are posted too, and never list ops.
Case 19: a watcher (the Python side's stall watchdog) sees a stuck worker's step stay the same
and its stall grow, where an idle engine shows none; and once the engine is declared wedged, a
stuck post that returns at last is the last one: the rest of its request is never posted.
Case 20: the counter table's count of what still needs polling (queued waiters and live GPU
mirrors) goes back to zero through every way out of the table, each counted once.
Case 21: a peer that speaks another wire protocol (another fabric release) is told so at most
once a second, and the write that depends on it fails with kIncompatible about a second after
its probe, with a 30 s liveness timeout; once it speaks the same protocol again, a fence and a
write go through.
Case 22: frames larger than an engine's receive buffers (from a sender that did not ask its
size) are counted and cost it no buffer: after 40 of them, with 16 buffers, a fence is answered.
(``nox -s sanitize`` runs it under ThreadSanitizer too.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "packages" / "fabric-core" / "tests" / "native" / "liveness.cpp"
INCLUDE = ROOT / "packages" / "fabric-core" / "src" / "fabric_core" / "include"


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here (./dev test installs it)")
    out = tmp_path_factory.mktemp("native") / "liveness"
    flags = ["-std=c++17", "-O1", "-pthread", "-I", str(INCLUDE)]
    subprocess.run([cxx, *flags, str(TARGET), "-o", str(out)], check=True, timeout=300)
    return out


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("1", "refused answers: wait 0 after"),
        ("2", "second 0 after"),
        ("3", "gone: wait 3 after"),
        ("4", "posted inline yes; with inline_ok=false by the worker yes"),
        ("5", "close returned false after 0.2"),
        ("6", "0 loss(es) reported"),
        ("7", "switches between A and C"),
        ("8", "3 of 10 posted while held"),
        ("9", "0 posts to the closed endpoint, 0 writes reaped after it was gone"),
        ("10", "10 of 10 posted while held, then 2 of 3 counted ones"),
        ("11", "3 counted to an engine of this process, 3 after 2 more to one of another, 0 once reported"),
        ("12", "access: the dump showed the question out (key 77, 1 write held"),
        (
            "13",
            "lists: status 0, 300 imms counted yes, bytes landed, 300 work requests of 4800 bytes, 2 posts",
        ),
        ("14", "a drainer took one: yes"),
        (
            "15",
            "the worker stepped aside yes, pollers in a window 1 (the spinner's: yes); hand-backs: "
            "satisfied idle 0, with work in flight 1, to sleep 1, with a token waiter queued 1",
        ),
        (
            "16",
            "naps in 100 ms idle some, with polls busy few (steps counted as work: some), "
            "with quick polls again some; dumps refused the lock 0",
        ),
        (
            "17",
            "a copying target: 300 writes counted all, one more not counted; yields some, lone ones "
            "within them yes; naps in 100 ms idle some",
        ),
        (
            "18",
            "byte allowance: 5 of 10 posted alone, 2 beside another peer's; lists posted 1 of 2, "
            "a write behind one 0",
        ),
        (
            "19",
            "one step all along yes; wedged; first write landed yes, second posted no",
        ),
        ("20", "the counter table's watched count: back to 0 through every way out"),
        ("21", "another wire protocol: failed 8 after"),
        ("22", "oversized frames: 40 truncated; fence answered"),
    ],
)
def test_liveness_probes_answer_late_and_fail_only_the_gone(program: Path, case: str, says: str) -> None:
    done = subprocess.run([str(program), case], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert says in done.stdout and "liveness: ok" in done.stdout, done.stdout
