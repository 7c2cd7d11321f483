"""Pure-torch chunked selective scan (Mamba1) over packed rows.

The recurrence ``h_t = a_t * h_{t-1} + b_t`` runs on ``[B, T, D*N]`` with ``a_t = exp(delta_t A)``
set to exactly 0 at every sample start, so no state (and no gradient) crosses a boundary. Mamba1's
A is per channel *and* per state, so the SSD matmul form does not apply and the ``[T, D, N]``
states are materialised, as mamba_ssm's own reference does.

The linear scan is a custom autograd function with a blocked algorithm: T is cut into chunks of
about sqrt(T) tokens; (1) a loop over the positions of a chunk, vectorised across all chunks,
scans every chunk from zero and accumulates the chunk's running decay product; (2) a loop over
chunks carries the end states; (3) one fused pass adds ``decay_product * carried_state``. That is
~2 sqrt(T) small Python steps rather than T, and only products of a's are ever formed (no
log-space division), so a zero decay stays an exact zero. The backward is the same scan run
backwards over time: ``g_t = grad_t + a_{t+1} g_{t+1}``, ``grad_b = g``, ``grad_a = g_t h_{t-1}``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


_BLOCK_BYTES = 1 << 21


def _block_len(bytes_per_token: int, T: int) -> int:
    return max(16, min(T, _BLOCK_BYTES // max(bytes_per_token, 1)))


def _chunk_len(T: int) -> int:
    return max(1, int(math.isqrt(max(T, 1))))


def _scan(a: Tensor, b: Tensor, h0: Tensor | None = None, *, reverse: bool = False) -> Tensor:
    """``h_t = a_t h_{t-1} + b_t`` along dim 1 of ``[B, T, F]`` from ``h_{-1} = h0`` (zeros if None);
    ``reverse`` runs ``h_t = a_t h_{t+1} + b_t`` from the end (and h0 is ``h_T``) instead."""
    Bsz, T, Fdim = b.shape
    L = _chunk_len(T)
    nc = -(-T // L)
    pad = nc * L - T
    if pad:  # pad on the side the scan ends at: a = 0, b = 0 never reach a real token
        side = (0, 0, pad, 0) if reverse else (0, 0, 0, pad)
        a, b = F.pad(a, side), F.pad(b, side)
    a4 = a.view(Bsz, nc, L, Fdim)
    b4 = b.view(Bsz, nc, L, Fdim)
    h = torch.empty_like(b4)
    prod = torch.empty_like(a4)  # running decay product since the chunk's start
    order = range(L - 1, -1, -1) if reverse else range(L)
    first = True
    for j in order:  # (1) every chunk scanned from zero, all chunks at once
        if first:
            h[:, :, j] = b4[:, :, j]
            prod[:, :, j] = a4[:, :, j]
            prev = j
            first = False
            continue
        torch.addcmul(b4[:, :, j], a4[:, :, j], h[:, :, prev], out=h[:, :, j])
        torch.mul(a4[:, :, j], prod[:, :, prev], out=prod[:, :, j])
        prev = j
    # (2) carry chunk end states across chunks: carry[c] = state entering chunk c
    carry = torch.zeros_like(b4[:, :, 0])
    end = 0 if reverse else L - 1
    chunks = range(nc - 1, -1, -1) if reverse else range(nc)
    state = torch.zeros_like(b4[:, 0, 0]) if h0 is None else h0
    for c in chunks:
        carry[:, c] = state
        state = torch.addcmul(h[:, c, end], prod[:, c, end], state)
    # (3) one pass: h += prod * carry
    h.addcmul_(prod, carry[:, :, None])
    h = h.view(Bsz, nc * L, Fdim)
    return h[:, pad:] if (pad and reverse) else h[:, :T]


class _LinearScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, h0: Tensor | None) -> Tensor:
        h = _scan(a, b, h0)
        ctx.has_h0 = h0 is not None
        ctx.save_for_backward(a, h, h0)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h: Tensor):
        a, h, h0 = ctx.saved_tensors
        a_next = torch.zeros_like(a)
        a_next[:, :-1] = a[:, 1:]
        g = _scan(a_next, grad_h.contiguous(), reverse=True)
        grad_a = torch.empty_like(a)
        torch.mul(g[:, 1:], h[:, :-1], out=grad_a[:, 1:])
        if ctx.has_h0:
            torch.mul(g[:, 0], h0, out=grad_a[:, 0])
            grad_h0 = g[:, 0] * a[:, 0]
        else:
            grad_a[:, 0] = 0
            grad_h0 = None
        return grad_a, g, grad_h0


def linear_scan(a: Tensor, b: Tensor, h0: Tensor | None = None) -> Tensor:
    """``h_t = a_t h_{t-1} + b_t`` over dim 1 of ``[B, T, F]`` tensors from ``h_{-1} = h0 [B, F]``
    (zeros if None); differentiable in a, b and h0."""
    return _LinearScan.apply(a.contiguous(), b.contiguous(), h0)


def selective_scan_chunked(
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
    """Torch path of :func:`packfree_plugin.ops.selective_scan.selective_scan` (no argument checks).

    Computes in float32 for half-precision inputs; returns u's dtype.
    """
    out_dtype = u.dtype
    cdt = torch.float32 if u.dtype in (torch.float16, torch.bfloat16) else u.dtype
    u, delta, A, B, C = (t.to(cdt) for t in (u, delta, A, B, C))
    Bsz, Dm, T = u.shape
    N = A.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias.to(cdt)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    # time-major [B, T, D, N] so that the scan walks the outer dimension, one block of tokens at a
    # time: a block's [tokens, D, N] tensors stay in cache through all the passes over them (and
    # again in the backward); the state is carried from block to block.
    G = 1 if B.dim() == 3 else B.shape[1]
    dT = delta.transpose(1, 2).contiguous()  # [B, T, D]
    duT = (dT * u.transpose(1, 2)).view(Bsz, T, G, Dm // G, 1)
    Bt = B.view(Bsz, G, 1, N, T).permute(0, 4, 1, 2, 3)  # [B, T, G, 1, N]
    Ct = C.view(Bsz, G, 1, N, T).permute(0, 4, 1, 2, 3)
    keep = None
    if seq_idx is not None:
        keep = torch.ones(Bsz, T, 1, 1, dtype=cdt, device=u.device)
        keep[:, 1:, 0, 0] = (seq_idx[:, 1:] == seq_idx[:, :-1]).to(cdt)  # 0: the state restarts
    blk = _block_len(Bsz * Dm * N * torch.finfo(cdt).bits // 8, T)
    # split (not slicing in a loop): the backward concatenates once
    parts = [t.split(blk, dim=1) for t in (dT, duT, Bt, Ct)]
    keeps = keep.split(blk, dim=1) if keep is not None else [None] * len(parts[0])
    h_last = None
    ys = []
    for d_b, du_b, B_b, C_b, k_b in zip(*parts, keeps):
        tb = d_b.shape[1]
        a = torch.exp(d_b[..., None] * A)  # [B, tb, D, N]
        if k_b is not None:
            a = a * k_b
        b = du_b * B_b  # [B, tb, G, D/G, N]
        h = linear_scan(a.view(Bsz, tb, Dm * N), b.view(Bsz, tb, Dm * N), h_last)
        h_last = h[:, -1]
        ys.append((h.view(Bsz, tb, G, Dm // G, N) * C_b).sum(-1).view(Bsz, tb, Dm))
    y = torch.cat(ys, dim=1).transpose(1, 2)  # [B, D, T]
    if D is not None:
        y = y + u * D.to(cdt)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(out_dtype)
