"""Where fused CUDA kernels may run, and how optional kernel packages are found: one predicate and one
loader, shared by packed attention (:mod:`.attention.varlen`) and the mixer ops (:mod:`.ops`).

Tests route CPU tensors through contract fakes by monkeypatching :func:`on_cuda` and putting a fake package in
``sys.modules`` (then ``load_kernel.cache_clear()``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["load_kernel", "on_cuda"]


def on_cuda(tensor: torch.Tensor) -> bool:
    """Whether fused CUDA kernels may be tried for ``tensor``."""
    return tensor.is_cuda


@functools.lru_cache(maxsize=None)
def load_kernel(module: str, attr: str) -> Callable[..., Any] | None:
    """``module.attr`` if that package imports cleanly, else None (cached; ``cache_clear`` resets)."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None
