"""The efa backend's probe, and what a user sees when libfabric or a provider is missing."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric_core import registry
from fabric_core.errors import BackendUnavailable, TransportError
from fabric_core.settings import load_settings
from fabric_core.transfer import Transfer, new_transfer
from fabric_efa import EfaBackend
from fabric_efa.engine import EfaEngine, default_queue_bytes, default_queue_depth


def test_missing_libfabric_is_backend_unavailable_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # what importing the compiled module does when libfabric.so.1 is absent: ImportError
    monkeypatch.setitem(sys.modules, "fabric_efa._efa", None)
    probe = EfaBackend.probe(load_settings(efa_provider="shm"))
    assert not probe.available and "apt-get install libfabric1" in probe.reason
    with pytest.raises(BackendUnavailable, match="apt-get install libfabric1"):
        registry.open_engine("efa", efa_provider="shm")


def test_missing_libfabric_in_a_fresh_process_leaves_the_simulator_usable() -> None:
    code = (
        "import sys; sys.modules['fabric_efa._efa'] = None\n"
        "from fabric_core import registry\n"
        "from fabric_core.errors import BackendUnavailable\n"
        "try:\n    registry.open_engine('efa')\n"
        "except BackendUnavailable as e:\n    print('unavailable:', e)\n"
        "registry.open_engine('sim').close(); print('sim ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "unavailable: fabric backend 'efa' is unavailable" in done.stdout and "sim ok" in done.stdout


def test_a_provider_that_is_not_here_is_unavailable_with_its_reason() -> None:
    probe = EfaBackend.probe(load_settings(efa_provider="no-such-provider"))
    assert not probe.available and "no-such-provider" in probe.reason
    with pytest.raises(BackendUnavailable, match="no-such-provider"):
        registry.open_engine("efa", efa_provider="no-such-provider")


@pytest.mark.parametrize(("provider", "default", "allowance"), [("shm", 2, 4 << 20), ("tcp;ofi_rxm", 256, 0)])
def test_the_queue_depth_is_the_providers_unless_the_settings_choose(
    provider: str, default: int, allowance: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``queue_depth`` None: 2 on shm (an RL update ~40% faster, docs/backends/efa.md), 256
    elsewhere; a depth the settings give (keyword or FABRIC_QUEUE_DEPTH) wins, 0 included.
    The same for ``queue_bytes``, the byte allowance past the depth: 4 MiB on shm (a single
    64 KiB stream keeps its target busy), none elsewhere."""
    assert default_queue_depth(provider) == default
    assert default_queue_bytes(provider) == allowance
    other = 256 if default == 2 else 2  # the other provider's default
    for name, dflt, values, env in (
        ("queue_depth", default, (0, 7, other), 5),
        ("queue_bytes", allowance, (0, 12345), 65536),
    ):
        variable = f"FABRIC_{name.upper()}"
        monkeypatch.delenv(variable, raising=False)
        chosen: list[tuple[dict[str, Any], int]] = [({}, dflt)] + [({name: v}, v) for v in values]
        for overrides, want in chosen:
            e = registry.open_engine("efa", efa_provider=provider, **overrides)
            try:
                assert (getattr(e, name), e.domains[0].details[name]) == (want, want), overrides
            finally:
                e.close()
        monkeypatch.setenv(variable, str(env))
        e = registry.open_engine("efa", efa_provider=provider)
        try:
            assert (getattr(e, name), e.domains[0].details[name]) == (env, env)
        finally:
            e.close()
        monkeypatch.delenv(variable)


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_control_messages_beyond_the_bounce_pool_all_arrive(provider: str) -> None:
    """Sends go through a pool of 64 registered bounce slots (FI_MR_LOCAL providers take no
    other buffer): a burst of 300 waits for free slots and loses nothing."""
    a = registry.open_engine("efa", efa_provider=provider)
    b = registry.open_engine("efa", efa_provider=provider)
    try:
        sends = [a.submit_send(b.address, i.to_bytes(2, "little") * 100) for i in range(300)]
        for t in sends:
            t.wait(20)
        got = sorted(int.from_bytes(b.recv(timeout=20).data[:2], "little") for _ in range(300))
        assert got == list(range(300))
    finally:
        a.close()
        b.close()


