"""Chunks aligned on sample starts, for per-sample initial states: every sample is cut into its own chunks
(:class:`packfree_plugin.ops._chunk_layout.ChunkLayout`, one host sync for the offsets) and the state recurrence
steps through them longest sample first."""

from __future__ import annotations

import torch

from .._chunk_layout import ChunkLayout, chunk_layout, compute_dtype, host_offsets, row_offsets, run_chunk_steps
from .intra_chunk import intra_blocks
from .stacked import unstack_chunks

__all__ = ["run_sample_chunks"]


def _delta_rule_chunks(q, k, v, gc, beta, h0, layout: ChunkLayout, *, per_channel: bool):
    """Core on packed chunks. ``q, k [M, H, C, K]`` (q scaled), ``v [M, H, C, V]``, ``gc`` in-chunk cumulative
    log decay ``[M, H, C]`` or ``[M, H, C, K]``, ``beta [M, H, C]``, ``h0 [N, H, K, V]`` in rank order.
    Returns ``o [M, H, C, V]`` and final states ``[N, H, K, V]`` in rank order."""
    P, U, W, qg, decay_last, k_end = intra_blocks(q, k, v, gc, beta, (None,) * 4, per_channel=per_channel)
    Vd = v.shape[-1]

    def step(S, u, w, dl, ke_t):
        v_new = u - w @ S
        S_next = S * dl + ke_t @ v_new
        return S_next, (S, v_new)

    extras, final = run_chunk_steps(layout, h0, step, U, W, decay_last, k_end)
    if not extras:  # no tokens at all
        return q.new_zeros(*q.shape[:-1], Vd), final
    h_before = torch.cat([e[0] for e in extras], dim=0)  # [M, H, K, V]
    v_new = torch.cat([e[1] for e in extras], dim=0)  # [M, H, C, V]
    o = qg @ h_before + P @ v_new
    return o, final


def run_sample_chunks(x, *, head_dims, dtype, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      cu_seqlens, chunk_size, per_channel):
    """Per-sample initial states: chunks start on sample starts (one host sync for the offsets). ``x`` as in
    :func:`packfree_plugin.ops.gated_delta.row_chunks.run_row_chunks`."""
    B, T, H = x.shape[:3]
    K, V = head_dims
    if cu_seqlens is None:
        offsets = row_offsets(B, T)
    else:
        offsets = host_offsets(cu_seqlens, batch=B, total=T, device=x.device)
    cdt = compute_dtype(dtype)
    layout = chunk_layout(offsets, chunk_size, x.device)
    # [B, T, H, D] -> [M, C, H, D] -> heads first [M, H, C, D]
    xc = layout.pack(x.reshape(B * T, H, -1).to(cdt)).transpose(1, 2)
    qc, kc, vc, g_c, bc = unstack_chunks(xc, K, V, scale=scale, per_channel=per_channel,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    h0 = layout.to_rank_order(initial_state.to(cdt))
    o, final = _delta_rule_chunks(qc, kc, vc, g_c.cumsum(dim=2), bc, h0, layout, per_channel=per_channel)
    o = layout.unpack(o.transpose(1, 2)).view(B, T, H, V).to(dtype)
    final = layout.to_sample_order(final) if output_final_state else None
    return o, final

