"""Fused variable-length attention kernels for CUDA, imported lazily, each behind a capability check.

Every backend takes the packed batch flattened to ``[B * T, H, D]`` and the boundaries' ``cu_seqlens``
(``[N+1]`` int32 over the flattened tokens, padding spans included as segments of their own) and
``max_seqlen`` (a host int, so no device sync happens here). All three are FlashAttention 2 kernels (torch's
``varlen_attn`` runs its own copy): q, k and v must share one head dim, a multiple of 8 and at most 256. Heads
that differ (MLA: DeepSeek-V3, Kimi-Linear, MiniCPM3 have a smaller v) or are not a multiple of 8 are zero-padded
to one such dim and the output cropped, as transformers' own flash path pads v; the scale is always passed, so
padding changes no logit. Wider heads take the portable path.

- ``torch-varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10): causal/bidirectional,
  windows, GQA; no dropout, softcap or sinks.
- ``flash-attn``: ``flash_attn.flash_attn_varlen_func`` (the ``flash-attn`` package): adds dropout and
  softcap.
- ``kernels-hub``: the same function from a kernels-hub FlashAttention build already in the local cache
  (``kernels.get_kernel``; repo from ``PACKFREE_FLASH_KERNEL``, default ``kernels-community/flash-attn``).

Sinks (gpt-oss), chunked attention (Llama 4) and float32 inputs have no fused varlen kernel here; they take the
portable path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from ..ops.backends import load_kernel
from ..boundaries import Boundaries
from .reference import AttentionOptions

__all__ = ["VarlenBackend", "VARLEN_BACKENDS"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
"""FlashAttention 2's widest head (``mha_varlen_fwd`` / ``mha_varlen_bwd`` refuse more), after padding."""


@dataclass(frozen=True)
class VarlenBackend:
    """One fused kernel: ``load()`` returns its function or None; ``supports`` says if it can run a call."""

    name: str
    load: Callable[[], Callable | None]
    supports: Callable[[torch.Tensor, torch.Tensor, AttentionOptions, bool], bool]
    run: Callable[..., torch.Tensor]

    def available(self) -> bool:
        return self.load() is not None


def _window(options: AttentionOptions) -> tuple[int, int]:
    """transformers' window ``W`` -> flash's ``(left, right)`` (see :class:`AttentionOptions`)."""
    if options.causal:
        return (-1, 0) if options.window is None else (options.window - 1, 0)
    return (-1, -1) if options.window is None else (options.window - 1, options.window - 1)


def _kernel_head_dim(query: torch.Tensor, value: torch.Tensor) -> int:
    """The one head dim the kernel gets: the wider of q's and v's, rounded up to a multiple of 8."""
    return -(-max(query.shape[-1], value.shape[-1]) // 8) * 8


def _flatten(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B * T, H, head_dim]``, zero-padded on the last dim."""
    batch, heads, seq_len, dim = tensor.shape
    if dim < head_dim:
        tensor = F.pad(tensor, (0, head_dim - dim))
    return tensor.transpose(1, 2).reshape(batch * seq_len, heads, head_dim)


def _unflatten(out: torch.Tensor, boundaries: Boundaries, value_dim: int) -> torch.Tensor:
    """``[B * T, H, D]`` -> ``[B, T, H, value_dim]`` (padded columns cropped), zeroing padding segments."""
    out = out[..., :value_dim].view(boundaries.batch_size, boundaries.seq_len, out.shape[1], value_dim)
    if boundaries.has_padding:
        out = out.masked_fill(boundaries.padding_tokens[:, :, None, None], 0.0)
    return out


def _torch_varlen() -> Callable | None:
    return load_kernel("torch.nn.attention.varlen", "varlen_attn")


def _flash_attn() -> Callable | None:
    return load_kernel("flash_attn", "flash_attn_varlen_func")


@cache
def _kernels_hub() -> Callable | None:
    try:
        import kernels

        module = kernels.get_kernel(os.environ.get("PACKFREE_FLASH_KERNEL", "kernels-community/flash-attn"))
        return module.flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - not in the local cache, offline, wrong arch: simply not available
        return None


def _run_torch_varlen(q, k, v, boundaries: Boundaries, options: AttentionOptions, *, training: bool) -> torch.Tensor:
    dim = _kernel_head_dim(q, v)
    out = _torch_varlen()(
        _flatten(q, dim), _flatten(k, dim), _flatten(v, dim), boundaries.cu_seqlens, boundaries.cu_seqlens,
        boundaries.max_seqlen, boundaries.max_seqlen, scale=options.scale, window_size=_window(options),
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return _unflatten(out, boundaries, v.shape[-1])


def _flash_style_runner(load: Callable[[], Callable | None]) -> Callable[..., torch.Tensor]:
    def run(q, k, v, boundaries: Boundaries, options: AttentionOptions, *, training: bool) -> torch.Tensor:
        dim = _kernel_head_dim(q, v)
        out = load()(
            _flatten(q, dim), _flatten(k, dim), _flatten(v, dim), boundaries.cu_seqlens, boundaries.cu_seqlens,
            boundaries.max_seqlen, boundaries.max_seqlen, dropout_p=options.dropout if training else 0.0,
            softmax_scale=options.scale, causal=options.causal, window_size=_window(options),
            softcap=options.softcap or 0.0,
        )
        return _unflatten(out, boundaries, v.shape[-1])

    return run


def _supports_torch_varlen(query: torch.Tensor, value: torch.Tensor, options: AttentionOptions,
                           training: bool) -> bool:
    return (_supports_flash(query, value, options, training) and not options.needs_eager
            and not (training and options.dropout > 0))


def _supports_flash(query: torch.Tensor, value: torch.Tensor, options: AttentionOptions, training: bool) -> bool:
    return (query.dtype in _HALF_DTYPES and options.sinks is None and options.chunk is None
            and _kernel_head_dim(query, value) <= _MAX_HEAD_DIM)


VARLEN_BACKENDS: tuple[VarlenBackend, ...] = (
    VarlenBackend("torch-varlen", _torch_varlen, _supports_torch_varlen, _run_torch_varlen),
    VarlenBackend("flash-attn", _flash_attn, _supports_flash, _flash_style_runner(_flash_attn)),
    VarlenBackend("kernels-hub", _kernels_hub, _supports_flash, _flash_style_runner(_kernels_hub)),
)
