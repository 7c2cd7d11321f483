"""The kernel test mode: packfree's CUDA kernel routes run the real fla and mamba-ssm Triton kernels on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``). See tests/README.md.

Everything that makes this work lives here, never in the package:

- ``TRITON_INTERPRET=1`` before fla / mamba-ssm are imported (``triton.jit`` reads it when a kernel is decorated);
- the autotuner keeps one config (benchmarking needs a GPU driver; every config computes the same result);
- a kernel's builtin ``range`` yields interpreter int32 scalars while it runs (fla calls ``.to(tl.int64)`` on its
  loop index, which the interpreter otherwise yields as a Python int);
- a stand-in ``selective_scan_cuda`` module (mamba-ssm imports the compiled extension at import time; no routed
  function calls it) and ``torch.cuda.device(None)`` as a no-op (mamba-ssm enters it with the CPU's index, None);
- stand-ins for the compiled code of flash-attn, causal-conv1d and torch's ``varlen_attn`` (``standins.py``), so
  their real Python wrappers run on CPU tensors;
- per test (autouse): ``backends.on_cuda`` answers True, so every op and packed attention pick their kernels as on
  a GPU.

When triton, fla or mamba-ssm is not installed (the default suite), the ``test_real_*`` files and ``test_liger.py`` are not collected:
``nox -s kernels`` installs them and runs this folder.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

KERNEL_PACKAGES = ("triton", "fla", "mamba_ssm", "flash_attn", "causal_conv1d")
MISSING = [name for name in KERNEL_PACKAGES if importlib.util.find_spec(name) is None]

if MISSING:
    collect_ignore_glob = ["test_real_*.py", "test_liger.py"]
else:
    os.environ["TRITON_INTERPRET"] = "1"
    already = [name for name in KERNEL_PACKAGES if name != "triton" and name in sys.modules]
    if already:
        raise RuntimeError(f"{already} imported before the kernel test mode set TRITON_INTERPRET=1 and its stand-ins")

    import numpy as np
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    _prune = autotuner.Autotuner.prune_configs

    def _first_config(self: autotuner.Autotuner, kwargs: dict) -> list:
        return _prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = _first_config

    def _int32_range(*bounds: Any) -> Iterator[tl.tensor]:
        for i in builtins.range(*(int(b) for b in bounds)):
            yield tl.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    _grid_call = interpreter.GridExecutor.__call__

    def _with_int32_range(self: interpreter.GridExecutor, *args: Any, **kwargs: Any) -> Any:
        scope = self.fn.__globals__
        saved = scope.get("range", _int32_range)
        scope["range"] = _int32_range
        try:
            return _grid_call(self, *args, **kwargs)
        finally:
            if saved is _int32_range:
                del scope["range"]
            else:
                scope["range"] = saved

    interpreter.GridExecutor.__call__ = _with_int32_range

    def _no_compiled_scan(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("selective_scan_cuda is a test stand-in: the compiled CUDA scan is not built here")

    sys.modules["selective_scan_cuda"] = types.SimpleNamespace(fwd=_no_compiled_scan, bwd=_no_compiled_scan)

    # transformers 5.25 hands a kernel package only inputs on the devices it lists for it; on CPU tensors stock's
    # layers take their torch path. Here, where the packages' kernels run interpreted on CPU tensors, stock is given
    # them as on a GPU (as transformers < 5.25 did everywhere), so the samples alone run the same real kernels. The
    # table is read when a modeling module decorates its kernel functions: before any is imported.
    from transformers.integrations import hub_kernels

    for _package, _devices in getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).items():
        hub_kernels._PACKAGE_SUPPORTED_DEVICES[_package] = (*_devices, "cpu")

    class _DeviceOrNothing(torch.cuda.device):
        """``torch.cuda.device`` that does nothing for ``None`` (a CPU tensor's ``device.index``)."""

        def __init__(self, device: Any) -> None:
            self.skip = device is None
            if not self.skip:
                super().__init__(device)

        def __enter__(self) -> None:
            if not self.skip:
                super().__enter__()

        def __exit__(self, *exc: Any) -> bool:
            return False if self.skip else super().__exit__(*exc)

    torch.cuda.device = _DeviceOrNothing

    _device_properties = torch.cuda.get_device_properties

    def _cpu_as_h100(device: Any = None) -> Any:
        """An H100's 132 multiprocessors for a CPU device (mamba-ssm's backward splits heads by that count)."""
        if torch.device(device if device is not None else "cpu").type == "cpu":
            return types.SimpleNamespace(multi_processor_count=132)
        return _device_properties(device)

    torch.cuda.get_device_properties = _cpu_as_h100

    from . import standins

    standins.install()

    import fla.ops.gated_delta_rule  # noqa: F401  (decorated now, under the interpreter)
    import fla.ops.kda  # noqa: F401
    import mamba_ssm.ops.triton.ssd_combined  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kernels_smoke: a quick kernel-mode subset for editing (about a minute); "
                                       "CI runs the whole mode")


@pytest.fixture(autouse=True)
def kernel_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every tensor counts as CUDA for packfree's kernel choice (ops and packed attention alike)."""
    from packfree_plugin.ops import backends

    monkeypatch.setattr(backends, "on_cuda", lambda tensor: True)
    monkeypatch.delenv("PACKFREE_ATTENTION_BACKEND", raising=False)
    backends.load_kernel.cache_clear()
    yield
    backends.load_kernel.cache_clear()


class KernelCalls:
    """What packfree handed a real kernel function: ``calls`` holds ``(args, kwargs)`` per call."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.calls: list[tuple[tuple, dict]] = []

    def only(self) -> tuple[tuple, dict]:
        assert len(self.calls) == 1, f"expected one kernel call, got {len(self.calls)}"
        return self.calls[0]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], KernelCalls]:
    """``spy("fla.ops.kda", "chunk_kda")``: the real function, recording each call (packfree loads it by name)."""

    def install(module: str, attr: str) -> KernelCalls:
        from packfree_plugin.ops import backends

        target = importlib.import_module(module)
        real = getattr(target, attr)
        record = KernelCalls(real)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            record.calls.append((args, kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(target, attr, recorded)
        backends.load_kernel.cache_clear()
        return record

    return install