def test_loading_libfabric_keeps_pythons_ctrl_c_and_crash_handlers() -> None:
    """Debian's libfabric pulls in PSM libraries whose constructors take over SIGINT (and the
    fatal signals) with a handler that exits with status 1: Ctrl-C must stay KeyboardInterrupt
    after importing the backend and opening an engine."""
    # Python's Ctrl-C handler, installed before loading whatever SIGINT disposition the test
    # runner was started with (a background job inherits SIGINT ignored, and Python then
    # installs no handler of its own)
    code = (
        "import faulthandler, os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "faulthandler.enable()\n"
        "from fabric_core import registry\n"
        "registry.open_engine('efa', efa_provider='shm').close()\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(10**7): pass\n"
        "except KeyboardInterrupt:\n    print('interrupted')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", (done.returncode, done.stderr)


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_a_process_that_never_closes_its_engines_exits_cleanly(provider: str) -> None:
    """Engines left open with work done: the process exits with its own status, not SIGABRT
    (a completion thread killed at finalization while waiting in C++ used to abort it)."""
    code = (
        "import os\n"
        "os.environ.setdefault('FI_TCP_IFACE', 'lo')\n"
        "import numpy as np\n"
        "from fabric_core import registry\n"
        f"a = registry.open_engine('efa', efa_provider={provider!r}, nics=2)\n"
        f"b = registry.open_engine('efa', efa_provider={provider!r}, nics=2)\n"
        "src, dst = np.arange(8192, dtype=np.uint8), np.zeros(8192, np.uint8)\n"
        "mr, desc = a.register(src), b.register(dst).descriptor\n"
        "a.submit_write(mr, 0, 8192, desc, 0, imm=1).wait(10)\n"
        "b.counter(1).wait(2, timeout=10)\n"
        "raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])


def test_an_shm_name_held_by_a_stale_segment_still_opens() -> None:
    """shm names an endpoint's segment after the pid (/dev/shm/<pid>:<uid>:<n>), and a process
    killed outright leaves its segments behind; once its pid comes round again, the segment
    found there names a process that may be alive, and the provider refuses the name (EBUSY).
    The engine then opens under a name of its own, and works both ways, control frames too.
    Staged here: the child finds copies of a live engine's segment under its own names."""
    live = registry.open_engine("efa", efa_provider="shm")
    try:
        segment = "/dev/shm/" + live.address.raw.rstrip(b"\0").decode().removeprefix("fi_shm://")
        code = (
            "import os, shutil, numpy as np\n"
            "from fabric_core import registry\n"
            "mine = [f'/dev/shm/{os.getpid()}:{os.getuid()}:{i}' for i in range(4)]\n"
            f"for m in mine: shutil.copyfile({segment!r}, m)\n"
            "try:\n"
            "    a = registry.open_engine('efa', efa_provider='shm')\n"
            "    b = registry.open_engine('efa', efa_provider='shm')\n"
            "    print(a.address.raw, b.address.raw)\n"
            "    x, y = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)\n"
            "    for w, t, src, dst, imm in ((a, b, x, y, 1), (b, a, y, x, 2)):\n"
            "        dst[:] = 0\n"
            "        mr, desc = w.register(src), t.register(dst).descriptor\n"
            "        tr = w.submit_write(mr, 0, 64, desc, 0, imm=imm)\n"
            "        t.counter(imm).wait(tr.imms_at_target, timeout=10)\n"
            "        tr.wait(10)\n"
            "        assert (dst == src).all()\n"
            "    b.submit_send(a.address, b'hello').wait(10)\n"
            "    assert a.recv(timeout=10).data == b'hello'\n"
            "    a.close(); b.close()\n"
            "finally:\n"
            "    for m in mine:\n"
            "        if os.path.exists(m): os.unlink(m)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert b"fabric-" in done.stdout.encode(), done.stdout
    finally:
        live.close()


# --- CUDA memory: whether the provider takes it is found out at open ------------------------
class _Core:
    def __init__(self, fails: bool) -> None:
        self.fails, self.calls = fails, []

    def register_memory(self, ptr: int, length: int, writable: bool) -> tuple[int, list[int]]:
        self.calls.append(("register", ptr, length, writable))
        if self.fails:
            raise RuntimeError("fi_mr_regattr(FI_HMEM_CUDA, cuda:0): Function not implemented")
        return 7, [1]

    def deregister(self, handle: int) -> None:
        self.calls.append(("deregister", handle))


def test_cuda_memory_is_claimed_only_where_a_device_registration_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import contextlib

    from fabric_core import cuda
    from fabric_efa import engine

    if not cuda.available():
        ok, why = engine._probe_cuda(_Core(False), True)
        assert not ok and "CUDA" in why
    monkeypatch.setattr(cuda, "available", lambda: True)
    assert engine._probe_cuda(_Core(False), False) == (False, "the provider has no FI_HMEM")
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "device_buffer", lambda n, device=0: contextlib.nullcontext(0xD000))
    core = _Core(True)
    ok, why = engine._probe_cuda(core, True)
    assert (
        not ok
        and why.startswith("this libfabric cannot register CUDA memory")
        and "Function not implemented" in why
    )
    core = _Core(False)
    assert engine._probe_cuda(core, True) == (True, "")
    assert core.calls == [("register", 0xD000, 4096, True), ("deregister", 7)]
    # carried over CUDA IPC by the engine itself: no FI_HMEM needed, the probe still decides
    assert engine._probe_cuda(_Core(False), False, True) == (True, "")
    assert not engine._probe_cuda(_Core(True), False, True)[0]


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_fabric_info_says_why_an_engine_carries_no_cuda_memory(provider: str) -> None:
    from fabric_core import cuda

    e = registry.open_engine("efa", efa_provider=provider)
    try:
        verdict = str(e.domains[0].details["cuda_memory"])
        assert verdict.startswith("yes") if e.capabilities.cuda_memory else verdict.startswith("no: ")
        if not cuda.available():
            assert not e.capabilities.cuda_memory
    finally:
        e.close()


def test_an_address_with_a_cuda_ipc_part_reaches_host_memory_from_an_engine_without_cuda_ipc() -> None:
    """On a GPU host, shm engines append a CUDA IPC part to their addresses (doorbell address
    and key, handle-table name, inner length, magic: fabric/cuda_ipc.hpp). An engine without
    CUDA IPC (no GPU, or efa_cuda_ipc off) strips it and reaches the host memory behind it
    through shm, exact bytes and exact counts."""
    import struct

    import numpy as np

    from fabric_core.models import DomainAddress, NicKey

    a = registry.open_engine("efa", efa_provider="shm", efa_cuda_ipc=False)
    b = registry.open_engine("efa", efa_provider="shm", efa_cuda_ipc=False)
    try:
        src = np.arange(8192, dtype=np.uint8)
        dst = np.zeros(8192, np.uint8)
        mr, desc = a.register(src), b.register(dst).descriptor
        inner = desc.nics[0].address.raw
        assert not inner.endswith(b"FABRIPC1")  # no IPC part without CUDA IPC
        part = struct.pack("<QQ32sH", 0x1000, 1 << 47, b"/fabric-ipc-1-00000000", len(inner)) + b"FABRIPC1"
        forged = desc.model_copy(
            update={"nics": (NicKey(address=DomainAddress(raw=inner + part), rkey=desc.nics[0].rkey),)}
        )
        a.submit_write(mr, 100, 5000, forged, 7, imm=5).wait(10)
        b.counter(5).wait(1, timeout=10)
        want = np.zeros(8192, np.uint8)
        want[7:5007] = src[100:5100]
        assert np.array_equal(dst, want)
        assert b.counter(5).value == 0
    finally:
        a.close()
        b.close()


def test_a_close_that_leaves_a_thread_in_the_provider_returns_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Python side of a wedged engine (the core's is proven on a fake NIC whose post never
    returns: tests/test_native_liveness.py, case 5): a cancel the core cannot make is a typed
    error. The core is asked to wait for its threads within what is left of close()'s
    timeout (at least 10 s), and when it reports a thread still inside the provider, close()
    returns anyway, the engine is closed, its registered regions are kept alive for good
    (the provider may still write there), and the log says what was left behind."""
    import logging

    import numpy as np

    from fabric_core import native

    engine = registry.open_engine("efa", efa_provider="shm")
    core = engine._core  # type: ignore[attr-defined]
    asked: list[float] = []

    class StuckCore:
        def __getattr__(self, name: str) -> object:
            return getattr(core, name)

        def close(self, join_timeout_s: float = -1.0) -> bool:
            asked.append(join_timeout_s)
            core.close(join_timeout_s)
            return False

        def cancel(self, id: int, timeout_s: float = -1.0) -> tuple[bool, list[bytes]]:
            raise RuntimeError("the engine's progress has been inside a provider call for 9 s")

    engine.register(np.zeros(4096, np.uint8))
    engine._core = StuckCore()  # type: ignore[attr-defined]
    stuck = Transfer((0,))
    with pytest.raises(TransportError, match="could not be cancelled") as info:
        engine._backend_cancel(stuck, 0.1)  # type: ignore[attr-defined]
    assert info.value.transfer_id == stuck.id
    with caplog.at_level(logging.ERROR, logger="fabric_core.native"):
        engine.close(timeout=3.0)
    assert engine.closed and len(asked) == 1 and asked[0] == 10.0  # at least 10 s
    kept = native._WEDGED.pop()  # type: ignore[attr-defined]
    assert isinstance(kept, tuple) and kept[0] is engine._core and [r.length for r in kept[1]] == [4096]
    assert any("stuck inside the provider" in r.getMessage() for r in caplog.records)
    assert core.close(0.1) is True and core.wedged() is False  # the real core left cleanly


def test_an_engine_whose_progress_stays_inside_one_provider_call_closes_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stall watchdog (``NativeEngine._watch``; the core's side, ``progress_since``, is
    proven on a fake NIC whose post never returns: tests/test_native_liveness.py, case 19).
    Here the core reports one step running for good, as a worker spinning on a dead peer's
    lock would. Within ``liveness_timeout_s`` (0.5 s) and a bounded margin the engine closes
    itself: a transfer, a counter wait and a ``recv`` in flight fail with ``EngineWedged`` (an
    ``EngineClosed``) saying why, a later submit raises it, the core is asked to wait only
    ``_WEDGE_JOIN_S`` for the stuck thread, the registrations are kept alive, the log says
    so, and the user's own ``close()`` returns at once."""
    import logging
    import threading
    import time

    import numpy as np

    from fabric_core import native
    from fabric_core.errors import EngineClosed, EngineWedged

    engine = registry.open_engine(
        "efa", efa_provider="shm", liveness_interval_s=0.1, liveness_timeout_s=0.5, timeout_s=30.0
    )
    core = engine._core  # type: ignore[attr-defined]
    asked: list[float] = []

    class StuckCore:
        def __getattr__(self, name: str) -> object:
            return getattr(core, name)

        def progress_since(self) -> int:
            return 12345  # one step, running all along

        def close(self, join_timeout_s: float = -1.0) -> bool:
            asked.append(join_timeout_s)
            core.close(join_timeout_s)
            return False

    src = np.arange(4096, dtype=np.uint8)
    region = engine.register(src)
    desc = region.descriptor
    counter = engine.counter(77)
    waited: list[BaseException] = []

    def wait_for_an_imm() -> None:
        try:
            counter.wait(1, timeout=20.0)
        except BaseException as exc:
            waited.append(exc)

    def wait_for_a_message() -> None:
        try:
            engine.recv(timeout=20.0)
        except BaseException as exc:
            waited.append(exc)

    try:
        with caplog.at_level(logging.ERROR, logger="fabric_core.native"):
            # a transfer the stuck step holds, made as the fast path makes them
            e: Any = engine
            in_flight = new_transfer((0,), e._dispatch, e._timeout, e._drain_hook, e._cancel_hook)
            e._inflight[in_flight.id] = in_flight
            waiters = [threading.Thread(target=f) for f in (wait_for_an_imm, wait_for_a_message)]
            for waiter in waiters:
                waiter.start()
            t0 = time.monotonic()
            engine._core = StuckCore()  # type: ignore[attr-defined]
            with pytest.raises(EngineWedged, match="closed itself") as failed:
                in_flight.wait(10.0)
            took = time.monotonic() - t0
            for waiter in waiters:
                waiter.join(10.0)
                assert not waiter.is_alive()
            assert 0.5 <= took < 5.0, took
            assert isinstance(failed.value, EngineClosed) and failed.value.stalled_s >= 0.5
            # the counter wait and the recv: both say why
            assert len(waited) == 2 and all(isinstance(e, EngineWedged) for e in waited), waited
            assert all("closed itself" in str(e) for e in waited), waited
            for _ in range(500):  # the close runs on a thread of its own
                if engine.closed:
                    break
                time.sleep(0.01)
            assert engine.closed and asked == [native._WEDGE_JOIN_S]  # type: ignore[attr-defined]
            with pytest.raises(EngineWedged, match="closed itself"):
                engine.submit_write(region, 0, 8, desc, 0, imm=5)
        kept = native._WEDGED.pop()  # type: ignore[attr-defined]
        assert isinstance(kept, tuple) and [r.length for r in kept[1]] == [4096]
        messages = [r.getMessage() for r in caplog.records]
        assert any("closed itself" in m for m in messages), messages
        t0 = time.monotonic()
        engine.close(timeout=5.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        engine.close()
        assert core.close(0.1) is True  # the real core left cleanly


def test_a_self_closed_engine_whose_stuck_thread_leaves_fails_the_cores_transfers_as_wedged() -> None:
    """The other ending of a self-close: the stuck thread leaves within ``_WEDGE_JOIN_S``, so
    the core fails the writes it still had under way itself ("engine closed with this
    transfer in flight"), through the completion thread. Those carry ``EngineWedged`` and the
    core's reason, not a bare ``EngineClosed``. The write here is posted to a stopped tcp
    target that cannot confirm it. The liveness limit (10 s) does not run out meanwhile; only
    the stall watch's limit is cut to 0.3 s, and the core reports one step running for good.
    Nothing is kept leaked: the core left cleanly."""
    import os
    import signal
    import time

    import numpy as np

    from fabric_core import native
    from fabric_core.errors import EngineWedged
    from fabric_core.testing.remote import RemoteEngine, WorkerPool, stop_process

    provider = "tcp;ofi_rxm"
    config = {"backend": "efa", "efa_provider": provider, "timeout_s": 30.0}
    settings = load_settings(**config, liveness_interval_s=0.2, liveness_timeout_s=10.0)
    if not EfaBackend.probe(settings).available:
        pytest.skip("tcp;ofi_rxm is not here")
    with WorkerPool(workers=0, arena_bytes=1 << 20) as pool:
        writer = EfaEngine(settings)
        worker = pool.add_worker()
        target = RemoteEngine(pool, worker, config)
        src, dst = pool.alloc(1 << 16), pool.alloc(1 << 16)
        src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)
        region, desc = writer.register(src), target.register(dst).descriptor
        core = writer._core  # type: ignore[attr-defined]
        asked: list[tuple[float, bool]] = []

        class StuckCore:
            def __getattr__(self, name: str) -> object:
                return getattr(core, name)

            def progress_since(self) -> int:
                return 6789

            def close(self, join_timeout_s: float = -1.0) -> bool:
                left = bool(core.close(join_timeout_s))
                asked.append((join_timeout_s, left))
                return left

        kept = len(native._WEDGED)  # type: ignore[attr-defined]
        stopped = False
        try:
            writer.submit_write(region, 0, 4096, desc, 0, imm=3).wait(30.0)  # connected
            stop_process(worker.pid)
            stopped = True
            doomed = writer.submit_write(region, 0, len(src), desc, 0, imm=4)
            deadline = time.monotonic() + 10.0
            while writer.stats().nics[0].inflight < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert writer.stats().nics[0].inflight >= 1, "the write was never posted"
            writer._stall_limit = 0.3  # type: ignore[attr-defined]
            t0 = time.monotonic()
            writer._core = StuckCore()  # type: ignore[attr-defined]
            with pytest.raises(EngineWedged) as failed:
                doomed.wait(10.0)
            assert time.monotonic() - t0 < 5.0
            message = str(failed.value)
            assert "engine closed with this transfer in flight" in message, message  # the core's
            assert "closed itself" in message and failed.value.stalled_s >= 0.3, message
            for _ in range(500):  # the close runs on a thread of its own, and may still be in it
                if asked:
                    break
                time.sleep(0.01)
            assert writer.closed and asked == [(native._WEDGE_JOIN_S, True)]  # type: ignore[attr-defined]
            assert len(native._WEDGED) == kept  # type: ignore[attr-defined]
        finally:
            if stopped:
                os.kill(worker.pid, signal.SIGCONT)
            writer.close()
            target.close()


def test_a_busy_or_idle_engine_does_not_close_itself() -> None:
    """The watchdog's control: an engine whose steps come and go (idle, or moving writes)
    stays open past several ``liveness_timeout_s``."""
    import time

    import numpy as np

    engine = registry.open_engine("efa", efa_provider="shm", liveness_interval_s=0.1, liveness_timeout_s=0.2)
    try:
        src = np.arange(1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        region = engine.register(src)
        desc = engine.register(dst).descriptor
        counter = engine.counter(9)
        end = time.monotonic() + 1.0
        writes = 0
        while time.monotonic() < end:
            engine.submit_write(region, 0, len(src), desc, 0, imm=9).wait(5.0)
            writes += 1
        counter.wait(writes, timeout=5.0)
        time.sleep(0.6)  # idle: three limits more
        assert not engine.closed and engine._wedge is None  # type: ignore[attr-defined]
        assert np.array_equal(dst, src)
    finally:
        engine.close()


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_closing_an_engine_while_other_threads_submit_to_it(provider: str) -> None:
    """``close()`` from one thread while two others submit small WriteImms (a submit that finds
    the worker napping posts from its own thread with the GIL released, so another thread
    can close and destroy the engine meanwhile: destroy() waits until no submit is inside
    it). Every submit goes through or raises ``EngineClosed``, every transfer ends, nothing
    crashes, over ten rounds with the close at a different moment each time."""
    import threading
    import time

    import numpy as np

    from fabric_core.errors import EngineClosed

    def submit(engine: Any, src: Any, desc: Any, stop: threading.Event, out: list[Any]) -> None:
        while not stop.is_set():
            try:
                out.append(engine.submit_write(src, 0, 8, desc, 0, imm=1))
            except EngineClosed:
                return
            except BaseException as exc:
                out.append(exc)  # reported below
                return
            if len(out) % 16 == 0:
                time.sleep(0.0002)  # let the worker nap now and then: inline posts

    for round_ in range(10):
        a = registry.open_engine("efa", efa_provider=provider)
        b = registry.open_engine("efa", efa_provider=provider)
        try:
            src = a.register(np.arange(64, dtype=np.uint8))
            desc = b.register(np.zeros(64, np.uint8)).descriptor
            stop = threading.Event()
            outs: list[list[Any]] = [[], []]
            threads = [threading.Thread(target=submit, args=(a, src, desc, stop, out)) for out in outs]
            for t in threads:
                t.start()
            time.sleep(0.005 * (round_ + 1))
            a.close(timeout=2.0)
            stop.set()
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads)
            got = [x for out in outs for x in out]
            assert not [x for x in got if isinstance(x, BaseException)]
            for transfer in got:  # each ended: done, or failed because the engine closed
                failed = transfer.exception(5)
                assert failed is None or isinstance(failed, EngineClosed), failed
        finally:
            a.close()
            b.close()


def test_opening_an_shm_engine_removes_the_regions_of_dead_processes_only() -> None:
    """shm leaves a killed process's 16 MiB regions in /dev/shm for good; opening an shm
    engine removes those whose process is gone (both of shm's names: ``pid:uid:n`` and the
    ``fabric-pid-nonce-nic`` this backend gives an endpoint itself, and the region table of
    each, ``fabric-acl.<name>``), and nothing else; a live engine's table is there while it
    is open and gone once it is closed."""
    dead_proc = subprocess.Popen(["true"])
    dead_proc.wait()
    live_proc = subprocess.Popen(["sleep", "30"])
    dead, live = dead_proc.pid, live_proc.pid
    shm = Path("/dev/shm")
    gone = [
        shm / f"{dead}:0:0",
        shm / f"fabric-{dead}-00c0ffee12345678-1",
        shm / f"fabric-acl.{dead}:0:0",
        shm / f"fabric-acl.fabric-{dead}-00c0ffee12345678-1",
    ]
    kept = [
        shm / f"{live}:0:0",
        shm / f"fabric-{live}-00c0ffee12345678-0",
        shm / f"fabric-acl.{live}:0:0",
        shm / f"{dead}:x:0",
        shm / f"{dead}-note",
        shm / f"fabric-acl.{dead}-note",
    ]
    try:
        for f in gone + kept:
            f.write_bytes(b"region")
        engine = registry.open_engine("efa", efa_provider="shm")
        name = engine.address.raw.split(b"\0")[0].decode().removeprefix("fi_shm://")
        table = shm / f"fabric-acl.{name}"
        assert table.exists()
        engine.close()
        assert not table.exists()
        assert [f for f in gone if f.exists()] == []
        assert [f for f in kept if not f.exists()] == []
    finally:
        live_proc.kill()
        live_proc.wait()
        for f in gone + kept:
            f.unlink(missing_ok=True)


@contextlib.contextmanager
def _connected(provider: str, nbytes: int = 4096) -> Iterator[tuple[Any, Any, Any, Any, Any, Any]]:
    """Engines a and b on ``provider``, a's ``src`` (bytes 0, 1, ..., 255, 0, ...) and b's zeroed
    ``dst`` of ``nbytes`` registered, and a connected to b by a 64-byte write with imm 1 at
    offset 0: (a, b, src, dst, src_mr, dst descriptor). Both engines are closed on leaving."""
    import numpy as np

    a = registry.open_engine("efa", efa_provider=provider)
    b = registry.open_engine("efa", efa_provider=provider)
    try:
        src = (np.arange(nbytes) % 256).astype(np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        src_mr, d = a.register(src), b.register(dst).descriptor
        a.submit_write(src_mr, 0, 64, d, 0, imm=1).wait(10)
        yield a, b, src, dst, src_mr, d
    finally:
        a.close()
        b.close()


def test_dump_state_lists_an_access_check_while_it_is_out() -> None:
    """Over tcp a refused write comes back cancelled with its connection, and the engine asks
    the target why (an access check, docs/concepts/security.md). While the question is out,
    ``dump_state()["access_checks"]`` lists it: the target, the NIC, the key and the writes
    held on it; once answered, the write fails with ``RemoteAccessError`` and the list is empty.
    (The question leaves 20 ms after the cancel, so polling the dump every millisecond meets it.)
    The write is larger than ``efa_eager_max``: an eager write's refusal comes back in its
    acknowledgement instead (test_eager_writes.py)."""
    import time

    from fabric_core.errors import RemoteAccessError

    with _connected("tcp;ofi_rxm", 8192) as (a, b, _src, dst, src_mr, d):
        key = d.nics[0].rkey ^ 0x5A5A_0000
        forged = d.model_copy(update={"nics": (d.nics[0].model_copy(update={"rkey": key}),)})
        t = a.submit_write(src_mr, 0, 4097 + 64, forged, 0, imm=2, timeout=10)
        seen: list[dict[str, Any]] = []
        end = time.monotonic() + 5
        while not seen and not t.done() and time.monotonic() < end:
            seen = a.dump_state()["access_checks"]
            time.sleep(0.001)
        assert isinstance(t.exception(10), RemoteAccessError)
        assert seen, "the access check never showed in the dump"
        (check,) = seen
        assert check["peer"] == b.address.raw.hex() and check["nic"] == 0 and check["key"] == key
        assert check["writes_held"] == 1 and check["age_s"] >= 0
        assert a.dump_state()["access_checks"] == []
        assert a.dump_state()["counter_spinners"] == 0  # no thread waits on a counter of a's
        assert (dst[64:] == 0).all() and b.counter(2).value == 0


def test_a_tcp_target_counts_the_polls_that_read_a_write_as_work() -> None:
    """Over tcp the target's provider reads a write's bytes off its socket in the target's
    polls, and only the last of them completes anything. The worker counts such polls as work
    (``dump_state()["provider_steps"]``) instead of napping between them (``liveness.cpp``
    case 16 holds the rule with a fake NIC). Here, through the binding and the real provider:
    four 16 MiB writes land whole, their imms counted, and the target counted such steps."""
    size = 16 << 20
    with _connected("tcp;ofi_rxm", size) as (a, b, src, dst, src_mr, d):
        before = b.dump_state()["provider_steps"]
        for _ in range(4):
            a.submit_write(src_mr, 0, size, d, 0, imm=2).wait(30)
        b.counter(2).wait(4, 10)
        assert (dst == src).all()
        assert b.dump_state()["provider_steps"] > before


def test_a_shm_target_counts_its_yields_and_paged_writes_land_exactly() -> None:
    """On shm the target's own polls copy the writes to it (the domain's ``target_copies``), so
    its idle worker polls on for a few microseconds after work while its yields find no other
    thread waiting for the CPU (docs/backends/efa.md, "An idle shm target lingers"). Through
    the binding: three paged writes of 1,024 pages of 4 KiB to a shuffled page order land byte
    for byte with every page's imm counted, and the target's dump counts its yields
    (``worker_yields``) and, of them, the ones no other thread took the CPU in
    (``lone_yields``)."""
    import time

    import numpy as np

    pages, page = 1024, 4096
    with _connected("shm", pages * page) as (a, b, src, dst, src_mr, d):
        before = b.dump_state()
        order = np.random.default_rng(5).permutation(pages).astype(np.int64)
        start = np.arange(pages, dtype=np.int64)
        for _ in range(3):
            a.submit_paged_write(src_mr, start, page, d, order, page, page, imm=7).wait(30)
        b.counter(7).wait(3 * pages, 10)  # (consumes them)
        time.sleep(0.01)  # the target's worker, idle now, yields before it naps
        after = b.dump_state()
        assert (dst.reshape(pages, page)[order] == src.reshape(pages, page)).all()
        assert b.counter(7).value == 0  # not one imm more
        yields = after["worker_yields"] - before["worker_yields"]
        assert yields > 0 and 0 <= after["lone_yields"] - before["lone_yields"] <= yields


def test_progress_goes_back_to_the_worker_after_a_spinning_wait() -> None:
    """While a thread spins in ``ImmCounter.wait`` it runs the engine's progress steps and the
    worker steps aside; the last spinner to stop hands progress back where it must
    (``liveness.cpp`` case 15 holds the rules, with a spin long enough to watch). Here, through
    the binding: a wait still unsatisfied when its spin ends hands it back as it goes to sleep
    (``spinner_wakes`` counts it); a waiter that spins and is satisfied gets its imm and its
    bytes; and after it, with no thread waiting, the worker alone counts the next imm."""
    import threading
    import time

    from fabric_core.errors import TransferTimeout

    with _connected("shm") as (a, b, src, dst, src_mr, d):
        b.counter(1).wait(1, 10)
        state = b.dump_state()
        assert state["counter_spinners"] == 0 and state["worker_deferring"] in (True, False)
        wakes = state["spinner_wakes"]
        for _ in range(5):  # (a spin starts unless the thread is preempted for 200 us first)
            with pytest.raises(TransferTimeout):  # the spin ends (200 us), the wait sleeps
                b.counter(2).wait(1, 0.02)
            if b.dump_state()["spinner_wakes"] > wakes:
                break
        assert b.dump_state()["spinner_wakes"] == wakes + 1

        outcome: list[BaseException | None] = []

        def wait_for_three() -> None:
            try:
                b.counter(3).wait(1, 10)
                outcome.append(None)
            except BaseException as exc:  # (asserted below)
                outcome.append(exc)

        waiter = threading.Thread(target=wait_for_three)
        waiter.start()
        a.submit_write(src_mr, 0, 64, d, 64, imm=3).wait(10)
        waiter.join(10)
        assert outcome == [None]
        assert (dst[64:128] == src[:64]).all()

        # nobody waits now: the worker polls the next imm itself
        a.submit_write(src_mr, 0, 64, d, 128, imm=4).wait(10)
        end = time.monotonic() + 5
        while b.counter(4).value == 0 and time.monotonic() < end:
            time.sleep(0.001)
        assert b.counter(4).value == 1 and (dst[128:192] == src[:64]).all()
        assert b.dump_state()["counter_spinners"] == 0


@pytest.mark.parametrize(("provider", "long_drains"), [("shm", False), ("tcp;ofi_rxm", True)])
def test_a_wait_on_a_long_paged_transfer_drains_only_where_the_peer_is_not_on_this_cpu(
    provider: str, long_drains: bool
) -> None:
    """A thread waiting on a paged transfer of host memory drains it (runs the engine's progress
    and takes the completions itself) unless the transfer is long and the provider is shm, where
    the peer's own progress copies the bytes on this host and a spinning waiter takes its CPU
    (``fabric_efa.engine._DRAIN_MAX_PAGES``): on shm, no thread drains while a 1,024-page
    transfer is waited on, and a 16-page one still drains; over tcp both drain. Every page
    lands either way."""
    import threading

    import numpy as np

    pages, page = 1024, 4096
    with _connected(provider, pages * page) as (a, b, src, dst, src_mr, d):
        order = np.random.default_rng(3).permutation(pages)
        short = a.submit_paged_write(src_mr, np.arange(16), page, d, np.arange(16), page, page, imm=2)
        assert short._drain is not None
        short.wait(10)

        drainers: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                drainers.append(int(a.dump_state()["drainers"]))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            long = a.submit_paged_write(src_mr, np.arange(pages), page, d, order, page, page, imm=3)
            assert (long._drain is not None) == long_drains
            long.wait(30)
        finally:
            stop.set()
            watcher.join(10)
        if not long_drains:
            assert drainers and max(drainers) == 0
        expected = src.reshape(pages, page)
        assert (dst.reshape(pages, page)[order] == expected).all()
        assert b.counter(3).wait(pages, 10) is None


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_strict_local_registration_tells_every_wrong_descriptor(provider: str) -> None:
    """``efa_strict_mr`` checks each buffer handed to the provider against the endpoint's own
    registrations, as the efa provider's FI_MR_LOCAL wants them: a buffer inside a
    registration passes; no descriptor, another endpoint's registration, a buffer one byte
    past the end, and a registration closed since are each told apart. In a post, any of them
    aborts the process with the reason on stderr."""
    from fabric_efa import _efa

    probe = EfaBackend.probe(load_settings(efa_provider=provider))
    if not probe.available:
        pytest.skip(probe.reason)
    assert _efa._strict_mr_selftest(provider) == [
        "",
        "no descriptor",
        "a descriptor that is no registration of this endpoint",
        "a buffer its descriptor's registration does not cover",
        "the descriptor of a registration closed since",
    ]
    code = (
        "from fabric_efa import _efa\n"
        f"_efa._strict_mr_selftest({provider!r}, then_abort=True)\n"
        "print('alive')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode < 0 and "alive" not in done.stdout
    assert "fabric-efa (strict_mr): a send of 8 bytes at" in done.stderr
    assert "on endpoint 0 names no descriptor" in done.stderr


@pytest.mark.parametrize("provider", ["shm", "tcp;ofi_rxm"])
def test_a_strict_engine_moves_writes_imms_and_messages_with_every_buffer_registered(provider: str) -> None:
    """With ``efa_strict_mr`` the endpoints take FI_MR_LOCAL's path (every buffer registered and
    named by its descriptor, checked at each post), and ``fabric info``'s details say so:
    writes of several sizes, imm-only writes (whose zero-length buffer the endpoint registers
    itself), a paged write and control messages all go through, on two NICs, byte-exact."""
    import numpy as np

    probe = EfaBackend.probe(load_settings(efa_provider=provider))
    if not probe.available:
        pytest.skip(probe.reason)
    settings = load_settings(backend="efa", efa_provider=provider, nics=2, efa_strict_mr=True, timeout_s=20)
    with EfaEngine(settings) as a, EfaEngine(settings) as b:
        assert a.provider_info["strict_mr"] is True
        assert [d.details["strict_mr"] for d in a.domains] == [True, True]
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        pages = np.zeros(8 * 4096, dtype=np.uint8)
        mine, theirs, paged = a.register(src), b.register(dst), b.register(pages)
        imms = 0
        for size in (0, 8, 4096, 65536, 1 << 20):
            if size:
                t = a.submit_write(mine, 0, size, theirs.descriptor, 0, imm=7)
            else:
                t = a.submit_imm(theirs.descriptor, 7)
            t.wait(20)
            imms += t.imms_at_target
        t = a.submit_paged_write(mine, [1, 3, 5], 4096, paged.descriptor, [0, 2, 4], 4096, 4096, imm=7)
        t.wait(20)
        imms += t.imms_at_target
        b.counter(7).wait(imms, 20)
        assert bytes(dst) == bytes(src)

        def page(buf: Any, i: int) -> bytes:
            return bytes(buf[i * 4096 : (i + 1) * 4096])

        for s_page, d_page in ((1, 0), (3, 2), (5, 4)):
            assert page(pages, d_page) == page(src, s_page)
        assert not pages[4096:8192].any() and not pages[6 * 4096 :].any()
        a.submit_send(b.address, b"strict hello").wait(20)
        assert b.recv(timeout=20).data == b"strict hello"


def test_each_nic_opens_the_domain_the_settings_name_or_the_providers_pci_nics_in_turn() -> None:
    """``efa_domains`` names the provider's domain of each NIC (NIC i on name i mod count);
    a name the provider does not list is a ConfigError that lists those it does. Unset: where
    the provider lists several domains on PCI devices (efa: an EFA device each), NIC i opens
    the i-th of those closest to the engine's GPU (its topology group) where there is one, else
    of all of them; with one or none ("" for each NIC) every NIC opens the provider's first,
    as shm and tcp's emulated NICs do."""
    from fabric_core.errors import ConfigError
    from fabric_efa.engine import nic_domains

    def dom(name: str, pci: str = "") -> dict[str, Any]:
        return {"name": name, "fabric": "efa", "pci": pci, "device": "", "speed_bps": 0}

    efa = [dom(f"rdmap{i}s0-rdm", f"0000:{0x10 + i:02x}:00.0") for i in range(4)]
    assert nic_domains(efa, 2, None, "efa") == ["rdmap0s0-rdm", "rdmap1s0-rdm"]
    assert nic_domains(efa, 6, None, "efa") == [f"rdmap{i % 4}s0-rdm" for i in range(6)]
    assert nic_domains(efa, 3, " rdmap2s0-rdm ,rdmap3s0-rdm", "efa") == [
        "rdmap2s0-rdm",
        "rdmap3s0-rdm",
        "rdmap2s0-rdm",
    ]
    # an engine on a GPU: the domains of its topology group, in turn
    assert nic_domains(efa, 4, None, "efa", near=["rdmap2s0-rdm", "rdmap3s0-rdm"]) == [
        "rdmap2s0-rdm",
        "rdmap3s0-rdm",
        "rdmap2s0-rdm",
        "rdmap3s0-rdm",
    ]
    assert nic_domains(efa, 2, None, "efa", near=["gone"]) == ["rdmap0s0-rdm", "rdmap1s0-rdm"]
    assert nic_domains(efa, 1, "rdmap3s0-rdm", "efa", near=["rdmap2s0-rdm"]) == ["rdmap3s0-rdm"]
    assert nic_domains([dom("lo"), dom("eth0")], 2, None, "tcp;ofi_rxm") == ["", ""]
    assert nic_domains([dom("x", "0000:01:00.0")], 2, None, "efa") == ["", ""]
    assert nic_domains([dom("lo"), dom("eth0")], 2, "eth0", "tcp;ofi_rxm") == ["eth0", "eth0"]
    with pytest.raises(
        ConfigError, match=r"names nope, which provider 'efa' does not offer here \(it has: rdmap0"
    ):
        nic_domains(efa, 2, "rdmap0s0-rdm,nope", "efa")
    with pytest.raises(ConfigError, match="names no domain"):
        nic_domains(efa, 2, " , ", "efa")


def test_an_engine_opens_its_nics_on_the_named_domain_and_refuses_one_not_there() -> None:
    """On tcp pinned to loopback (FI_TCP_IFACE=lo) the provider lists one domain, ``lo``: NICs
    named so open there and say so; naming ``eth0`` is a ConfigError that lists ``lo``, and
    opens nothing. ``list_domains`` gives each domain once, with its fabric."""
    from fabric_core.errors import ConfigError
    from fabric_efa import _efa

    provider = "tcp;ofi_rxm"
    if not EfaBackend.probe(load_settings(efa_provider=provider)).available:
        pytest.skip("no tcp;ofi_rxm")
    assert _efa.list_domains(provider) == [
        {"name": "lo", "fabric": "127.0.0.1/32", "pci": "", "device": "", "speed_bps": 0}
    ]
    with registry.open_engine("efa", efa_provider=provider, nics=2, efa_domains="lo") as engine:
        assert [d.name for d in engine.domains] == ["lo#0", "lo#1"]
    with pytest.raises(
        ConfigError, match=r"names eth0, which provider 'tcp;ofi_rxm' does not offer here \(it has: lo\)"
    ):
        registry.open_engine("efa", efa_provider=provider, efa_domains="eth0")


def test_the_topology_is_the_engines_nics_unless_efa_topology_names_the_groups() -> None:
    """Where the provider's domains are no PCI devices (tcp here), ``detect_topology`` gives
    one host group holding the engine's NICs; ``efa_topology`` names the groups instead, by
    domain, and a name the provider does not list is a ConfigError naming the setting."""
    from fabric_core.errors import ConfigError
    from fabric_core.models import Device

    provider = "tcp;ofi_rxm"
    if not EfaBackend.probe(load_settings(efa_provider=provider)).available:
        pytest.skip("no tcp;ofi_rxm")
    (group,) = registry.detect_topology("efa", efa_provider=provider, nics=2)
    assert group.device == Device() and [d.name for d in group.domains] == ["lo#0", "lo#1"]
    (group,) = registry.detect_topology("efa", efa_provider=provider, efa_topology="cuda:1=lo")
    assert group.device == Device(kind="cuda", index=1)
    assert [(d.name, d.details["fabric"]) for d in group.domains] == [("lo", "127.0.0.1/32")]
    with pytest.raises(
        ConfigError, match="FABRIC_EFA_TOPOLOGY names eth0, which is not a domain of provider"
    ):
        registry.detect_topology("efa", efa_provider=provider, efa_topology="cpu=eth0")


def _pci_domains() -> list[dict[str, Any]]:
    """Four EFA-like domains on PCI functions 0000:1{0..3}:00.0, as list_domains gives them."""
    return [
        {
            "name": f"rdmap{i}s0-rdm",
            "fabric": "efa",
            "pci": f"0000:1{i}:00.0",
            "device": f"efa_{i}",
            "speed_bps": 10**11,
        }
        for i in range(4)
    ]


def test_an_engine_on_a_gpu_takes_the_pci_domains_behind_its_own_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a made-up host (sysfs): GPU 0 with rdmap0 and rdmap1 behind its PCIe switch, GPU 1
    with rdmap2 and rdmap3 behind its own. An engine whose CUDA device is 1 takes rdmap2 and
    rdmap3; without a GPU, none is nearer (all four, in turn)."""
    from fabric_core import cuda
    from fabric_efa.engine import _near_gpu

    devices = tmp_path / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    tree = {  # function: (its path from the host bridge, vendor, class, NUMA node)
        "0000:03:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", "0x10de", "0x030200", 0),
        "0000:10:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", "0x1d0f", "0x020000", 0),
        "0000:11:00.0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0", "0x1d0f", "0x020000", 0),
        "0000:83:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0", "0x10de", "0x030200", 1),
        "0000:12:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0", "0x1d0f", "0x020000", 1),
        "0000:13:00.0": ("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:02.0", "0x1d0f", "0x020000", 1),
    }
    for bdf, (path, vendor, cls, node) in tree.items():
        real = tmp_path / "devices" / path / bdf
        real.mkdir(parents=True)
        (real / "vendor").write_text(vendor + "\n")
        (real / "class").write_text(cls + "\n")
        (real / "numa_node").write_text(f"{node}\n")
        (devices / bdf).symlink_to(real)
    listed = _pci_domains()
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _near_gpu(listed, "efa", str(tmp_path)) == ["rdmap2s0-rdm", "rdmap3s0-rdm"]
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    assert _near_gpu(listed, "efa", str(tmp_path)) == ["rdmap0s0-rdm", "rdmap1s0-rdm"]
    assert _near_gpu(listed[:1], "efa", str(tmp_path)) == []  # one PCI domain: nothing to pick
    monkeypatch.setattr(cuda, "available", lambda: False)
    assert _near_gpu(listed, "efa", str(tmp_path)) == []


def test_pci_domains_make_the_topology_a_group_of_all_of_them_on_a_host_without_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the provider lists PCI domains (made up here), detect_topology groups those
    rather than the engine's NICs: on a host without GPUs, one host group with all four, each
    with its PCI function, link speed and device."""
    from fabric_core import cuda
    from fabric_core.models import Device
    from fabric_efa import _efa

    if not EfaBackend.probe(load_settings(efa_provider="shm")).available:
        pytest.skip("no shm")
    shm = {"name": "shm", "fabric": "shm", "pci": "", "device": "", "speed_bps": 0}
    monkeypatch.setattr(_efa, "list_domains", lambda provider: [shm, *_pci_domains()])
    monkeypatch.setattr(cuda, "available", lambda: False)
    # (the engine detect_topology opens must open a domain shm has)
    (group,) = registry.detect_topology("efa", efa_provider="shm", efa_domains="shm")
    assert group.device == Device()
    assert [(d.name, d.pci_bus_id, d.link_speed_gbps, d.details["device"]) for d in group.domains] == [
        (f"rdmap{i}s0-rdm", f"0000:1{i}:00.0", 100.0, f"efa_{i}") for i in range(4)
    ]


def test_the_endpoint_refuses_a_domain_its_provider_does_not_list_and_names_those_it_does() -> None:
    """Below the settings' check, the compiled endpoint keeps only the fi_getinfo entry of the
    domain it is given: one the provider does not list is an error naming the ones it does
    (RuntimeError, which EfaEngine turns into BackendUnavailable), and no engine opens."""
    from fabric_efa import _efa

    if not EfaBackend.probe(load_settings(efa_provider="shm")).available:
        pytest.skip("no shm")
    with pytest.raises(RuntimeError, match=r"no domain 'nope' on provider shm \(it has: shm\)"):
        _efa.Engine("shm", 2, None, -1, 8, 4096, [], False, -1, True, False, ["shm", "nope"])
    core = _efa.Engine("shm", 1, None, -1, 8, 4096, [], False, -1, True, False, ["shm"])
    core.close()
