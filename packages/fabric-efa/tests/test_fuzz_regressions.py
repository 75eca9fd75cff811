"""Findings of the coverage-guided fuzzer (tests/fuzz/fuzz_descriptors.py --native) in the
efa engine's handling of peer bytes, kept as regression tests.

Each case runs in a child process: what it guards against is a crash of the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fabric_core.settings import load_settings
from fabric_efa import EfaBackend

FORGED_WRITE = """
import sys
import numpy as np
from fabric_core.errors import ConfigError, TransportError
from fabric_core.models import DomainAddress, NicKey
from fabric_core.settings import load_settings
from fabric_efa.engine import EfaEngine

settings = load_settings(backend="efa", efa_provider="shm", nics=1, timeout_s=5)
a, b = EfaEngine(settings), EfaEngine(settings)
src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
src_mr, dst_mr = a.register(src), b.register(dst)
for i, deadline in enumerate((0.1, 0.2, 0.3, 0.2, 0.3, 0.4, 0.25, 0.15)):  # the crash is timing dependent
    forged = dst_mr.descriptor.model_copy(
        update={"nics": (NicKey(address=DomainAddress(raw=bytes.fromhex(sys.argv[1])), rkey=i),)}
    )
    try:
        a.submit_imm(forged, 9, timeout=deadline).wait(5)
    except (ConfigError, TransportError) as exc:
        print("refused:", type(exc).__name__)
t = a.submit_write(src_mr, 0, 64, dst_mr.descriptor, 0, imm=1)
b.counter(1).wait(t.imms_at_target, timeout=10)
assert (dst == src).all()
a.close(timeout=5)
b.close(timeout=5)
print("usable")
"""


def _shm() -> None:
    probe = EfaBackend.probe(load_settings(efa_provider="shm"))
    if not probe.available:
        pytest.skip(probe.reason)


def _forged_write(address: bytes) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FI_TCP_IFACE": "lo"}
    return subprocess.run(
        [sys.executable, "-c", FORGED_WRITE, address.hex()],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    "address", [b"abc", b"fi_shm://1:0", bytes(range(1, 40))], ids=["short", "name", "bytes"]
)
def test_write_to_forged_shm_address_fails_typed_and_engine_stays_usable(address: bytes) -> None:
    _shm()
    done = _forged_write(address)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usable" in done.stdout


# A write to a forged shm address whose name is empty (first byte NUL) killed the process with
# SIGSEGV in libfabric's shm provider (pthread_spin_lock under fi_writemsg on the engine's worker
# thread); LibfabricDomain::insert_peer now refuses such addresses.
@pytest.mark.parametrize("address", [b"\0", bytes(8), b"\0fi_shm://1:0"], ids=["nul", "zeros", "nul-name"])
def test_write_to_forged_shm_address_with_empty_name_does_not_crash(address: bytes) -> None:
    _shm()
    done = _forged_write(address)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "usable" in done.stdout
