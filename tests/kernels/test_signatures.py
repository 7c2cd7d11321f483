"""The contract fakes of the CUDA-only kernels take exactly the real functions' parameters (name, kind, default).

Where the real wrapper imports here (torch's ``varlen_attn``; flash-attn / causal-conv1d on a CUDA machine, or in the
kernel test mode, where they are installed without their compiled code), the fake is compared with it. Where it
cannot (the default suite has neither package; kernels-hub builds come from the hub), the fake is compared with the
signature recorded below from the packages' source for the versions the ``cuda`` extra allows, and an installed
package is compared with that record too (``test_real_wrappers.py`` insists it imports): a release that renames,
reorders or re-defaults a parameter fails here. Runs in the default suite (no kernel package needed).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable

import pytest
import torch.nn.attention.varlen as torch_varlen_module

from tests.attention import test_varlen_routing as varlen_fakes
from tests.ops import test_conv as conv_fakes

Parameters = list[tuple[str, str, object]]
_EMPTY = inspect.Parameter.empty

FLASH_ATTN_VARLEN: Parameters = [
    ("q", "POSITIONAL_OR_KEYWORD", _EMPTY), ("k", "POSITIONAL_OR_KEYWORD", _EMPTY),
    ("v", "POSITIONAL_OR_KEYWORD", _EMPTY), ("cu_seqlens_q", "POSITIONAL_OR_KEYWORD", _EMPTY),
    ("cu_seqlens_k", "POSITIONAL_OR_KEYWORD", _EMPTY), ("max_seqlen_q", "POSITIONAL_OR_KEYWORD", _EMPTY),
    ("max_seqlen_k", "POSITIONAL_OR_KEYWORD", _EMPTY), ("dropout_p", "POSITIONAL_OR_KEYWORD", 0.0),
    ("softmax_scale", "POSITIONAL_OR_KEYWORD", None), ("causal", "POSITIONAL_OR_KEYWORD", False),
    ("window_size", "POSITIONAL_OR_KEYWORD", (-1, -1)), ("softcap", "POSITIONAL_OR_KEYWORD", 0.0),
    ("alibi_slopes", "POSITIONAL_OR_KEYWORD", None), ("deterministic", "POSITIONAL_OR_KEYWORD", False),
    ("return_attn_probs", "POSITIONAL_OR_KEYWORD", False), ("block_table", "POSITIONAL_OR_KEYWORD", None),
]
"""``flash_attn.flash_attn_varlen_func``, identical in flash-attn v2.6.0, v2.7.0 and v2.8.3
(flash_attn/flash_attn_interface.py), and in the kernels-hub build kernels-community/flash-attn
(flash-attn/torch-ext/flash_attn/flash_attn_interface.py)."""

CAUSAL_CONV1D_FN: Parameters = [
    ("x", "POSITIONAL_OR_KEYWORD", _EMPTY), ("weight", "POSITIONAL_OR_KEYWORD", _EMPTY),
    ("bias", "POSITIONAL_OR_KEYWORD", None), ("seq_idx", "POSITIONAL_OR_KEYWORD", None),
    ("initial_states", "POSITIONAL_OR_KEYWORD", None), ("return_final_states", "POSITIONAL_OR_KEYWORD", False),
    ("final_states_out", "POSITIONAL_OR_KEYWORD", None), ("activation", "POSITIONAL_OR_KEYWORD", None),
]
"""``causal_conv1d.causal_conv1d_fn``, identical in causal-conv1d v1.4.0, v1.5.0 and v1.6.1
(causal_conv1d/causal_conv1d_interface.py)."""


def parameters(fn: Callable) -> Parameters:
    """``(name, kind, default)`` per parameter; annotations are left out (the fakes carry none)."""
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def real_or_none(module: str, attr: str) -> Callable | None:
    """The installed package's function, or None where it does not import (no CUDA extension here)."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, OSError, RuntimeError, AttributeError):
        return None


@pytest.fixture
def flash_attn_fake(monkeypatch) -> Callable:
    real = sys.modules.get("flash_attn")
    varlen_fakes._install_flash_attn(monkeypatch, varlen_fakes.FakeKernel())
    fake = sys.modules["flash_attn"].flash_attn_varlen_func
    if real is not None:
        monkeypatch.setitem(sys.modules, "flash_attn", real)
    return fake


def test_torch_varlen_attn_fake_has_the_real_parameters(monkeypatch) -> None:
    real = torch_varlen_module.varlen_attn
    varlen_fakes._install_torch_varlen(monkeypatch, varlen_fakes.FakeKernel())
    assert parameters(torch_varlen_module.varlen_attn) == parameters(real)


def recorded_or_real(module: str, attr: str, recorded: Parameters) -> Parameters:
    """The record, after checking an installed package against it (on a CUDA machine with the package built)."""
    real = real_or_none(module, attr)
    if real is not None:
        assert parameters(real) == recorded, f"the installed {module}.{attr} differs from the recorded signature"
    return recorded


def test_flash_attn_varlen_fake_has_the_recorded_parameters(flash_attn_fake) -> None:
    """The fake serves both the flash-attn package route and the kernels-hub route (same function)."""
    assert parameters(flash_attn_fake) == recorded_or_real("flash_attn", "flash_attn_varlen_func", FLASH_ATTN_VARLEN)


def test_causal_conv1d_fake_has_the_recorded_parameters() -> None:
    fake = conv_fakes._fake_causal_conv1d([], None)
    assert parameters(fake) == recorded_or_real("causal_conv1d", "causal_conv1d_fn", CAUSAL_CONV1D_FN)
