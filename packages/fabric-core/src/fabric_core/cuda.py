"""The few CUDA driver calls fabric needs, loaded at run time (no build-time CUDA dependency).

fabric runs without CUDA: ``libcuda.so.1`` is opened the first time something asks for it,
and every function here raises ``CapabilityError`` with the reason when there is no driver or
no GPU. Nothing here needs torch; torch tensors only pass their pointers through.

What it gives the engines:

* :func:`pointer_device` / :func:`check_device_span`: is this address CUDA device memory of
  the device the caller named, and how far does its allocation reach (PyTorch's
  ``expandable_segments`` maps a tensor in several pieces)?
* :func:`copy`: a synchronous copy between any two addresses that unified addressing covers
  (host to device, device to device, across GPUs), on a non-blocking stream of the calling
  thread's own, so that it waits for no other stream of the process;
* :func:`mapped_words`: page-locked host memory mapped into every GPU's address space, where
  the engines publish imm counts for GPU-side waits (:mod:`fabric_core.device_counter`);
* :func:`stream_wait_value`: a stream waits until a 32-bit word reaches a value (a
  one-thread kernel polls it; see ``_WAIT_PTX`` for why not ``cuStreamWaitValue32``).

Copies and waits made here see the memory as the NIC does: the writer of a buffer finishes
the GPU work that produces it (``stream.synchronize()`` or an event) before it submits.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import CapabilityError, ConfigError
from .models import Device

__all__ = [
    "AddressInfo",
    "MappedWords",
    "available",
    "check_device_span",
    "copy",
    "current_device",
    "device_buffer",
    "mapped_words",
    "pointer_device",
    "stream_wait_value",
    "unavailable_reason",
]

# cuda.h
_SUCCESS = 0
_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_MEMORYTYPE_HOST = 1
_MEMORYTYPE_DEVICE = 2
_MEMORYTYPE_UNIFIED = 4
_MEMHOSTALLOC_PORTABLE = 0x1
_MEMHOSTALLOC_DEVICEMAP = 0x2
_STREAM_NON_BLOCKING = 0x1

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


class _CudaError(RuntimeError):
    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.code = code


class _Driver:
    """libcuda.so.1 with the prototypes used here; one per process."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        lib = self.lib
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuPointerGetAttribute.argtypes = [_vp, ctypes.c_int, _u64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64]
        lib.cuMemcpyAsync.argtypes = [_u64, _u64, ctypes.c_size_t, _vp]
        lib.cuStreamSynchronize.argtypes = [_vp]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(_vp), ctypes.c_uint]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_vp)]
        lib.cuCtxSetCurrent.argtypes = [_vp]
        lib.cuCtxPushCurrent_v2.argtypes = [_vp]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(_vp)]
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(_vp), ctypes.c_int]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(_vp), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(_u64), _vp, ctypes.c_uint]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(_vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(_vp), _vp, ctypes.c_char_p]
        lib.cuLaunchKernel.argtypes = [_vp, *([ctypes.c_uint] * 6), ctypes.c_uint, _vp, _vp, _vp]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(_u64), ctypes.c_size_t]
        lib.cuMemFree_v2.argtypes = [_u64]
        self.check("cuInit", lib.cuInit(0))
        count = ctypes.c_int()
        self.check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
        if count.value < 1:
            raise _CudaError("cuDeviceGetCount", 100, "no CUDA device")
        self.devices = count.value
        self._primary: dict[int, int] = {}
        self.kernels: dict[int, int] = {}  # context -> the wait kernel
        self._lock = threading.Lock()
        self._local = threading.local()

    def check(self, call: str, code: int) -> None:
        if code != _SUCCESS:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise _CudaError(call, code, (text.value or b"unknown").decode())

    def context(self, ordinal: int = 0) -> None:
        """Make a context current on this thread if none is (device ``ordinal``'s primary
        context, the one PyTorch and the runtime API use)."""
        cur = _vp()
        self.check("cuCtxGetCurrent", self.lib.cuCtxGetCurrent(ctypes.byref(cur)))
        if cur.value:
            return
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self._primary_ctx(ordinal)))

    def _primary_ctx(self, ordinal: int) -> int:
        """Device ``ordinal``'s primary context, retained once per process."""
        with self._lock:
            ctx = self._primary.get(ordinal)
            if ctx is None:
                handle = _vp()
                self.check(
                    "cuDevicePrimaryCtxRetain",
                    self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), ordinal),
                )
                ctx = self._primary[ordinal] = int(handle.value or 0)
        return ctx

    @contextmanager
    def owning(self, ordinal: int) -> Iterator[None]:
        """Device ``ordinal``'s primary context current for the block, where the current one
        is another device's: the driver finds an allocation's range only in a context of its
        own device (``cuMemGetAddressRange`` on another GPU's pointer answers "not found")."""
        self.context(ordinal)
        dev = ctypes.c_int(0)
        self.check("cuCtxGetDevice", self.lib.cuCtxGetDevice(ctypes.byref(dev)))
        if dev.value == ordinal:
            yield
            return
        self.check("cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2(self._primary_ctx(ordinal)))
        try:
            yield
        finally:
            popped = _vp()
            self.check("cuCtxPopCurrent", self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped)))

    def stream(self) -> int:
        """This thread's copy stream (non-blocking: it waits for no other stream)."""
        s: int | None = getattr(self._local, "stream", None)
        if s is None:
            self.context()
            handle = _vp()
            self.check("cuStreamCreate", self.lib.cuStreamCreate(ctypes.byref(handle), _STREAM_NON_BLOCKING))
            s = self._local.stream = int(handle.value or 0)
        return s

    def attribute(self, ptr: int, attr: int) -> int | None:
        """A pointer attribute, or None for memory CUDA does not know (plain host memory)."""
        out = _u64(0)
        code = self.lib.cuPointerGetAttribute(ctypes.byref(out), attr, ptr)
        return None if code != _SUCCESS else int(out.value)


