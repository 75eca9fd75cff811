# ruff: noqa: PT017  (the targets check the message of the error they expect)
"""Coverage-guided fuzzing (atheris, libFuzzer) of what parses bytes from peers and users.

Targets, chosen by the first byte of an input:

0. ``MemoryRegionDescriptor.from_bytes``: returns a descriptor whose ``to_bytes()`` is the
   input, or raises ``ConfigError`` naming the descriptor.
1. ``MemoryRegionDescriptor.from_json``: the same, for the JSON form.
2. ``DomainAddress.from_hex``: a round-tripping address or ``ConfigError``.
3. ``Device.parse`` (``register_ptr``'s device strings): a ``Device`` or ``ConfigError``.
4. ``memory.index_array`` over the input's integers in a few dtypes: an int64 array or
   ``ConfigError``.
5. (``--native``) the efa engine on libfabric's ``shm`` provider, given a descriptor whose NIC
   address is the input (forged: the C++ core inserts it into the address vector,
   ``LibfabricDomain::insert_peer``): the imm write either refuses it with ``ConfigError``, or
   completes, or fails with a ``TransportError``; the engine stays usable.
6. (``--native``) the same with a two-sided send to a forged ``DomainAddress``.

Anything else (another exception, a hang, a crash of the process) is a finding: libFuzzer
writes the input to ``--artifacts`` (``crash-<sha1>``) and the run exits non-zero. Keep such
inputs in ``tests/fuzz/crashes/``: ``tests/test_fuzz_corpus.py`` replays them with the corpus
(native findings in ``tests/fuzz/native-crashes/``, each with a test in
``packages/fabric-efa/tests/test_fuzz_regressions.py``).

    python tests/fuzz/fuzz_descriptors.py [--seconds 60] [--native] [--update-corpus]

New interesting inputs go to a scratch directory; ``--update-corpus`` adds them to
``tests/fuzz/corpus/`` (smallest first, at most ``MAX_CORPUS`` files in all).
``--seed-corpus`` (re)writes the hand-made seeds. Exit status: 0, or non-zero when libFuzzer
found something (crash, timeout, leak, out of memory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
CRASHES = HERE / "crashes"
MAX_LEN = 512
PYTHON_TARGETS = 5
NATIVE_TARGETS = 7


# --- the checks (also imported by tests/test_fuzz_corpus.py, without atheris) ----------
def check_descriptor_bytes(data: bytes) -> None:
    from fabric_core.errors import ConfigError
    from fabric_core.models import MemoryRegionDescriptor

    try:
        d = MemoryRegionDescriptor.from_bytes(data)
    except ConfigError as exc:
        assert str(exc).startswith("MemoryRegionDescriptor: "), exc
        return
    assert d.to_bytes() == data, "accepted bytes do not round-trip"
    assert MemoryRegionDescriptor.from_json(d.model_dump_json()) == d


def check_descriptor_json(data: bytes) -> None:
    from fabric_core.errors import ConfigError
    from fabric_core.models import MemoryRegionDescriptor

    try:
        d = MemoryRegionDescriptor.from_json(data)
    except ConfigError as exc:
        assert str(exc).startswith("MemoryRegionDescriptor JSON: "), exc
        return
    assert MemoryRegionDescriptor.from_bytes(d.to_bytes()) == d
    assert MemoryRegionDescriptor.from_json(d.model_dump_json()) == d


def check_address_hex(data: bytes) -> None:
    from fabric_core.errors import ConfigError
    from fabric_core.models import DomainAddress

    text = data.decode("latin-1")
    try:
        a = DomainAddress.from_hex(text)
    except ConfigError as exc:
        assert "DomainAddress" in str(exc), exc
        return
    assert a.raw == bytes.fromhex(text) and DomainAddress.from_hex(str(a)) == a


def check_device(data: bytes) -> None:
    from fabric_core.errors import ConfigError
    from fabric_core.models import Device

    text = data.decode("utf-8", "replace")
    try:
        d = Device.parse(text)
    except ConfigError as exc:
        assert "unknown device" in str(exc), exc
        return
    assert Device.parse(str(d)) == d
    assert re.fullmatch(r"cpu|cuda(:[0-9]+)?", text, re.ASCII), f"accepted {text!r}"
    assert d.kind == "cpu" or d.index == int(text.partition(":")[2] or 0)


def check_index_array(data: bytes) -> None:
    import numpy as np

    from fabric_core.errors import ConfigError
    from fabric_core.memory import index_array

    if not data:
        return
    kind, body = data[0] % 6, data[1:]
    obj: Any
    if kind == 0:
        obj = np.frombuffer(body[: len(body) // 8 * 8], dtype=np.int64)
    elif kind == 1:
        obj = np.frombuffer(body[: len(body) // 8 * 8], dtype=np.uint64)
    elif kind == 2:
        obj = np.frombuffer(body[: len(body) // 8 * 8], dtype=np.float64)
    elif kind == 3:  # a Python list of big and small ints, sometimes nested
        obj = [int.from_bytes(body[i : i + 9], "little", signed=True) for i in range(0, len(body), 9)]
        if obj and obj[0] % 5 == 0:
            obj = [obj[:1], obj[1:]]
    elif kind == 4:
        obj = body.decode("latin-1")
    else:
        obj = np.frombuffer(body[: len(body) // 2 * 2], dtype=np.int16).reshape(-1, 1)
    try:
        out = index_array(obj, "pages")
    except ConfigError as exc:
        assert str(exc).startswith("pages "), exc
        return
    assert out.dtype == np.int64 and out.ndim == 1


PYTHON_CHECKS = (
    check_descriptor_bytes,
    check_descriptor_json,
    check_address_hex,
    check_device,
    check_index_array,
)


def check(data: bytes) -> None:
    """One input through the Python target it selects (the replay test's entry point)."""
    if data:
        PYTHON_CHECKS[data[0] % PYTHON_TARGETS](data[1:])


# --- native targets: an efa engine on shm --------------------------------------------
class NativeWorld:
    """A writer and a target on libfabric's shm provider, in this process."""

    def __init__(self) -> None:
        import numpy as np

        from fabric_core.settings import load_settings
        from fabric_efa.engine import EfaEngine

        settings = load_settings(backend="efa", efa_provider="shm", nics=1, timeout_s=5)
        self.a, self.b = EfaEngine(settings), EfaEngine(settings)
        self.src = np.arange(256, dtype=np.uint8)
        self.dst = np.zeros(256, dtype=np.uint8)
        self.src_mr, self.dst_mr = self.a.register(self.src), self.b.register(self.dst)
        self.runs = 0

    def forged_write(self, data: bytes) -> None:
        from fabric_core.errors import ConfigError, TransportError
        from fabric_core.models import DomainAddress, NicKey

        if not data:
            return
        rkey = int.from_bytes(data[:8].ljust(8, b"\0"), "little")
        address = data[8 : 8 + 255] or b"\0"
        desc = self.dst_mr.descriptor.model_copy(
            update={"nics": (NicKey(address=DomainAddress(raw=address), rkey=rkey),)}
        )
        try:
            t = self.a.submit_imm(desc, 9, timeout=0.2)
        except ConfigError:
            return
        try:
            t.wait(5.0)
        except TransportError:
            pass
        self.still_usable()

    def forged_send(self, data: bytes) -> None:
        from fabric_core.errors import TransportError
        from fabric_core.models import DomainAddress

        address = data[:255] or b"\0"
        t = self.a.submit_send(DomainAddress(raw=address), data[255:] or b"x", timeout=0.2)
        try:
            t.wait(5.0)
        except TransportError:
            pass
        self.still_usable()

    def still_usable(self) -> None:
        self.runs += 1
        if self.runs % 16:
            return
        self.dst[:] = 0
        t = self.a.submit_write(self.src_mr, 0, 256, self.dst_mr.descriptor, 0, imm=1)
        self.b.counter(1).wait(t.imms_at_target, timeout=10)
        assert (self.dst == self.src).all(), "a valid write after forged ones did not land"

    def close(self) -> None:
        self.a.close(timeout=5)
        self.b.close(timeout=5)


_native: NativeWorld | None = None


def check_native(data: bytes) -> None:
    global _native
    if _native is None:
        _native = NativeWorld()
    if not data:
        return
    target = data[0] % NATIVE_TARGETS
    if target < PYTHON_TARGETS:
        PYTHON_CHECKS[target](data[1:])
    elif target == PYTHON_TARGETS:
        _native.forged_write(data[1:])
    else:
        _native.forged_send(data[1:])


# --- seeds --------------------------------------------------------------------------
def seeds() -> dict[str, bytes]:
    """Hand-made starting points: valid descriptors and addresses, and near misses."""
    from fabric_core.models import Device, DomainAddress, MemoryRegionDescriptor, NicKey

    def desc(nics: int, alen: int, cuda: bool = False, writable: bool = True) -> MemoryRegionDescriptor:
        return MemoryRegionDescriptor(
            ptr=0x7F0000001000,
            length=1 << 20,
            device=Device(kind="cuda", index=1) if cuda else Device(),
            writable=writable,
            nics=tuple(NicKey(address=DomainAddress(raw=bytes([i + 1]) * alen), rkey=i) for i in range(nics)),
        )

    out: dict[str, bytes] = {}
    for nics, alen, cuda, writable in [(1, 12, False, True), (2, 16, True, False), (4, 255, False, True)]:
        raw = desc(nics, alen, cuda, writable).to_bytes()
        out[f"desc-{nics}nic-{alen}"] = b"\x00" + raw
        out[f"desc-{nics}nic-{alen}-truncated"] = b"\x00" + raw[:-5]
        body = bytearray(raw[:-4])
        body[4] = 2
        out[f"desc-{nics}nic-{alen}-v2"] = b"\x00" + bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
        out[f"json-{nics}nic-{alen}"] = b"\x01" + desc(nics, alen, cuda, writable).model_dump_json().encode()
    out["json-broken"] = b"\x01" + json.dumps({"version": 2, "ptr": -1}).encode()
    out["hex-address"] = b"\x02" + b"00ff10ab"
    out["hex-odd"] = b"\x02" + b"abc"
    for text in ("cpu", "cuda", "cuda:7", "cuda:65536", "cuda:\u00b2", "gpu"):
        out[f"device-{text.encode().hex()}"] = b"\x03" + text.encode()
    out["index-int64"] = b"\x04\x00" + struct.pack("<4q", 0, 1, -1, 2**62)
    out["index-list"] = b"\x04\x03" + bytes(9) + b"\xff" * 9
    out["native-shm-like-address"] = b"\x05" + bytes(8) + b"fi_shm://12345:0\0"
    out["native-tcp-like-address"] = b"\x05" + bytes(8) + bytes([2, 0, 0x1F, 0x90, 127, 0, 0, 1]) + bytes(8)
    out["native-send"] = b"\x06" + b"\x01" * 40
    return out


def write_seeds() -> None:
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (CORPUS / f"seed-{name}").write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=int, default=60, help="time to fuzz (default 60)")
    parser.add_argument("--native", action="store_true", help="also fuzz the efa engine on shm")
    parser.add_argument("--update-corpus", action="store_true", help="merge new inputs into the corpus")
    parser.add_argument("--seed-corpus", action="store_true", help="(re)write the hand-made seeds and exit")
    parser.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"), help="where crashes go")
    parser.add_argument("--jobs", type=int, default=1, help="libFuzzer workers (default 1)")
    args = parser.parse_args(argv)
    if args.seed_corpus:
        write_seeds()
        return 0
    args.artifacts.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="fabric-fuzz-"))
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "native" if args.native else "python"]
    try:
        flags = [
            f"-max_total_time={args.seconds}",
            f"-max_len={MAX_LEN}",
            "-timeout=30",
            "-rss_limit_mb=4096",
            f"-artifact_prefix={args.artifacts.resolve()}/",
            "-print_final_stats=1",
        ]
        if args.jobs > 1:
            flags += [f"-jobs={args.jobs}", f"-workers={args.jobs}"]
        dirs = [str(scratch), str(CORPUS)] + ([str(CRASHES)] if CRASHES.is_dir() else [])
        rc = subprocess.run([*child, *flags, *dirs], timeout=args.seconds + 600).returncode
        found = sorted(p.name for p in args.artifacts.iterdir() if p.name.split("-")[0] in _FINDINGS)
        if found:
            print(f"fuzz: {len(found)} finding(s) in {args.artifacts}: {', '.join(found)}", file=sys.stderr)
            rc = rc or 1
        if args.update_corpus:
            _merge(scratch)
        return rc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


_FINDINGS = {"crash", "leak", "timeout", "oom", "slow-unit"}
MAX_CORPUS = 300


def _merge(scratch: Path) -> None:
    """Add the inputs libFuzzer kept as new coverage (named by content), smallest first, up to
    MAX_CORPUS files in all: the corpus stays small enough to replay in the default run."""
    room = MAX_CORPUS - sum(1 for _ in CORPUS.iterdir())
    for path in sorted(scratch.iterdir(), key=lambda p: p.stat().st_size)[: max(0, room)]:
        data = path.read_bytes()
        if len(data) <= MAX_LEN:
            (CORPUS / hashlib.sha1(data).hexdigest()).write_bytes(data)


def _child(argv: list[str]) -> None:
    """Inside libFuzzer (atheris): ``argv`` is the target set, then libFuzzer's flags."""
    import atheris

    with atheris.instrument_imports(include=["fabric_core"]):
        import fabric_core.memory
        import fabric_core.models  # noqa: F401
    target = check_native if argv[0] == "native" else check
    atheris.Setup([sys.argv[0], *argv[1:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    sys.exit(main())
