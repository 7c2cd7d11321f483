"""The smallest shim that lets Liger-Kernel's Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``)
on CPU tensors, for tests only (never in the package). It fills two gaps of the interpreter itself, each reproduced
without Liger in docs/known-limits.md ("Triton's interpreter"):

1. A float argument of a ``@triton.jit`` kernel reaches the kernel as a Python ``float``, where compiled code has an
   fp32 scalar: Liger's ``eps.to(tl.float32)`` raises ``AttributeError: 'float' object has no attribute 'to'``.
   Here it becomes an fp32 scalar, as the compiler makes it.
2. ``triton.language.extra.libdevice.rsqrt`` is a stub the interpreter never replaces (it patches ``tl.math`` only),
   so a kernel that imported it by name gets ``None``. Here it calls ``tl.math.rsqrt``, which the interpreter runs.

:func:`install` must run before Liger is imported: Liger binds ``rsqrt`` at import, and ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is decorated. Like tests/kernels/conftest.py in the kernel test mode, it also
makes the autotuner keep its first config (benchmarking configs needs a GPU driver; every config computes the same
result), so that this file runs where the conftest's mode is off (no fla or mamba-ssm installed).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["install", "launched"]

launched: list[str] = []
"""The name of every kernel the interpreter ran since :func:`install` (cleared by the tests)."""


def install() -> None:
    """Fill the interpreter's two gaps and record every kernel launch in :data:`launched`. Idempotent."""
    if "liger_kernel" in sys.modules and not getattr(install, "done", False):
        raise RuntimeError("liger_kernel was imported before the interpreter shim was installed")
    if getattr(install, "done", False):
        return
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import autotuner, interpreter

    convert: Callable[[Any], Any] = interpreter._implicit_cvt

    def float_as_fp32(argument: Any) -> Any:
        if isinstance(argument, float):
            handle = interpreter.TensorHandle(np.array([argument], dtype=np.float32), tl.float32)
            return tl.tensor(handle, tl.float32)
        return convert(argument)

    interpreter._implicit_cvt = float_as_fp32
    libdevice.rsqrt = lambda x: tl.math.rsqrt(x)

    run = interpreter.GridExecutor.__call__

    def recording(self, *args: Any, **kwargs: Any) -> Any:
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording

    prune = autotuner.Autotuner.prune_configs

    def first_config(self: autotuner.Autotuner, kwargs: dict) -> list:
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config
    install.done = True
