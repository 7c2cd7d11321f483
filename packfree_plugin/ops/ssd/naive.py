"""Slow, obviously-right Mamba2 SSD reference: per sample, per token recurrence from a zero state."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _preprocessed_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> Tensor:
    """mamba_ssm's dt preprocessing: ``+ dt_bias``, softplus (identity above 20), clamp to dt_limit."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def naive_ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    seq_idx: Tensor | None = None,
) -> Tensor:
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, ``y *= silu(z)``;
    h = 0 at every sample start. Shapes as :func:`packfree_plugin.ops.ssd.ssd_chunk_scan`."""
    Bsz, T, H, P = x.shape
    G = B.shape[2]
    dt = _preprocessed_dt(dt, dt_bias, dt_softplus, dt_limit)
    rows = []
    for b in range(Bsz):
        ids = None if seq_idx is None else seq_idx[b].tolist()
        h = x.new_zeros(H, P, B.shape[3])
        ys = []
        for t in range(T):
            if t == 0 or (ids is not None and ids[t] != ids[t - 1]):
                h = x.new_zeros(H, P, B.shape[3])
            Bt = B[b, t].repeat_interleave(H // G, dim=0)  # [H, N]
            Ct = C[b, t].repeat_interleave(H // G, dim=0)
            decay = torch.exp(dt[b, t] * A)  # [H]
            h = decay[:, None, None] * h + (dt[b, t][:, None] * x[b, t])[:, :, None] * Bt[:, None, :]
            y = (h * Ct[:, None, :]).sum(-1)  # [H, P]
            if D is not None:
                y = y + x[b, t] * (D[:, None] if D.dim() == 1 else D)
            if z is not None:
                y = y * F.silu(z[b, t])
            ys.append(y)
        rows.append(torch.stack(ys))
    return torch.stack(rows)
