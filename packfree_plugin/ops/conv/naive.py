"""Slow, obviously-right reference: one ``F.conv1d`` per sample, zero padding at each sample start."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    seq_idx: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """Per-sample loop. ``x [B, T, C]``, ``weight [C, K]``, ``bias [C]``, ``seq_idx [B, T]`` -> ``[B, T, C]``."""
    B, T, C = x.shape
    K = weight.shape[1]
    if seq_idx is None:
        seq_idx = torch.zeros(B, T, dtype=torch.int32, device=x.device)
    rows = []
    for b in range(B):
        ids = seq_idx[b].tolist()
        starts = [t for t in range(T) if t == 0 or ids[t] != ids[t - 1]] + [T]
        pieces = []
        for s, e in zip(starts[:-1], starts[1:]):
            xs = x[b, s:e].T.unsqueeze(0)  # [1, C, L]
            y = F.conv1d(xs, weight.unsqueeze(1), bias, padding=K - 1, groups=C)[..., : e - s]
            pieces.append(y[0].T)
        rows.append(torch.cat(pieces, dim=0))
    out = torch.stack(rows)
    return F.silu(out) if activation in ("silu", "swish") else out
