"""Chunked, boundary-aware gated delta rule in pure PyTorch (any device, differentiable by autograd).

Recurrence (per sample, per head; ``S`` is ``[K, V]``; ``a_t = exp(g_t)`` is a scalar for Gated DeltaNet and a
``[K]`` vector for KDA, scaling the rows of ``S``)::

    S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

Chunk form (chunk of ``C`` tokens entering with state ``S0``; ``G_r`` the in-chunk cumulative log decay up to
and including ``r``)::

    A[r, s]  = beta_r * sum_d k_r[d] k_s[d] exp(G_r[d] - G_s[d])          s < r
    P[r, s]  =          sum_d q_r[d] k_s[d] exp(G_r[d] - G_s[d])          s <= r
    U = (I + A)^-1 (beta * v),   W = (I + A)^-1 (beta * k * exp(G))       (WY / UT transform)
    delta = U - W S0                                                         ("v_new")
    o = (q * exp(G)) S0 + P delta
    S_C = exp(G_last) S0 + (k * exp(G_last - G))^T delta

Every exponent above is <= 0, so nothing overflows. For KDA's per-channel decay ``A`` and ``P`` are built by
recursive halving (see :func:`_per_channel_gram`) so that no ``[C, C, K]`` tensor is ever formed.

Boundaries (no initial states): each row is cut into chunks of ``C`` tokens whatever its samples, so short
samples share chunks and the work is that of the unsplit row. ``G`` restarts at every sample start (a masked
in-chunk sum, so both terms of ``G_r - G_s`` start at the same token, as when the sample runs alone), every
exponent between tokens of different samples is ``-inf`` (``A``, ``P``, ``k`` to the chunk end), and the carried
state reaches only tokens that continue the sample running before the chunk. Rows are reshaped, never
gathered: no host sync and no copy beyond the one layout change stock makes too. With per-sample initial
states, chunks start on sample starts instead (see ``ops/_varlen.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from packfree_plugin.ops._boundary_doc import with_boundary_doc
from packfree_plugin.ops._nonfinite import Quarantine
from packfree_plugin.ops._seq import resolve_seq_idx
from packfree_plugin.ops._varlen import (
    ChunkLayout,
    check_qkv,
    chunk_layout,
    compute_dtype,
    host_offsets,
    row_offsets,
    run_chunk_steps,
)

__all__ = ["chunk_gated_delta_rule_torch", "chunk_kda_torch", "l2norm", "kda_gate"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's in-kernel L2 norm over the last dim: ``x / sqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, *, per_channel: bool) -> torch.Tensor | None:
    """All contract checks (cu_seqlens values only for CPU data: no host sync). Returns ``seq_idx [B, T]`` or None."""
    for name, t in (("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    B, T, H, K, V = check_qkv(q, k, v, initial_state, cu_seqlens, g=g, beta=beta)
    g_shape = (B, T, H, K) if per_channel else (B, T, H)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must have shape {list(g_shape)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape {[B, T, H]}, got {tuple(beta.shape)}")
    return resolve_seq_idx(B, T, q.device, cu_seqlens=cu_seqlens)


def _check_chunking(chunk_size: int, per_channel: bool) -> None:
    if chunk_size < 1 or (per_channel and chunk_size & (chunk_size - 1)):
        kind = "a power of two" if per_channel else "positive"
        raise ValueError(f"chunk_size must be {kind}, got {chunk_size}")


_NEG_INF = float("-inf")


@functools.lru_cache(maxsize=16)
def _above_diagonal(C: int, device: torch.device) -> torch.Tensor:
    """``[C, C]`` bool, True above the diagonal: the pairs ``s > r`` no decay links."""
    return ~torch.ones(C, C, dtype=torch.bool, device=device).tril()


def _scalar_gram(q, k, gc, beta, cut):
    """Scalar decay: ``A`` (strictly lower, beta-scaled) and ``P`` (lower incl. diagonal), ``[M, H, C, C]``.
    ``cut [M, 1, C, C]``: pairs without a decay, above the diagonal or of two samples (None: the whole chunk is
    one sample)."""
    if cut is None:
        cut = _above_diagonal(gc.shape[-1], gc.device)
    decay = torch.exp((gc[..., :, None] - gc[..., None, :]).masked_fill(cut, _NEG_INF))
    P = (q @ k.transpose(-1, -2)) * decay
    A = (k @ k.transpose(-1, -2)) * decay.tril(-1) * beta[..., :, None]
    return A, P


def _lower_left_blocks(blk: torch.Tensor, C: int) -> torch.Tensor:
    """``[M, H, nb, s, s]`` -> ``[M, H, C, C]``: block ``b`` placed at rows ``(2b+1)s..``, cols ``2b s..`` (the
    lower-left quadrant of the ``b``-th ``2s x 2s`` diagonal block), zeros elsewhere."""
    M, H, nb, s, _ = blk.shape
    z = torch.zeros_like(blk)
    parent = torch.cat([torch.cat([z, z], dim=-1), torch.cat([blk, z], dim=-1)], dim=-2)  # [M, H, nb, 2s, 2s]
    eye = torch.eye(nb, dtype=blk.dtype, device=blk.device)[:, None, :, None]
    return (parent[..., :, None, :] * eye).reshape(M, H, C, C)


def _per_channel_gram(q, k, gc, beta, seq):
    """Per-channel decay (KDA): ``A`` and ``P`` as in :func:`_scalar_gram` without any ``[C, C, K]`` tensor.

    Split the chunk in halves, recursively. Every strictly-lower pair ``(r, s)`` lies in exactly one
    (right-half rows x left-half cols) quadrant, and there the boundary ``ref = G[last of left half]`` lies
    between them, so ``exp(G_r - G_s) = exp(G_r - ref) * exp(ref - G_s)`` with both factors <= 1: one
    batched matmul per level, ``log2 C`` levels, and nothing can overflow. The diagonal has no decay.
    ``seq [M, C]`` (or None): samples are contiguous, so ``r`` and ``s`` share a sample exactly when both
    share the ``ref`` token's; other rows and columns get exponent ``-inf`` (exact zeros, finite gradients).
    """
    M, H, C, K = k.shape
    P = torch.diag_embed((q * k).sum(-1))
    A = torch.zeros_like(P)
    half = C // 2
    while half >= 1:
        nb = C // (2 * half)
        g2 = gc.view(M, H, nb, 2, half, K)
        ref = g2[:, :, :, 0, -1:, :]  # [M, H, nb, 1, K]
        to_row, to_col = g2[:, :, :, 1] - ref, ref - g2[:, :, :, 0]  # <= 0 within one sample
        if seq is not None:
            s2 = seq.view(M, 1, nb, 2, half, 1)
            at_ref = s2[:, :, :, 0, -1:]
            to_row = to_row.masked_fill(s2[:, :, :, 1] != at_ref, _NEG_INF)
            to_col = to_col.masked_fill(s2[:, :, :, 0] != at_ref, _NEG_INF)
        row, col = torch.exp(to_row), torch.exp(to_col)
        kcol = (k.view(M, H, nb, 2, half, K)[:, :, :, 0] * col).transpose(-1, -2)
        P = P + _lower_left_blocks((q.view(M, H, nb, 2, half, K)[:, :, :, 1] * row) @ kcol, C)
        A = A + _lower_left_blocks((k.view(M, H, nb, 2, half, K)[:, :, :, 1] * row) @ kcol, C)
        half //= 2
    return A * beta[..., :, None], P


class _UnitLowerInverse(torch.autograd.Function):
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]``: one batched triangular solve forward; the
    backward is two matmuls, ``dA = -tril_{-1}(X^T dX X^T)`` (``X`` the inverse), where autograd's solve backward
    would solve again (measured 3x slower at C = 64)."""

    @staticmethod
    def forward(ctx, A: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        X = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        ctx.save_for_backward(X)
        return X

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (X,) = ctx.saved_tensors
        Xt = X.transpose(-1, -2)
        return (Xt @ grad @ Xt).neg_().tril_(-1)


def _intra_chunk(q, k, v, gc, beta, seq, cut, fresh, not_last, *, per_channel: bool):
    """Everything that is independent per chunk: ``(P, U, W, qg, decay_last, k_end)``.

    Boundaries (all None: every chunk is one sample that continues): ``seq [M, C]`` the sample of every token,
    ``cut [M, 1, C, C]`` the pairs without a decay (:func:`_scalar_gram`), ``fresh [M, C]`` tokens that do not
    continue the sample running before the chunk, ``not_last [M, C]`` tokens of another sample than the chunk's
    last token's.
    """
    expand = (lambda m: m[:, None, :, None]) if per_channel else (lambda m: m[:, None, :])
    gain_exp = gc if fresh is None else gc.masked_fill(expand(fresh), _NEG_INF)
    last = gc[..., -1:, :] if per_channel else gc[..., -1:]
    to_end = last - gc
    if not_last is not None:
        to_end = to_end.masked_fill(expand(not_last), _NEG_INF)
    if per_channel:
        A, P = _per_channel_gram(q, k, gc, beta, seq)
        gain = torch.exp(gain_exp)  # [M, H, C, K]
        k_end = k * torch.exp(to_end)
        decay_last = gain[..., -1:, :].transpose(-1, -2)  # [M, H, K, 1]
    else:
        A, P = _scalar_gram(q, k, gc, beta, cut)
        gain = torch.exp(gain_exp)[..., None]  # [M, H, C, 1]
        k_end = k * torch.exp(to_end)[..., None]
        decay_last = gain[..., -1:, :]  # [M, H, 1, 1]
    qg = q * gain
    kg = k * gain
    # T = (I + A)^-1 once (C right-hand sides), then plain matmuls: on CPU a batched triangular solve against
    # the [C, K + V] right-hand side is ~10x slower than solving against I and multiplying.
    T_inv = _UnitLowerInverse.apply(A)
    T_inv = T_inv * beta[..., None, :]  # fold beta into the right-hand sides' rows
    return P, T_inv @ v, T_inv @ kg, qg, decay_last, k_end


KDA_CHUNKS_PER_BLOCK = 16
"""KDA's per-channel Gram matrices build ``[M, H, C, K]``-sized intermediates at every halving level; computed
16 chunks at a time they stay in cache. Measured (fwd+bwd, 4096 tokens in 16 samples, H=8, K=V=128, 1 thread):
1.07-1.10 s against 1.39-1.44 s all at once. Gated DeltaNet's scalar-decay path is faster all at once (blocks of
16 were 10-15% slower)."""


def _intra_blocks(q, k, v, gc, beta, masks, *, per_channel: bool):
    """:func:`_intra_chunk` over all ``M`` chunks (KDA in blocks of :data:`KDA_CHUNKS_PER_BLOCK`); ``masks``:
    its ``(seq, cut, fresh, not_last)`` (:func:`_row_masks`) or four None."""
    if not per_channel:
        return _intra_chunk(q, k, v, gc, beta, *masks, per_channel=False)
    n = KDA_CHUNKS_PER_BLOCK
    parts = [t.split(n) if t is not None else [None] * (-(-q.shape[0] // n)) for t in (q, k, v, gc, beta, *masks)]
    blocks = [_intra_chunk(*piece, per_channel=True) for piece in zip(*parts)]
    return tuple(torch.cat(part) for part in zip(*blocks))


def _delta_rule_chunks(q, k, v, gc, beta, h0, layout: ChunkLayout, *, per_channel: bool):
    """Core on packed chunks. ``q, k [M, H, C, K]`` (q scaled), ``v [M, H, C, V]``, ``gc`` in-chunk cumulative
    log decay ``[M, H, C]`` or ``[M, H, C, K]``, ``beta [M, H, C]``, ``h0 [N, H, K, V]`` in rank order.
    Returns ``o [M, H, C, V]`` and final states ``[N, H, K, V]`` in rank order."""
    P, U, W, qg, decay_last, k_end = _intra_blocks(q, k, v, gc, beta, (None,) * 4, per_channel=per_channel)
    Vd = v.shape[-1]

    def step(S, u, w, dl, ke):
        v_new = u - w @ S
        S_next = S * dl + ke.transpose(-1, -2) @ v_new
        return S_next, (S, v_new)

    extras, final = run_chunk_steps(layout, h0, step, U, W, decay_last, k_end)
    if not extras:  # no tokens at all
        return q.new_zeros(*q.shape[:-1], Vd), final
    h_before = torch.cat([e[0] for e in extras], dim=0)  # [M, H, K, V]
    v_new = torch.cat([e[1] for e in extras], dim=0)  # [M, H, C, V]
    o = qg @ h_before + P @ v_new
    return o, final


def _to_chunks(x: torch.Tensor, chunk: int, cdt: torch.dtype) -> torch.Tensor:
    """``[B, T, H, *]`` -> ``[B * nc, H, C, *]`` in ``cdt``, zero after the last token: one copy, cast included."""
    B, T, H = x.shape[:3]
    full, rem = divmod(T, chunk)
    nc = full + (rem > 0)
    out = x.new_empty((B, nc, H, chunk, *x.shape[3:]), dtype=cdt)
    dst = out.transpose(2, 3)  # [B, nc, C, H, *] view
    dst[:, :full].copy_(x[:, : full * chunk].view(B, full, chunk, *x.shape[2:]))
    if rem:
        dst[:, full, :rem].copy_(x[:, full * chunk :])
        dst[:, full, rem:].zero_()
    return out.flatten(0, 1)


def _from_chunks(o: torch.Tensor, B: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B * nc, H, C, V]`` -> ``[B, T, H, V]`` in ``dtype``: one copy, cast included."""
    M, H, C, V = o.shape
    out = o.new_empty((B, M // B, C, H, V), dtype=dtype)
    out.copy_(o.view(B, M // B, H, C, V).transpose(2, 3))
    return out.view(B, M // B * C, H, V)[:, :T]


def _row_states(S: torch.Tensor, qg: torch.Tensor, P: torch.Tensor, U: torch.Tensor, W: torch.Tensor,
                decay_last: torch.Tensor, k_end: torch.Tensor, B: int, *, keep: bool
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunk-to-chunk state recurrence of every row and the output of every chunk: ``qg, U, W, k_end``
    ``[B*nc, H, C, *]``, ``P [B*nc, H, C, C]``, ``decay_last [B*nc, H, K or 1, 1]``, ``S [B, H, K, V]`` zeros.
    Returns ``o [B*nc, H, C, V]``, every row's end state ``[B, H, K, V]`` and, if ``keep``, the state entering
    every chunk ``[B*nc, H, K, V]`` and ``v_new [B*nc, H, C, V]`` (else None). Each chunk's output is taken in
    the loop from the state backward keeps anyway: no stacked copy of the states is saved."""
    entering, news, outs = [], [], []
    # unbind, not indexing: the backward stacks once instead of scattering into nc zero tensors
    for q_c, p_c, u, w, dl, ke in zip(*(t.unflatten(0, (B, -1)).unbind(1) for t in (qg, P, U, W, decay_last, k_end))):
        v = u - w @ S
        outs.append(q_c @ S + p_c @ v)
        if keep:
            entering.append(S)
            news.append(v)
        S = S * dl + ke.transpose(-1, -2) @ v
    o = torch.stack(outs, 1).flatten(0, 1)
    if not keep:
        return o, S, None
    return o, S, (torch.stack(entering, 1).flatten(0, 1), torch.stack(news, 1).flatten(0, 1))


def _sample_end_states(cu_seqlens: torch.Tensor, seq: torch.Tensor, cont: torch.Tensor, gc: torch.Tensor,
                       kc: torch.Tensor, v_new: torch.Tensor, h_before: torch.Tensor, *, per_channel: bool
                       ) -> torch.Tensor:
    """Final state of every sample of a flattened row (B == 1): its chunk's entering state decayed to the sample's
    last token plus that chunk's tokens of the sample. ``seq/cont [M, C]``, ``gc [M, H, C(, K)]``,
    ``kc [M, H, C, K]``, ``v_new [M, H, C, V]``, ``h_before [M, H, K, V]``. Returns ``[N, H, K, V]``."""
    C = seq.shape[1]
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    end = (cu[1:] - 1).clamp(min=0)
    m, p = end // C, end % C
    sample = torch.arange(N, device=seq.device)
    G = gc[m]  # [N, H, C(, K)]
    G_end = G[sample, :, p]  # [N, H(, K)]
    mine = (seq[m] == sample[:, None]) & (torch.arange(C, device=seq.device) <= p[:, None])  # [N, C]
    mine = mine[:, None, :, None] if per_channel else mine[:, None, :]
    to_end = (G_end.unsqueeze(2) - G).masked_fill(~mine, _NEG_INF)
    k_end = kc[m] * (torch.exp(to_end) if per_channel else torch.exp(to_end)[..., None])
    start_gain = torch.exp(G_end.masked_fill(~cont[m, p].view(N, *[1] * (G_end.dim() - 1)), _NEG_INF))
    start_gain = start_gain[..., None] if per_channel else start_gain[..., None, None]
    S = start_gain * h_before[m] + k_end.transpose(-1, -2) @ v_new[m]
    return torch.where((cu[1:] > cu[:-1]).view(N, 1, 1, 1), S, torch.zeros_like(S))


def _row_masks(seq_idx: torch.Tensor, cu_seqlens: torch.Tensor | None, C: int, cdt: torch.dtype
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``((seq, cut, fresh, not_last), cont [M, C], same [M, 1, C, C])`` for rows cut into chunks of ``C``: the
    boundary masks of :func:`_intra_chunk` (padding slots join the row's last sample), whether a token continues
    the sample running before its chunk, and the in-chunk causal same-sample matrix in ``cdt``. Kept on
    ``cu_seqlens`` (every layer of a forward passes the same tensor), so they are built once per forward, not
    once per layer or call."""
    key = (tuple(seq_idx.shape), C, cdt, None if cu_seqlens is None else cu_seqlens._version)
    cache = {} if cu_seqlens is None else cu_seqlens.__dict__.setdefault("_packfree_gdn_masks", {})
    if key not in cache:
        B, T = seq_idx.shape
        pad = -T % C
        seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], 1) if pad else seq_idx
        seq = seq.reshape(-1, C)
        before = torch.cat([torch.full_like(seq[:1, :1], -1), seq[:-1, -1:]]).view(B, -1)
        before[:, 0] = -1  # sample of the token before each chunk: none for a row's first chunk
        cont = seq == before.reshape(-1, 1)
        causal = torch.ones(C, C, dtype=torch.bool, device=seq.device).tril()
        same_bool = (seq[:, :, None] == seq[:, None, :]) & causal
        masks = (seq, ~same_bool[:, None], ~cont, seq != seq[:, -1:])
        cache.clear()
        cache[key] = (masks, cont, same_bool.to(cdt)[:, None])
    return cache[key]


def _prepare(q: torch.Tensor, k: torch.Tensor, scale: float, use_qk_l2norm_in_kernel: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional L2 norm of ``q, k [..., K]`` over K, then ``q * scale``."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def _run_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              seq_idx: torch.Tensor | None, *, scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              cu_seqlens: torch.Tensor | None, chunk_size: int, per_channel: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No initial states: rows cut into fixed chunks, boundaries inside chunks (module docstring). Shapes as
    :func:`chunk_gated_delta_rule_torch` / :func:`chunk_kda_torch`; ``seq_idx [B, T]`` or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    cdt = compute_dtype(q.dtype)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if T == 0:
        final = q.new_zeros(N, H, K, V, dtype=cdt) if output_final_state else None
        return v.new_empty(B, 0, H, V), final
    C = chunk_size
    qc, kc = _prepare(_to_chunks(q, C, cdt), _to_chunks(k, C, cdt), scale, use_qk_l2norm_in_kernel)
    vc, bc, g_c = (_to_chunks(t, C, cdt) for t in (v, beta, g))
    if seq_idx is None:
        seq = cont = None
        masks = (None,) * 4
        gc = g_c.cumsum(dim=2)
    else:
        masks, cont, same = _row_masks(seq_idx, cu_seqlens, C, cdt)
        seq = masks[0]
        # cumulative log decay restarted at every sample start: both ends of G_r - G_s sum from the same token
        gc = same @ g_c if per_channel else (same @ g_c[..., None]).squeeze(-1)
    P, U, W, qg, decay_last, k_end = _intra_blocks(qc, kc, vc, gc, bc, masks, per_channel=per_channel)
    per_sample_ends = output_final_state and cu_seqlens is not None
    o, S, kept = _row_states(qc.new_zeros(B, H, K, V), qg, P, U, W, decay_last, k_end, B, keep=per_sample_ends)
    final = S if output_final_state else None
    if per_sample_ends:
        h_before, v_new = kept
        final = _sample_end_states(cu_seqlens, seq, cont, gc, kc, v_new, h_before, per_channel=per_channel)
    return _from_chunks(o, B, T, q.dtype), final


def _run_layout(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size, per_channel):
    """Per-sample initial states: chunks start on sample starts (one host sync for the offsets)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    offsets = host_offsets(cu_seqlens, batch=B, total=T, device=q.device) if cu_seqlens is not None else row_offsets(B, T)
    cdt = compute_dtype(q.dtype)
    layout = chunk_layout(offsets, chunk_size, q.device)

    def flat(x):  # [B, T, ...] -> [B*T, ...] in compute dtype
        return x.reshape(B * T, *x.shape[2:]).to(cdt)

    qf, kf = _prepare(flat(q), flat(k), scale, use_qk_l2norm_in_kernel)
    # Pack to [M, C, H, ...] then heads first: [M, H, C, ...].
    qc = layout.pack(qf).transpose(1, 2)
    kc = layout.pack(kf).transpose(1, 2)
    vc = layout.pack(flat(v)).transpose(1, 2)
    bc = layout.pack(flat(beta)).transpose(1, 2)
    gc = layout.pack(flat(g)).transpose(1, 2).cumsum(dim=2)
    h0 = layout.to_rank_order(initial_state.to(cdt))
    o, final = _delta_rule_chunks(qc, kc, vc, gc, bc, h0, layout, per_channel=per_channel)
    o = layout.unpack(o.transpose(1, 2)).view(B, T, H, V).to(q.dtype)
    final = layout.to_sample_order(final) if output_final_state else None
    return o, final


def _run(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         chunk_size, per_channel):
    seq_idx = _validate(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=per_channel)
    _check_chunking(chunk_size, per_channel)
    options = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   per_channel=per_channel)
    if seq_idx is None:  # one sample per row: no two samples share a chunk or a state
        return _run_chunked(q, k, v, g, beta, seq_idx, initial_state, options)
    # a sample with a NaN/inf input or initial state computes on zeros and returns NaN (ops/_nonfinite.py)
    quarantine = Quarantine(seq_idx, [(t, 1) for t in (q, k, v, g, beta)], initial_state)
    q, k, v, g, beta = quarantine.clean()
    o, final = _run_chunked(q, k, v, g, beta, seq_idx, quarantine.clean_state(initial_state), options)
    return quarantine.mark(o), quarantine.mark_states(final, cu_seqlens)


def _run_chunked(q, k, v, g, beta, seq_idx, initial_state, options):
    """Rows cut into fixed chunks without initial states, else chunks aligned on sample starts."""
    if initial_state is None:
        return _run_rows(q, k, v, g, beta, seq_idx, **options)
    return _run_layout(q, k, v, g, beta, initial_state=initial_state, **options)


@with_boundary_doc
def chunk_gated_delta_rule_torch(
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5), chunked, pure PyTorch; semantics of fla's ``chunk_gated_delta_rule``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H]`` log decay (``<= 0``). beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]`` (float32, float64 for float64 input).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
        {cu_seqlens}
        chunk_size: tokens per chunk (64 as in fla).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                per_channel=False)


@with_boundary_doc
def chunk_kda_torch(
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
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (per-channel decay), chunked, pure PyTorch; semantics of fla's ``chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H, K]`` per-channel log decay, or the raw gate input when ``use_gate_in_kernel``.
        beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]`` (float32, float64 for float64 input).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        use_gate_in_kernel: compute the decay as ``-exp(A_log[h]) * softplus(g + dt_bias)`` (then ``A_log [H]``
            is required, ``dt_bias [H*K]`` optional).
        {cu_seqlens}
        chunk_size: tokens per chunk (a power of two: the per-channel Gram matrices are built by halving).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True requires A_log")
        if g.dim() != 4:
            raise ValueError(f"g must have shape [B, T, H, K], got {tuple(g.shape)}")
        g = kda_gate(g, A_log, dt_bias)
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                per_channel=True)
