"""Public boundary-aware causal depthwise conv1d and its dispatch (CUDA kernel or pure torch)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._boundary_doc import with_boundary_doc
from .._dispatch import Backend, pick_kernel
from .._nonfinite import around_kernel
from .._seq import resolve_seq_idx
from .fast import causal_conv1d_masked

KERNEL = ("causal_conv1d", "causal_conv1d_fn")
_ACTIVATIONS = (None, "silu", "swish")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a [B, T, C] tensor, got shape {getattr(x, 'shape', type(x))}")
    C = x.shape[2]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, K] with C={C}, K>=1, got {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C] with C={C}, got {list(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _kernel_fits(x: Tensor, weight: Tensor) -> bool:
    """What causal_conv1d's channel-last seq_idx path accepts (else: torch path)."""
    return 2 <= weight.shape[1] <= 4 and x.shape[2] % 8 == 0 and x.dtype in _KERNEL_DTYPES


@with_boundary_doc
def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    activation: str | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    backend: Backend = "auto",
    validate: bool | None = None,
) -> Tensor:
    """Causal depthwise conv1d over packed rows; every sample starts from zero padding.

    ``out[b, t, c] = act(bias[c] + sum_k weight[c, k] * x[b, t - (K-1) + k, c])`` where taps that
    fall before the start of token t's sample read 0 (as Mamba / Mamba2 / Bamba / LFM2 / GDN short
    convolutions do on an unpacked sample).

    Layout: channel-last ``[B, T, C]`` in and out (what the in-projection produces). The CUDA
    kernel is called on the ``[B, C, T]`` transposed view of that tensor, which is exactly its
    channel-last layout with ``seq_idx`` support; nothing is copied.

    Args:
        x: ``[B, T, C]``.
        weight: ``[C, K]`` (``conv1d.weight[:, 0, :]`` of an ``nn.Conv1d(C, C, K, groups=C)``).
        bias: ``[C]`` or None.
        activation: None, ``"silu"`` or ``"swish"`` (same as silu).
        {boundaries}
        backend: ``"auto"`` (``causal_conv1d.causal_conv1d_fn`` when x is on CUDA, the package
            imports and the shape fits it: 2 <= K <= 4, C % 8 == 0, fp32/fp16/bf16; else pure
            torch), ``"torch"`` or ``"kernel"`` (force the package).

    Returns:
        ``[B, T, C]``, dtype of x.
    """
    _check(x, weight, bias, activation)
    B, T, _ = x.shape
    seq_idx = resolve_seq_idx(B, T, x.device, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                              validate=validate)
    kernel = pick_kernel(backend, x, *KERNEL)
    if kernel is not None and (backend == "kernel" or _kernel_fits(x, weight)):
        def run(x: Tensor) -> Tensor:
            x_cl = x.contiguous().transpose(1, 2)  # [B, C, T] view, stride(1) == 1
            out = kernel(
                x_cl,
                weight.contiguous(),
                bias=None if bias is None else bias.contiguous(),
                seq_idx=None if seq_idx is None else seq_idx.contiguous(),
                activation=activation,
            )
            return out.transpose(1, 2)

        return around_kernel(seq_idx, [(x, 1)], run)
    return causal_conv1d_masked(x, weight, bias, seq_idx=seq_idx, activation=activation)
