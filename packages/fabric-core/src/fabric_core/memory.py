"""Turn what users register (buffers, numpy arrays, torch tensors, raw pointers) into spans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError
from .models import Device

__all__ = ["MemorySpan", "RawMemory", "memory_span"]


@dataclass(frozen=True, slots=True)
class RawMemory:
    """A raw pointer with its length and device. The caller keeps the memory alive."""

    ptr: int
    length: int
    device: Device | str = "cpu"


@dataclass(frozen=True, slots=True)
class MemorySpan:
    ptr: int
    length: int
    device: Device
    writable: bool
    keepalive: object


def _is_torch_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def memory_span(obj: object) -> MemorySpan:
    """Resolve a registrable object; raise ConfigError for anything that cannot be registered."""
    if isinstance(obj, RawMemory):
        if isinstance(obj.ptr, bool) or not isinstance(obj.ptr, int) or obj.ptr <= 0 or obj.ptr >= 1 << 64:
            raise ConfigError(f"RawMemory.ptr must be a non-null 64-bit address, got {obj.ptr!r}")
        if (
            isinstance(obj.length, bool)
            or not isinstance(obj.length, int)
            or obj.length <= 0
            or obj.ptr + obj.length > 1 << 64
        ):
            raise ConfigError(f"RawMemory.length must be positive and fit in 64 bits, got {obj.length!r}")
        return MemorySpan(obj.ptr, obj.length, Device.parse(obj.device), True, obj)
    if _is_torch_tensor(obj):
        t: Any = obj
        if t.device.type == "meta":
            raise ConfigError(
                "a meta tensor has no memory to register: only a phantom simulator "
                "(fabric_sim.SimFabric(phantom=True)) takes one"
            )
        if not t.is_contiguous():
            raise ConfigError("tensor is not contiguous: register tensor.contiguous() instead")
        nbytes = int(t.numel()) * int(t.element_size())
        if nbytes == 0:
            raise ConfigError("cannot register an empty tensor")
        device = Device.parse(str(t.device))
        return MemorySpan(int(t.data_ptr()), nbytes, device, True, t)
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            view = memoryview(obj)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"cannot register {type(obj).__name__}: pass a buffer-protocol object, a numpy "
                "array, a torch tensor or fabric_core.RawMemory(ptr, length, device)"
            ) from None
        if not view.contiguous:
            raise ConfigError("buffer is not contiguous: register a contiguous copy")
        arr = np.frombuffer(view.cast("B") if view.ndim else view, dtype=np.uint8)
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ConfigError("array is not contiguous: register np.ascontiguousarray(a) instead")
    if arr.nbytes == 0:
        raise ConfigError("cannot register an empty buffer")
    return MemorySpan(int(arr.ctypes.data), int(arr.nbytes), Device(), bool(arr.flags.writeable), obj)


def index_array(obj: object, what: str) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Page indices from a sequence, numpy array or torch tensor, as int64, without a Python loop."""
    if _is_torch_tensor(obj):
        t: Any = obj
        obj = t.detach().to("cpu").numpy()
    try:
        arr = np.asarray(obj)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, odd objects
        raise ConfigError(f"{what} must be a one-dimensional array of integers ({exc})") from None
    if arr.ndim != 1:
        raise ConfigError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype == np.uint64 and int(arr.max()) >= 1 << 63:
        raise ConfigError(f"{what} holds an index beyond 2**63")
    out: np.ndarray[Any, np.dtype[np.int64]] = arr.astype(np.int64, copy=False)
    return out
