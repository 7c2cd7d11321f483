"""Slow, obviously-right Mamba1 selective-scan reference: per sample, per token, zero initial state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def naive_selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    seq_idx: Tensor | None = None,
) -> Tensor:
    """``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``, ``y_t = C_t . h_t + D u_t``, ``y *= silu(z)``;
    h = 0 at every sample start. Shapes as :func:`packfree_plugin.ops.selective_scan.selective_scan`."""
    Bsz, Dm, T = u.shape
    N = A.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    Bg = B if B.dim() == 4 else B.unsqueeze(1)  # [B, G, N, T]
    Cg = C if C.dim() == 4 else C.unsqueeze(1)
    per_group = Dm // Bg.shape[1]
    rows = []
    for b in range(Bsz):
        ids = None if seq_idx is None else seq_idx[b].tolist()
        Bt_all = Bg[b].repeat_interleave(per_group, dim=0)  # [D, N, T]
        Ct_all = Cg[b].repeat_interleave(per_group, dim=0)
        h = u.new_zeros(Dm, N)
        ys = []
        for t in range(T):
            if t == 0 or (ids is not None and ids[t] != ids[t - 1]):
                h = u.new_zeros(Dm, N)
            d = delta[b, :, t]
            h = torch.exp(d[:, None] * A) * h + (d * u[b, :, t])[:, None] * Bt_all[:, :, t]
            y = (h * Ct_all[:, :, t]).sum(-1)
            if D is not None:
                y = y + D * u[b, :, t]
            if z is not None:
                y = y * F.silu(z[b, :, t])
            ys.append(y)
        rows.append(torch.stack(ys, dim=-1))
    return torch.stack(rows)
