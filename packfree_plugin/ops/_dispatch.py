"""Which implementation an op runs: an optional CUDA kernel package or packfree's torch path, decided with the
shared predicate and loader of :mod:`packfree_plugin.ops.backends`; kernels are never imported at module import time."""

from __future__ import annotations

from typing import Any, Callable, Literal

from torch import Tensor

from . import backends

Backend = Literal["auto", "torch", "kernel"]


def pick_kernel(backend: Backend, probe: Tensor, module: str, attr: str) -> Callable[..., Any] | None:
    """The kernel to call, or None for the pure-torch path.

    ``auto``: the kernel when ``probe`` is on CUDA and the package imports; ``torch``: never;
    ``kernel``: always (ValueError if the package is missing).
    """
    if backend == "torch":
        return None
    if backend == "auto":
        return backends.load_kernel(module, attr) if backends.on_cuda(probe) else None
    if backend == "kernel":
        fn = backends.load_kernel(module, attr)
        if fn is None:
            raise ValueError(f"backend='kernel' needs {module}.{attr}, which does not import")
        return fn
    raise ValueError(f"backend must be 'auto', 'torch' or 'kernel', got {backend!r}")
