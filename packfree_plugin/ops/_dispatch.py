"""Lazy, cached lookup of optional CUDA kernels; never imported at module import time."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Literal

from torch import Tensor

Backend = Literal["auto", "torch", "kernel"]


def on_cuda(t: Tensor) -> bool:
    """Predicate the dispatchers use; tests monkeypatch it to route CPU tensors to a fake kernel."""
    return t.is_cuda


@functools.lru_cache(maxsize=None)
def load_kernel(module: str, attr: str) -> Callable[..., Any] | None:
    """``module.attr`` if that package imports cleanly, else None (cached; ``cache_clear`` resets)."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None


def pick_kernel(backend: Backend, probe: Tensor, module: str, attr: str) -> Callable[..., Any] | None:
    """The kernel to call, or None for the pure-torch path.

    ``auto``: the kernel when ``probe`` is on CUDA and the package imports; ``torch``: never;
    ``kernel``: always (ValueError if the package is missing).
    """
    if backend == "torch":
        return None
    if backend == "auto":
        return load_kernel(module, attr) if on_cuda(probe) else None
    if backend == "kernel":
        fn = load_kernel(module, attr)
        if fn is None:
            raise ValueError(f"backend='kernel' needs {module}.{attr}, which does not import")
        return fn
    raise ValueError(f"backend must be 'auto', 'torch' or 'kernel', got {backend!r}")
