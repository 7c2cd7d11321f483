"""Slow, obviously-right references: one Python loop over samples, one over tokens.

Per sample and head (``S`` is ``[K, V]``; ``g_t`` is a scalar for Gated DeltaNet, a ``[K]`` vector for KDA)::

    S = exp(g_t) * S                      # decay (rows of S for KDA)
    S = S + beta_t * k_t (v_t - S^T k_t)^T  # delta rule
    o_t = S^T (scale * q_t)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._reference import accumulation_dtype, sample_spans

__all__ = ["naive_gated_delta_rule", "naive_kda"]


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule. ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H]`` or
    ``[B, T, H, K]`` (log decay), ``beta [B, T, H]``, ``initial_state [N, H, K, V]``; cu_seqlens as in
    :func:`packfree_plugin.ops.gated_delta.fast.chunk_gated_delta_rule_torch`. Returns
    ``(o [B, T, H, V], final [N, H, K, V] | None)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = accumulation_dtype(q.dtype)
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]).to(cdt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:  # fla's in-kernel norm: x / sqrt(sum(x^2) + 1e-6)
        q, k = (x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6) for x in (q, k))
    outs, finals = [], []
    for i, (start, end) in enumerate(sample_spans(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(cdt)
        for t in range(start, end):
            decay = torch.exp(g[t])  # [H] or [H, K]
            S = S * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            pred = torch.einsum("hk,hkv->hv", k[t], S)
            S = S + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - pred))
            outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
        finals.append(S)
    o = torch.stack(outs).view(B, T, H, V) if outs else q.new_zeros(B, T, H, V)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)


def naive_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (per-channel ``g [B, T, H, K]``), optionally with the in-kernel gate
    ``-exp(A_log[h]) * softplus(g + dt_bias[h, k])`` (``A_log [H]``, ``dt_bias [H*K]`` or None)."""
    if use_gate_in_kernel:
        H, K = g.shape[-2:]
        cdt = accumulation_dtype(g.dtype)
        shifted = g.to(cdt) if dt_bias is None else g.to(cdt) + dt_bias.to(cdt).reshape(H, K)
        g = -A_log.to(cdt).reshape(H, 1).exp() * F.softplus(shifted)
    return naive_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
