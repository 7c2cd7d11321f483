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
state reaches only tokens that continue the sample running before the chunk. Rows are stacked and reshaped,
never gathered: no host sync, and two copies of the inputs (all five stacked in one tensor, then one chunk
layout), as stock's transpose and pad. With per-sample initial states, chunks start on sample starts instead
(see ``ops/_varlen.py``).

At small widths the cost is the number of ops, not their work: inputs travel as one tensor, the state
recurrence runs fused 3-d products per step, and the right-hand sides of the triangular solve are solved in one.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import numpy
import torch
from torch.autograd.function import once_differentiable

from ...boundaries import host_of, memo
from .._boundary_doc import with_boundary_doc
from .._kept import kept_per_mode
from .._nonfinite import Quarantine
from .._seq import resolve_seq_idx
from .gates import kda_gate, l2norm
from .._chunk_layout import (
    ChunkLayout,
    check_qkv,
    chunk_layout,
    compute_dtype,
    host_offsets,
    row_offsets,
    run_chunk_steps,
)

__all__ = ["chunk_gated_delta_rule_torch", "chunk_kda_torch", "l2norm", "kda_gate"]


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, *, per_channel: bool, validate: bool | None = None
              ) -> torch.Tensor | None:
    """All contract checks (cu_seqlens values as ``validate`` says: by default only for CPU data, no host sync).
    Returns ``seq_idx [B, T]`` or None."""
    for name, t in (("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    B, T, H, K, V = check_qkv(q, k, v, initial_state, cu_seqlens, g=g, beta=beta)
    g_shape = (B, T, H, K) if per_channel else (B, T, H)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must have shape {list(g_shape)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape {[B, T, H]}, got {tuple(beta.shape)}")
    return resolve_seq_idx(B, T, q.device, cu_seqlens=cu_seqlens, validate=validate)


def _check_chunking(chunk_size: int, per_channel: bool) -> None:
    if chunk_size < 1 or (per_channel and chunk_size & (chunk_size - 1)):
        kind = "a power of two" if per_channel else "positive"
        raise ValueError(f"chunk_size must be {kind}, got {chunk_size}")


_NEG_INF = float("-inf")


@kept_per_mode(maxsize=16)
def _above_diagonal(C: int, device: torch.device) -> torch.Tensor:
    """``[C, C]`` bool, True above the diagonal: the pairs ``s > r`` no decay links."""
    return ~torch.ones(C, C, dtype=torch.bool, device=device).tril()


def _scalar_gram(q, k, gc, beta, cut):
    """Scalar decay: ``A`` (beta-scaled, strictly lower part used) and ``P`` (lower incl. diagonal),
    ``[M, H, C, C]``. ``cut [M, 1, C, C]``: pairs without a decay, above the diagonal or of two samples (None: the
    whole chunk is one sample). ``A``'s diagonal is left in: the unit-triangular solve never reads it."""
    if cut is None:
        cut = _above_diagonal(gc.shape[-1], gc.device)
    decay = torch.exp((gc[..., :, None] - gc[..., None, :]).masked_fill(cut, _NEG_INF))
    P = _batched_gram(q, k) * decay
    A = _batched_gram(k, k) * (decay * beta[..., :, None])
    return A, P


def _batched_gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` for ``a, b [M, H, C, K]`` as one 3-d ``bmm`` (``@`` on 4-d operands adds an expand and a view per
    operand, which at small widths cost as much as the product)."""
    M, H, C, K = a.shape
    return torch.bmm(a.reshape(M * H, C, K), b.reshape(M * H, C, K).transpose(1, 2)).view(M, H, C, C)


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
    """``(I + tril_{-1}(A))^-1`` for ``A [..., C, C]`` (its diagonal and upper triangle are never read): one batched
    unit-triangular solve forward; the backward is two matmuls, ``dA = -tril_{-1}(X^T dX X^T)`` (``X`` the
    inverse), where autograd's solve backward would solve again (measured 3x slower at C = 64)."""

    @staticmethod
    def forward(ctx, A: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        X = torch.linalg.solve_triangular(A, eye.expand_as(A), upper=False, unitriangular=True)
        ctx.save_for_backward(X)
        return X

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (X,) = ctx.saved_tensors
        Xt = X.transpose(-1, -2)
        return (Xt @ grad @ Xt).neg_().tril_(-1)


def _intra_chunk(q, k, v, gc, beta, seq, cut, fresh, not_last, *, per_channel: bool):
    """Everything that is independent per chunk: ``(P, U, W, qg, decay_last, k_end_t)``, ``k_end_t [M, H, K, C]``
    (transposed: the state update's left operand).

    Boundaries (all None: every chunk is one sample that continues): ``seq [M, C]`` the sample of every token,
    ``cut [M, 1, C, C]`` the pairs without a decay (:func:`_scalar_gram`), ``fresh [M, 1, C]`` tokens that do not
    continue the sample running before the chunk, ``not_last [M, 1, C]`` tokens of another sample than the
    chunk's last token's.
    """
    expand = (lambda m: m[..., None]) if per_channel else (lambda m: m)
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
    U, W = _unit_lower_solve(A, beta, v, k, gain)
    return P, U, W, q * gain, decay_last, k_end.transpose(-1, -2)


def _unit_lower_solve(A: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None,
                      gain: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``U = T beta v`` and ``W = T beta (k * gain)`` with ``T = (I + tril_{-1}(A))^-1``: ``A [M, H, C, C]``,
    ``beta [M, H, C]``, ``v [M, H, C, V]``, ``k [M, H, C, K]``, ``gain [M, H, C, 1 or K]``; ``k=None``: ``U``
    alone (W None).

    A batched triangular solve on CPU costs in proportion to its right-hand-side columns (~2 us per column of a
    64 x 64 system), a matmul far less. Against ``K + V <= C`` columns one solve, forward and backward, is
    cheapest (small widths: 1.6x faster at ``C = 64, K + V = 32``); against more, solving once against ``I``
    and multiplying (1.7x faster at ``K + V = 256``), with beta on ``T``'s columns so that autograd keeps no
    scaled copy of ``v``."""
    V = v.shape[-1]
    Kw = 0 if k is None else k.shape[-1]
    if V + Kw <= A.shape[-1]:
        b = beta[..., None]
        rhs = v * b if k is None else torch.cat([v * b, k * (gain * b)], dim=-1)
        X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        return (X, None) if k is None else tuple(X.split([V, Kw], -1))
    T_beta = _UnitLowerInverse.apply(A) * beta[..., None, :]
    return T_beta @ v, None if k is None else T_beta @ (k * gain)


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


def _stack_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                  per_channel: bool) -> torch.Tensor:
    """``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H(, K)]``, ``beta [B, T, H]`` -> one
    ``[B, T, H, 2K + V + (K or 1) + 1]`` tensor in their promoted dtype: the non-finite quarantine and the chunk
    layout are then one op each, not one per input (at small widths the op count is the cost)."""
    return torch.cat([q, k, v, g if per_channel else g[..., None], beta[..., None]], dim=-1)


@kept_per_mode(maxsize=16)
def _row_scales(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[2, 1]``: ``scale`` for the q row, 1 for the k row of a joint ``[..., 2, K]`` normalisation."""
    return torch.tensor([[scale], [1.0]], dtype=dtype, device=device)


def _unstack_chunks(x: torch.Tensor, K: int, V: int, *, scale: float, use_qk_l2norm_in_kernel: bool,
                    per_channel: bool) -> tuple[torch.Tensor, ...]:
    """``x [M, H, C, D]`` (:func:`_stack_inputs`' layout, chunked) -> ``q`` (L2-normalised if asked, times
    ``scale``), ``k [M, H, C, K]``, ``v [M, H, C, V]``, ``g [M, H, C(, K)]``, ``beta [M, H, C]``; views of ``x``
    where no op is needed. The L2 norm (``x / sqrt(sum(x^2) + 1e-6)``, fla's) finds q's and k's factors in one
    reduction, then scales each apart: contiguous q and k (KDA's strided reads of a joint product cost 4%)."""
    # one split, whatever is used: its backward writes the gradient of x in one op, where views read apart would
    # each zero-fill a gradient of x's size to be added up
    Kg = K if per_channel else 1
    if use_qk_l2norm_in_kernel:
        qk, v, g, beta = x.split([2 * K, V, Kg, 1], dim=-1)
        qk = qk.unflatten(-1, (2, K))
        factor = torch.rsqrt((qk * qk).sum(dim=-1, keepdim=True) + 1e-6) * _row_scales(scale, x.dtype, x.device)
        q, k = (t * f for t, f in zip(qk.unbind(-2), factor.unbind(-2)))
    else:
        q, k, v, g, beta = x.split([K, K, V, Kg, 1], dim=-1)
        q = q * scale
    return q, k, v, g if per_channel else g.squeeze(-1), beta.squeeze(-1)


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous, in one copy (``to`` alone keeps a permuted layout when no cast is due)."""
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


def _chunked(x: torch.Tensor, chunk: int, cdt: torch.dtype) -> torch.Tensor:
    """:class:`_ToChunks`' forward (what runs alone where no gradient is recorded: no graph node to build)."""
    B, T, H, D = x.shape
    full, rem = divmod(T, chunk)
    nc = full + (rem > 0)
    out = x.new_empty((nc, B, H, chunk, D), dtype=cdt)
    dst = out.permute(1, 0, 3, 2, 4)  # [B, nc, C, H, D] view
    dst[:, :full].copy_(x[:, : full * chunk].reshape(B, full, chunk, H, D))
    if rem:
        dst[:, full, :rem].copy_(x[:, full * chunk :])
        dst[:, full, rem:].zero_()
    return out.view(nc * B, H, chunk, D)


class _ToChunks(torch.autograd.Function):
    """``[B, T, H, D]`` -> ``[nc * B, H, C, D]`` in ``cdt``, chunk-major (chunk ``c`` of row ``b`` at ``c * B + b``:
    one step of the state recurrence is one contiguous slice), zero after the last token: one copy, cast and
    padding included. The backward is one copy too, and returns the gradient contiguous in ``x``'s layout and
    dtype (autograd's own would hand the caller a permuted view, and the caller's reductions over it would sum
    in another order than over a compiled step's contiguous gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: int, cdt: torch.dtype) -> torch.Tensor:
        ctx.layout = (x.shape[0], x.shape[1], chunk, x.dtype)
        return _chunked(x, chunk, cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        B, T, chunk, dtype = ctx.layout
        full, rem = divmod(T, chunk)
        M, H, C, D = grad.shape
        src = grad.view(M // B, B, H, C, D).permute(1, 0, 3, 2, 4)  # [B, nc, C, H, D]
        out = grad.new_empty((B, T, H, D), dtype=dtype)
        out[:, : full * chunk].view(B, full, chunk, H, D).copy_(src[:, :full])
        if rem:
            out[:, full * chunk :].copy_(src[:, full, :rem])
        return out, None, None


def _from_chunks(o: torch.Tensor, B: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``[nc * B, H, C, V]`` chunk-major -> ``[B, T, H, V]`` in ``dtype``: one copy, cast included."""
    M, H, C, V = o.shape
    out = _contiguous_as(o.view(M // B, B, H, C, V).permute(1, 0, 3, 2, 4), dtype)
    return out.view(B, M // B * C, H, V)[:, :T]


def _row_states(qg: torch.Tensor, P: torch.Tensor, U: torch.Tensor, W: torch.Tensor, decay_last: torch.Tensor,
                k_end_t: torch.Tensor, B: int, *, end_state: bool, keep: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunk-to-chunk state recurrence of every row and the output of every chunk, chunk-major: ``qg, U, W``
    ``[M, H, C, *]``, ``P [M, H, C, C]``, ``decay_last [M, H, K or 1, 1]``, ``k_end_t [M, H, K, C]``.

    Returns ``o [M, H, C, V]``, every row's end state ``[B, H, K, V]`` if ``end_state`` (else None) and, if
    ``keep``, the state entering every chunk ``[M, H, K, V]`` and ``v_new [M, H, C, V]`` (else None). A step is
    the ``B`` chunks at one position, as 3-d products over ``B * H`` (fused multiply-adds); a row's first chunk
    enters with a zero state, so it reads none. Each chunk's output is taken in the loop from the state backward
    keeps anyway: no stacked copy of the states is saved."""
    M, H, C, V = U.shape
    K = W.shape[-1]
    nc = M // B
    steps = zip(*(t.reshape(nc, B * H, *t.shape[2:]).unbind(0) for t in (qg, P, U, W, decay_last, k_end_t)))
    S = None
    outs, entering, news = [], [], []
    for c, (q_c, p_c, u, w, dl, ke_t) in enumerate(steps):
        if S is None:  # a row's first chunk: zero state (a copy: a view would keep all of U alive for backward)
            v = u.clone()
            outs.append(torch.bmm(p_c, v))
        else:
            v = torch.baddbmm(u, w, S, alpha=-1.0)
            outs.append(torch.baddbmm(torch.bmm(q_c, S), p_c, v))
        if keep:
            entering.append(u.new_zeros(B * H, K, V) if S is None else S)
            news.append(v)
        if c + 1 < nc or end_state:
            S = torch.bmm(ke_t, v) if S is None else torch.baddbmm(S * dl, ke_t, v)
    o = torch.stack(outs).view(M, H, C, V)
    end = S.view(B, H, K, V) if end_state else None
    if not keep:
        return o, end, None
    return o, end, (torch.stack(entering).view(M, H, K, V), torch.stack(news).view(M, H, C, V))


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


@functools.lru_cache(maxsize=16)
def _host_causal(C: int) -> numpy.ndarray:
    """``[C, C]`` bool numpy, True on and below the diagonal."""
    return numpy.tri(C, dtype=bool)


def _mask_arrays(seq_idx: torch.Tensor | numpy.ndarray, C: int, causal: torch.Tensor | numpy.ndarray) -> tuple:
    """:func:`_row_masks`' ``(seq, cut, fresh, not_last, cont, same)`` (``same`` bool) from ``seq_idx [B, T]``, in
    torch or numpy alike (whichever ``seq_idx`` is); ``causal [C, C]`` True on and below the diagonal."""
    xp = numpy if isinstance(seq_idx, numpy.ndarray) else torch
    B, T = seq_idx.shape
    pad = -T % C
    seq = xp.concatenate([seq_idx, *[seq_idx[:, -1:]] * pad], 1) if pad else seq_idx
    seq = seq.reshape(B, -1, C).swapaxes(0, 1).reshape(-1, C)
    # sample of the token before each chunk: the previous chunk's last, none for a row's first chunk
    before = xp.concatenate([xp.full_like(seq[:B, :1], -1), seq[:-B, -1:]])
    cont = seq == before
    same = (seq[:, :, None] == seq[:, None, :]) & causal
    return seq, ~same[:, None], ~cont[:, None], (seq != seq[:, -1:])[:, None], cont, same


def _row_masks(seq_idx: torch.Tensor, cu_seqlens: torch.Tensor | None, C: int, cdt: torch.dtype
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``((seq, cut, fresh, not_last), cont [M, C], same [M, C, C])`` for rows cut into chunks of ``C``,
    chunk-major as :class:`_ToChunks`: the boundary masks of :func:`_intra_chunk` (padding slots join the row's
    last sample), whether a token continues the sample running before its chunk, and the in-chunk causal
    same-sample matrix in ``cdt``. Kept for ``cu_seqlens`` (:func:`~packfree_plugin.boundaries.memo`: every layer of a
    forward passes the same tensor), so
    they are built once per forward, not once per layer or call. A CPU row builds them in numpy (a fraction of
    torch's per-call cost, which a short row pays a dozen times), others on their device (no host sync)."""
    def build() -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        if seq_idx.device.type == "cpu" and not torch.compiler.is_compiling():
            arrays = map(torch.from_numpy, _mask_arrays(host_of(seq_idx).copy(), C, _host_causal(C)))
        else:
            arrays = _mask_arrays(seq_idx, C, ~_above_diagonal(C, seq_idx.device))
        seq, cut, fresh, not_last, cont, same = arrays
        return (seq, cut, fresh, not_last), cont, same.to(cdt)

    return build() if cu_seqlens is None else memo(cu_seqlens, "gdn_masks", (tuple(seq_idx.shape), C, cdt), build)


def _restarted_cumsum(same: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """In-chunk cumulative sum of ``g [M, H, C(, K)]`` restarted at every sample start: ``same [M, C, C]``
    (causal, same sample) applied in one batched product, to every head's row of a scalar decay as it lies
    (no relayout), to every (head, channel) column of a per-channel one."""
    if g.dim() == 3:
        return torch.bmm(g, same.transpose(1, 2))
    M, H, C, K = g.shape
    cols = g.transpose(1, 2).reshape(M, C, H * K)
    return (same @ cols).view(M, C, H, K).transpose(1, 2).contiguous()


def _run_rows(x: torch.Tensor, seq_idx: torch.Tensor | None, *, head_dims: tuple[int, int], dtype: torch.dtype,
              scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              cu_seqlens: torch.Tensor | None, chunk_size: int, per_channel: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No initial states: rows cut into fixed chunks, boundaries inside chunks (module docstring). ``x`` the
    inputs stacked by :func:`_stack_inputs` ``[B, T, H, D]``, ``head_dims = (K, V)``, ``dtype`` q's;
    ``seq_idx [B, T]`` or None. Returns as :func:`chunk_gated_delta_rule_torch` / :func:`chunk_kda_torch`."""
    B, T, H = x.shape[:3]
    K, V = head_dims
    cdt = compute_dtype(dtype)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if T == 0:
        final = x.new_zeros(N, H, K, V, dtype=cdt) if output_final_state else None
        return x.new_empty(B, 0, H, V, dtype=dtype), final
    C = chunk_size
    chunked = _ToChunks.apply(x, C, cdt) if torch.is_grad_enabled() and x.requires_grad else _chunked(x, C, cdt)
    qc, kc, vc, g_c, bc = _unstack_chunks(chunked, K, V, scale=scale, per_channel=per_channel,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if seq_idx is None:
        seq = cont = None
        masks = (None,) * 4
        gc = g_c.cumsum(dim=2)
    else:
        masks, cont, same = _row_masks(seq_idx, cu_seqlens, C, cdt)
        seq = masks[0]
        # cumulative log decay restarted at every sample start: both ends of G_r - G_s sum from the same token
        gc = _restarted_cumsum(same, g_c)
    if B == qc.shape[0] and not (per_channel or output_final_state):
        # one chunk per row and no final state: no state enters or leaves a chunk, so o = P U alone
        A, P = _scalar_gram(qc, kc, gc, bc, masks[1])
        U, _ = _unit_lower_solve(A, bc, vc)
        o = torch.bmm(P.reshape(-1, C, C), U.reshape(-1, C, V)).view(U.shape)
        return _from_chunks(o, B, T, dtype), None
    P, U, W, qg, decay_last, k_end_t = _intra_blocks(qc, kc, vc, gc, bc, masks, per_channel=per_channel)
    per_sample_ends = output_final_state and cu_seqlens is not None
    o, final, kept = _row_states(qg, P, U, W, decay_last, k_end_t, B, keep=per_sample_ends,
                                 end_state=output_final_state and not per_sample_ends)
    if per_sample_ends:
        h_before, v_new = kept
        final = _sample_end_states(cu_seqlens, seq, cont, gc, kc, v_new, h_before, per_channel=per_channel)
    return _from_chunks(o, B, T, dtype), final


def _run_layout(x, *, head_dims, dtype, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, chunk_size, per_channel):
    """Per-sample initial states: chunks start on sample starts (one host sync for the offsets). ``x`` as in
    :func:`_run_rows`."""
    B, T, H = x.shape[:3]
    K, V = head_dims
    offsets = host_offsets(cu_seqlens, batch=B, total=T, device=x.device) if cu_seqlens is not None else row_offsets(B, T)
    cdt = compute_dtype(dtype)
    layout = chunk_layout(offsets, chunk_size, x.device)
    # [B, T, H, D] -> [M, C, H, D] -> heads first [M, H, C, D]
    xc = layout.pack(x.reshape(B * T, H, -1).to(cdt)).transpose(1, 2)
    qc, kc, vc, g_c, bc = _unstack_chunks(xc, K, V, scale=scale, per_channel=per_channel,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    h0 = layout.to_rank_order(initial_state.to(cdt))
    o, final = _delta_rule_chunks(qc, kc, vc, g_c.cumsum(dim=2), bc, h0, layout, per_channel=per_channel)
    o = layout.unpack(o.transpose(1, 2)).view(B, T, H, V).to(dtype)
    final = layout.to_sample_order(final) if output_final_state else None
    return o, final


def _run(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         chunk_size, per_channel, validate):
    seq_idx = _validate(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=per_channel, validate=validate)
    _check_chunking(chunk_size, per_channel)
    options = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   per_channel=per_channel, head_dims=(q.shape[-1], v.shape[-1]), dtype=q.dtype)
    # float32 throughout (float64 for float64) under autocast too, as compiled code runs it (autocast off inside
    # the custom op): autocast would put the products in bfloat16, and CPU has no bfloat16 triangular solve
    with torch.autocast(q.device.type, enabled=False) if torch.is_autocast_enabled(q.device.type) else nullcontext():
        x = _stack_inputs(q, k, v, g, beta, per_channel=per_channel)
        if seq_idx is None:  # one sample per row: no two samples share a chunk or a state
            return _run_chunked(x, seq_idx, initial_state, options)
        # a sample with a NaN/inf input or initial state computes on zeros and returns NaN (ops/_nonfinite.py)
        quarantine = Quarantine(seq_idx, [(x, 1)], initial_state)
        (x,) = quarantine.clean()
        o, final = _run_chunked(x, seq_idx, quarantine.clean_state(initial_state), options)
        return quarantine.mark(o), quarantine.mark_states(final, cu_seqlens)


def _run_chunked(x, seq_idx, initial_state, options):
    """Rows cut into fixed chunks without initial states, else chunks aligned on sample starts."""
    if initial_state is None:
        return _run_rows(x, seq_idx, **options)
    return _run_layout(x, initial_state=initial_state, **options)


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
    validate: bool | None = None,
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
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                per_channel=False, validate=validate)


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
    validate: bool | None = None,
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
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

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
                per_channel=True, validate=validate)
