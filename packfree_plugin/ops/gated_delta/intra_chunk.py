"""What every chunk of the gated delta rule computes on its own: the decay-weighted Gram matrices ``A`` and ``P``
(scalar decay directly, KDA's per-channel decay by recursive halving) and the WY transform ``U, W`` by one
unit-lower-triangular solve (formulas: :mod:`packfree_plugin.ops.gated_delta.fast`)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._kept import kept_per_mode

__all__ = ["KDA_CHUNKS_PER_BLOCK", "above_diagonal", "intra_blocks", "scalar_gram", "unit_lower_solve"]

_NEG_INF = float("-inf")


@kept_per_mode(maxsize=16)
def above_diagonal(C: int, device: torch.device) -> torch.Tensor:
    """``[C, C]`` bool, True above the diagonal: the pairs ``s > r`` no decay links."""
    return ~torch.ones(C, C, dtype=torch.bool, device=device).tril()


def scalar_gram(q, k, gc, beta, cut):
    """Scalar decay: ``A`` (beta-scaled, strictly lower part used) and ``P`` (lower incl. diagonal),
    ``[M, H, C, C]``. ``cut [M, 1, C, C]``: pairs without a decay, above the diagonal or of two samples (None: the
    whole chunk is one sample). ``A``'s diagonal is left in: the unit-triangular solve never reads it."""
    if cut is None:
        cut = above_diagonal(gc.shape[-1], gc.device)
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
    """Per-channel decay (KDA): ``A`` and ``P`` as in :func:`scalar_gram` without any ``[C, C, K]`` tensor.

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
    ``cut [M, 1, C, C]`` the pairs without a decay (:func:`scalar_gram`), ``fresh [M, 1, C]`` tokens that do not
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
        A, P = scalar_gram(q, k, gc, beta, cut)
        gain = torch.exp(gain_exp)[..., None]  # [M, H, C, 1]
        k_end = k * torch.exp(to_end)[..., None]
        decay_last = gain[..., -1:, :]  # [M, H, 1, 1]
    U, W = unit_lower_solve(A, beta, v, k, gain)
    return P, U, W, q * gain, decay_last, k_end.transpose(-1, -2)


def unit_lower_solve(A: torch.Tensor, beta: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None,
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


def intra_blocks(q, k, v, gc, beta, masks, *, per_channel: bool):
    """:func:`_intra_chunk` over all ``M`` chunks (KDA in blocks of :data:`KDA_CHUNKS_PER_BLOCK`); ``masks``:
    its ``(seq, cut, fresh, not_last)`` (:func:`packfree_plugin.ops.gated_delta.row_chunks._row_masks`) or four None."""
    if not per_channel:
        return _intra_chunk(q, k, v, gc, beta, *masks, per_channel=False)
    n = KDA_CHUNKS_PER_BLOCK
    parts = [t.split(n) if t is not None else [None] * (-(-q.shape[0] // n)) for t in (q, k, v, gc, beta, *masks)]
    blocks = [_intra_chunk(*piece, per_channel=True) for piece in zip(*parts)]
    return tuple(torch.cat(part) for part in zip(*blocks))

