"""GPU tests: collected everywhere, run only where a CUDA driver and GPU are present.

On a GPU machine: ``./dev gpu`` (or ``pytest tests/gpu``)."""

from __future__ import annotations

import os

import pytest

# Before CUDA starts (see docs/gpu.md, "Hazards"): every kernel loaded up front, so that no
# first launch waits for a GPU-side wait to pass; and enough hardware queues that the
# streams a test makes wait do not share one with the copies it checks.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from fabric_core import cuda


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped, with the reason, without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda.unavailable_reason()
    try:
        import torch

        if reason is None and not torch.cuda.is_available():
            reason = f"torch {torch.__version__} has no CUDA"
    except ImportError:
        reason = reason or "torch is not installed"
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))
