"""Slow, obviously-right reference: loop over samples, loop over tokens::

    S = exp(g_t + g_gamma) * S + k_t v_t^T
    o_t = S^T (scale * q_t)
"""

from __future__ import annotations

import torch

from .._reference import accumulation_dtype, sample_spans

__all__ = ["naive_linear_attention"]


def naive_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token reference for :func:`packfree_plugin.ops.linear_attention.fast.chunk_linear_attention`
    (same arguments and shapes)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = accumulation_dtype(q.dtype)
    q, k, v = (x.reshape(B * T, H, -1).to(cdt) for x in (q, k, v))
    lam = g.reshape(B * T, H).to(cdt) if g is not None else q.new_zeros(B * T, H)
    if g_gamma is not None:
        lam = lam + g_gamma.to(cdt)
    outs, finals = [], []
    for i, (start, end) in enumerate(sample_spans(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(cdt)
        for t in range(start, end):
            S = torch.exp(lam[t])[:, None, None] * S + torch.einsum("hk,hv->hkv", k[t], v[t])
            outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
        finals.append(S)
    o = torch.stack(outs).view(B, T, H, V) if outs else q.new_zeros(B, T, H, V)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)
