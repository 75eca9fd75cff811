"""torch, imported on first use: only casts and tensor views need it."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import numpy as np

from fabric_core.errors import ConfigError

__all__ = ["byte_view", "dtype", "module"]

_torch: Any = None


def module() -> Any:
    """The torch module; ``ConfigError`` with the install hint when it is missing."""
    global _torch
    if _torch is None:
        try:
            _torch = importlib.import_module("torch")
        except ImportError:
            raise ConfigError("this needs torch (dtype casts, tensor views): pip install torch") from None
    return _torch


def dtype(name: str) -> Any:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"float8_e4m3fn"``, ...)."""
    value = getattr(module(), name, None)
    if value is None:
        raise ConfigError(f"this torch has no dtype {name!r}")
    return value


def is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def byte_view(buffer: Any) -> Any:
    """A flat torch ``uint8`` tensor sharing the memory of a contiguous numpy array or tensor."""
    torch = module()
    if is_tensor(buffer):
        if not buffer.is_contiguous():
            raise ConfigError("the buffer must be a contiguous tensor")
        return buffer.reshape(-1).view(torch.uint8)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ConfigError("the buffer must be a C-contiguous array")
        flat = buffer.reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # a read-only array gives a read-only-ish view: fine here
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)
    raise ConfigError(f"expected a numpy array or a torch tensor, got {type(buffer).__name__}")