_driver: _Driver | None = None
_driver_error: str | None = None
_driver_lock = threading.Lock()


def _get() -> _Driver:
    global _driver, _driver_error
    if _driver is not None:
        return _driver
    with _driver_lock:
        if _driver is None and _driver_error is None:
            try:
                _driver = _Driver()
            except OSError as exc:
                _driver_error = f"no CUDA driver (libcuda.so.1: {exc})"
            except (_CudaError, AttributeError) as exc:
                _driver_error = f"the CUDA driver cannot be used: {exc}"
    if _driver is None:
        raise CapabilityError(_driver_error or "no CUDA driver")
    return _driver


def available() -> bool:
    """Whether a CUDA driver with at least one GPU is there (loads it on first call)."""
    try:
        _get()
    except CapabilityError:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    try:
        _get()
    except CapabilityError as exc:
        return str(exc)
    return None


def current_device() -> int:
    """The device of this thread's current CUDA context (``torch.cuda.set_device`` makes
    one current), or 0 where none is."""
    drv = _get()
    cur = _vp()
    drv.check("cuCtxGetCurrent", drv.lib.cuCtxGetCurrent(ctypes.byref(cur)))
    if not cur.value:
        return 0
    ordinal = ctypes.c_int(0)
    drv.check("cuCtxGetDevice", drv.lib.cuCtxGetDevice(ctypes.byref(ordinal)))
    return int(ordinal.value)


@dataclass(frozen=True, slots=True)
class AddressInfo:
    """What the driver says of an address: its device and the allocation it lies in."""

    device: int
    base: int
    size: int
    managed: bool


def pointer_device(ptr: int) -> AddressInfo | None:
    """The CUDA device memory ``ptr`` points into, or None if it is not device memory."""
    drv = _get()
    kind = drv.attribute(ptr, _POINTER_ATTRIBUTE_MEMORY_TYPE)
    if kind not in (_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED):
        return None
    ordinal = drv.attribute(ptr, _POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    base, size = _u64(0), ctypes.c_size_t(0)
    with drv.owning(ordinal or 0):
        drv.check(
            "cuMemGetAddressRange",
            drv.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
        )
    return AddressInfo(int(ordinal or 0), int(base.value), int(size.value), kind == _MEMORYTYPE_UNIFIED)


def check_device_span(ptr: int, length: int, device: Device, *, one_allocation: bool = False) -> AddressInfo:
    """Check, at registration, that ``[ptr, ptr + length)`` is memory of ``device``.

    ``one_allocation``: the backend needs the span inside one driver allocation (CUDA IPC
    handles and DMA-BUFs name one); PyTorch's ``expandable_segments`` maps tensors in pieces,
    so a tensor that straddles two of them is refused here, with the fix, rather than at the
    first transfer."""
    info = pointer_device(ptr)
    if info is None:
        raise ConfigError(f"{ptr:#x} is not CUDA device memory, but the registration names {device}")
    if info.device != device.index:
        raise ConfigError(f"{ptr:#x} is memory of cuda:{info.device}, but the registration names {device}")
    if ptr + length > info.base + info.size:
        # the rest may lie in further mapped pieces (one virtual range, several allocations)
        end = ptr + length
        cursor = info.base + info.size
        while cursor < end:
            nxt = pointer_device(cursor)
            if nxt is None or nxt.device != info.device:
                raise ConfigError(
                    f"[{ptr:#x}, +{length}) runs past the end of its CUDA allocation "
                    f"([{info.base:#x}, +{info.size})): the buffer is larger than the memory behind it"
                )
            if one_allocation:
                raise CapabilityError(
                    f"[{ptr:#x}, +{length}) spans several CUDA allocations (PyTorch's expandable_segments "
                    f"maps tensors in pieces; this one crosses {cursor:#x}), and this backend needs one: "
                    "allocate it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or from a "
                    "separate torch.cuda.MemPool"
                )
            cursor = nxt.base + nxt.size
    return info


@contextmanager
def device_buffer(nbytes: int, device: int = 0) -> Iterator[int]:
    """A plain ``cuMemAlloc`` of ``nbytes`` on ``device`` for the block's duration (the
    backends probe with it whether their provider really registers CUDA memory)."""
    drv = _get()
    drv.context(device)
    ptr = _u64(0)
    drv.check("cuMemAlloc", drv.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes))
    try:
        yield int(ptr.value)
    finally:
        drv.lib.cuMemFree_v2(ptr.value)


def copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` (any mix of host and device memory); returns
    once the bytes are in place."""
    drv = _get()
    stream = drv.stream()
    drv.check("cuMemcpyAsync", drv.lib.cuMemcpyAsync(dst, src, nbytes, stream))
    drv.check("cuStreamSynchronize", drv.lib.cuStreamSynchronize(stream))


class MappedWords:
    """A block of page-locked host memory mapped into every GPU: 32-bit words the host
    writes and GPU streams wait on. Never freed (a stream may still wait on a word)."""

    __slots__ = ("count", "device_ptr", "host_ptr")

    def __init__(self, host_ptr: int, device_ptr: int, count: int) -> None:
        self.host_ptr, self.device_ptr, self.count = host_ptr, device_ptr, count

    def word(self, i: int) -> ctypes.c_uint32:
        if not 0 <= i < self.count:
            raise IndexError(i)
        return ctypes.c_uint32.from_address(self.host_ptr + 4 * i)


def mapped_words(count: int) -> MappedWords:
    """``count`` zeroed 32-bit words of mapped page-locked host memory."""
    drv = _get()
    drv.context()
    host = _vp()
    nbytes = max(4 * count, 64)
    drv.check(
        "cuMemHostAlloc",
        drv.lib.cuMemHostAlloc(ctypes.byref(host), nbytes, _MEMHOSTALLOC_PORTABLE | _MEMHOSTALLOC_DEVICEMAP),
    )
    dev = _u64(0)
    drv.check("cuMemHostGetDevicePointer", drv.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0))
    ctypes.memset(int(host.value or 0), 0, nbytes)
    return MappedWords(int(host.value or 0), int(dev.value), count)


# The wait kernel, in PTX that the driver compiles for whatever GPU it runs on (sm_70 and
# later: nanosleep): one thread polls the word with volatile loads until
# (int32)(word - target) >= 0, sleeping briefly between polls. A kernel, not
# cuStreamWaitValue32: a stream blocked in a stream memory operation blocks the hardware
# queue it shares with other streams, so unrelated work of the process (the engine's own
# device copies included) stalls behind it until the value arrives (measured on an H200:
# a 64 MiB copy waited the whole 3 s with 8 streams blocked). A spinning kernel holds one
# warp of one SM and lets the queue go on.
_WAIT_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry fabric_wait_geq(.param .u64 word, .param .u32 target)
{
    .reg .pred %p;
    .reg .b32 %v, %t, %d;
    .reg .b64 %a;
    ld.param.u64 %a, [word];
    ld.param.u32 %t, [target];
POLL:
    ld.volatile.global.u32 %v, [%a];
    sub.s32 %d, %v, %t;
    setp.ge.s32 %p, %d, 0;
    @%p bra DONE;
    nanosleep.u32 100;
    bra POLL;
DONE:
    fence.acq_rel.sys;
    ret;
}
"""


def _wait_kernel(drv: _Driver) -> int:
    """The wait kernel in the current context (loaded once per context)."""
    ctx = _vp()
    drv.check("cuCtxGetCurrent", drv.lib.cuCtxGetCurrent(ctypes.byref(ctx)))
    key = int(ctx.value or 0)
    with drv._lock:
        fn = drv.kernels.get(key)
        if fn is None:
            module, handle = _vp(), _vp()
            drv.check("cuModuleLoadData", drv.lib.cuModuleLoadData(ctypes.byref(module), _WAIT_PTX + b"\0"))
            drv.check(
                "cuModuleGetFunction",
                drv.lib.cuModuleGetFunction(ctypes.byref(handle), module, b"fabric_wait_geq"),
            )
            fn = drv.kernels[key] = int(handle.value or 0)
    return fn


def stream_wait_value(stream: int, device_ptr: int, value: int) -> None:
    """Make ``stream`` (a ``CUstream`` handle; 0 is the legacy default stream) wait until
    the 32-bit word at ``device_ptr`` reaches ``value``, compared cyclically
    (``(int32)(word - value) >= 0``): one single-thread kernel that polls the word. Can be
    captured in a CUDA graph (the target is then fixed)."""
    drv = _get()
    drv.context()
    fn = _wait_kernel(drv)
    word, target = ctypes.c_uint64(device_ptr), ctypes.c_uint32(value & 0xFFFFFFFF)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(word), ctypes.addressof(target))
    drv.check("cuLaunchKernel", drv.lib.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None))
