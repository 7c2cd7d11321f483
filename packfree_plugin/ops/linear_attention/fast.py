"""Chunked, boundary-aware decay-gated linear attention in pure PyTorch (any device, autograd).

Recurrence (per sample, per head; ``S`` is ``[K, V]``; ``lam_t = g_t + g_gamma`` is a scalar log decay)::

    S_t = exp(lam_t) S_{t-1} + k_t v_t^T
    o_t = S_t^T (scale * q_t)

This is MiniMax's lightning attention (``g_gamma = -slope_h`` per head, ``scale = 1``), fla's
``chunk_simple_gla`` (scalar data-dependent gate ``g``), RetNet-style constant decay, and plain causal linear
attention (no decay). Chunk form (``G_r`` = in-chunk cumulative log decay, all exponents <= 0)::

    o = (q * exp(G)) S0 + (q k^T * exp(G_r - G_s) [s <= r]) v
    S_C = exp(G_last) S0 + (k * exp(G_last - G))^T v

where every ``G_r - G_s`` is summed over the tokens it spans, not subtracted (fp32 keeps a sequential
recurrence's precision).

Boundaries as in the gated delta family: chunks start on sample starts, the intra-chunk part runs for every
chunk of every sample at once, the state recurrence loops over chunk steps with per-sample reset.
"""

from __future__ import annotations

from .._boundary_doc import with_boundary_doc

import torch

from .._nonfinite import Quarantine
from .._seq import resolve_seq_idx
from .._chunk_layout import (
    chunk_layout,
    compute_dtype,
    run_chunk_steps,
    validate_qkv,
)

__all__ = ["chunk_linear_attention"]


def _validate(q, k, v, g, g_gamma, initial_state, cu_seqlens):
    offsets, (B, T, H, K, V) = validate_qkv(q, k, v, initial_state, cu_seqlens, g=g, g_gamma=g_gamma)
    if g is not None and tuple(g.shape) != (B, T, H):
        raise ValueError(f"g must have shape {[B, T, H]}, got {tuple(g.shape)}")
    if g_gamma is not None and tuple(g_gamma.shape) != (H,):
        raise ValueError(f"g_gamma must have shape [H] = [{H}], got {tuple(g_gamma.shape)}")
    return offsets, (B, T, H, K, V)


@with_boundary_doc
def chunk_linear_attention(
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decay-gated causal linear attention with per-sample state reset (fla ``chunk_simple_gla`` semantics).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H]`` data-dependent log decay, or None.
        g_gamma: ``[H]`` constant per-head log decay added to ``g`` (MiniMax: ``-slope_rate``), or None.
        scale: query scale, default ``K ** -0.5`` (MiniMax uses 1.0).
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]`` (float32, float64 for float64 input).
        {cu_seqlens}
        chunk_size: tokens per chunk.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    offsets, (B, T, H, K, V) = _validate(q, k, v, g, g_gamma, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if cu_seqlens is None:  # one sample per row: no two samples share a chunk or a state
        return _chunked(q, k, v, g, g_gamma, scale, initial_state, output_final_state, offsets, chunk_size)
    # a sample with a NaN/inf input or initial state computes on zeros and returns NaN (ops/_nonfinite.py)
    seq_idx = resolve_seq_idx(B, T, q.device, cu_seqlens=cu_seqlens, validate=False)
    quarantine = Quarantine(seq_idx, [(t, 1) for t in (q, k, v, g)], initial_state)
    q, k, v, g = quarantine.clean()
    o, final = _chunked(q, k, v, g, g_gamma, scale, quarantine.clean_state(initial_state), output_final_state,
                        offsets, chunk_size)
    return quarantine.mark(o), quarantine.mark_states(final, cu_seqlens)


def _chunked(q, k, v, g, g_gamma, scale, initial_state, output_final_state, offsets, chunk_size):
    """The chunked computation of :func:`chunk_linear_attention` (arguments checked, ``offsets`` on the host)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cdt = compute_dtype(q.dtype)
    layout = chunk_layout(offsets, chunk_size, q.device)
    N, C = layout.num_samples, chunk_size

    def packed(x):  # [B, T, ...] -> [M, H, C, ...] in compute dtype
        return layout.pack(x.reshape(B * T, *x.shape[2:]).to(cdt)).transpose(1, 2)

    qc, kc, vc = packed(q) * scale, packed(k), packed(v)
    M = layout.num_chunks
    lam = packed(g) if g is not None else qc.new_zeros(M, H, C)
    if g_gamma is not None:
        # Constant decay applies to real tokens only: padding slots must not decay the carried state.
        real = layout.pack(torch.ones(B * T, 1, dtype=cdt, device=q.device)).view(M, 1, C)
        lam = lam + g_gamma.to(cdt).view(1, H, 1) * real
    # seg[r, s] = sum_{s < j <= r} lam_j summed pair by pair, never as G_r - G_s: that difference of two large
    # cumulative sums loses |G| * eps of every decay (5x a sequential fp32 recurrence's error at strong decay)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    seg = lam[..., :, None].expand(*lam.shape, C).masked_fill(~strict, 0.0).cumsum(dim=-2)
    decay = torch.exp(seg.masked_fill_(~incl, float("-inf")))  # [M, H, C, C]
    G = seg[..., :, 0] + lam[..., :1]  # [M, H, C] cumulative log decay from the chunk start
    o_intra = ((qc @ kc.transpose(-1, -2)) * decay) @ vc
    dS = (kc * decay[..., -1, :, None]).transpose(-1, -2) @ vc  # [M, H, K, V]: decay[-1, s] = exp(G_last - G_s)
    decay_last = torch.exp(G[..., -1:])[..., None]  # [M, H, 1, 1]

    def step(S, dl, ds):
        return S * dl + ds, S

    h0 = qc.new_zeros(N, H, K, V) if initial_state is None else layout.to_rank_order(initial_state.to(cdt))
    extras, final = run_chunk_steps(layout, h0, step, decay_last, dS)
    if extras:
        h_before = torch.cat(extras, dim=0)
        o = (qc * torch.exp(G)[..., None]) @ h_before + o_intra
    else:
        o = o_intra
    o = layout.unpack(o.transpose(1, 2)).view(B, T, H, V).to(q.dtype)
    return o, (layout.to_sample_order(final) if output_final_state else None)
