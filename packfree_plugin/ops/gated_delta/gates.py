"""KDA's decay gate as fla's kernel applies it in-kernel, for the chunked path (the naive reference has its own)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._chunk_layout import compute_dtype

__all__ = ["kda_gate"]


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's in-kernel decay: ``-exp(A_log)[h] * softplus(g + dt_bias[h, k])`` for ``g [B, T, H, K]``,
    ``A_log [H]`` (any shape with H elements), ``dt_bias [H*K]``. Returns float32/float64."""
    H, K = g.shape[-2], g.shape[-1]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} elements, got shape {tuple(A_log.shape)}")
    cdt = compute_dtype(g.dtype)
    x = g.to(cdt)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H*K={H * K} elements, got shape {tuple(dt_bias.shape)}")
        x = x + dt_bias.to(cdt).view(H, K)
    return -torch.exp(A_log.to(cdt)).view(H, 1) * F.softplus(x)
