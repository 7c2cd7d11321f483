"""Pure-torch chunked selective scan (Mamba1) over packed rows.

The recurrence ``h_t = a_t * h_{t-1} + b_t`` runs on ``[B, T, D*N]`` states with
``a_t = exp(delta_t A)`` set to exactly 0 at every sample start, so no state (and no gradient)
crosses a boundary. Mamba1's A is per channel *and* per state, so the SSD matmul form does not
apply and the ``[T, D, N]`` states are materialised, as mamba_ssm's own reference does.

Layers of the fast path:

* tokens are processed in blocks of about ``_BLOCK_BYTES`` of state (64 tokens at D=512, N=16),
  the last state carried from block to block, so each block's tensors stay in cache through all
  their passes; the block count depends on T, never on the number of samples;
* each block is one fused autograd function (decay, drive, scan, read-out; only h is saved);
* the scan inside a block (:func:`_scan`) is chunked: (1) a loop over the positions of a chunk,
  vectorised across all chunks, scans every chunk from zero and keeps its running decay product;
  (2) a loop over chunks carries the end states; (3) one pass adds ``product * carried state``.
  That is ~2 sqrt(block) small Python steps per block instead of one per token, and only products
  of a's are ever formed (no log-space division), so a zero decay stays an exact zero. The
  backward is the same scan run backwards in time: ``g_t = grad_t + a_{t+1} g_{t+1}``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._nonfinite import Quarantine


_BLOCK_BYTES = 1 << 21
_SPARSE_ON_CPU = True  # tests set False to run the masked path (what other devices use) on CPU


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


class _SelectiveScanBlock(torch.autograd.Function):
    """One block of tokens, fused: ``a = exp(delta A)`` (0 at the reset rows), ``b = delta u B``,
    ``h = scan(a, b, h0)``, ``y = C . h``. Saves only h; a and b are recomputed in the backward.

    State layout ``[B, t, G, N, D/G]`` (channels innermost): every reduction over N is then a
    middle-dimension sum over contiguous channels, which is what the CPU does fastest.
    """

    @staticmethod
    def forward(ctx, dT: Tensor, du: Tensor, A_l: Tensor, Bt: Tensor, Ct: Tensor, h0: Tensor | None,
                resets: tuple[Tensor, Tensor] | Tensor | None):
        # dT, du: [B, t, D]; A_l: [G, N, D/G]; Bt, Ct: [B, t, G, N]; h0: [B, G*N*D/G]
        dT, du, Bt, Ct = dT.contiguous(), du.contiguous(), Bt.contiguous(), Ct.contiguous()
        a = _decay(dT, A_l, resets)
        b = _drive(du, Bt)
        h = _scan(a, b, h0)
        y = _read(h, Ct)
        ctx.resets = resets
        ctx.save_for_backward(dT, du, A_l, Bt, Ct, h0, h)
        return y, h[:, -1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor, gh_last: Tensor | None):
        dT, du, A_l, Bt, Ct, h0, h = ctx.saved_tensors
        Bsz, tb, Dm = dT.shape
        G, N, Dg = A_l.shape
        gy5 = gy.contiguous().view(Bsz, tb, G, 1, Dg)
        a = _decay(dT, A_l, ctx.resets)  # [B, t, F]
        # dL/dh from the read-out (and from the carried last state), then back through the scan:
        # g_t = gh_t + a_{t+1} g_{t+1}
        gh = (gy5 * Ct[..., None]).view(Bsz, tb, -1)
        if gh_last is not None:
            gh[:, -1] += gh_last
        a_next = torch.empty_like(a)
        a_next[:, :-1] = a[:, 1:]
        a_next[:, -1] = 0
        g = _scan(a_next, gh, reverse=True)  # = dL/db
        # dL/d(delta A) = g_t h_{t-1} a_t  (exactly 0 where a was zeroed)
        gl = torch.empty_like(a)
        torch.mul(g[:, 1:], h[:, :-1], out=gl[:, 1:])
        if h0 is not None:
            torch.mul(g[:, 0], h0, out=gl[:, 0])
        else:
            gl[:, 0] = 0
        gl.mul_(a)
        shape5 = (Bsz, tb, G, N, Dg)
        gl5, g5, h5 = gl.view(shape5), g.reshape(shape5), h.reshape(shape5)
        grad_dT = (gl5 * A_l).sum(3).view(Bsz, tb, Dm)
        grad_A = (gl5 * dT.view(Bsz, tb, G, 1, Dg)).sum((0, 1))
        grad_du = (g5 * Bt[..., None]).sum(3).view(Bsz, tb, Dm)
        grad_B = (g5 * du.view(Bsz, tb, G, 1, Dg)).sum(-1)
        grad_C = (h5 * gy5).sum(-1)
        grad_h0 = g[:, 0] * a[:, 0] if h0 is not None else None
        return grad_dT, grad_du, grad_A, grad_B, grad_C, grad_h0, None


def _decay(dT: Tensor, A_l: Tensor, resets) -> Tensor:
    Bsz, tb, Dm = dT.shape
    G, N, Dg = A_l.shape
    a = torch.mul(dT.view(Bsz, tb, G, 1, Dg), A_l).exp_()  # [B, t, G, N, D/G]
    if isinstance(resets, Tensor):  # [B, t] bool (no host sync): one masked pass
        a.masked_fill_(resets[:, :, None, None, None], 0.0)
    elif resets is not None:  # (b, t) indices: the state restarts there, exact zeros, no dense pass
        a[resets] = 0
    return a.view(Bsz, tb, -1)


def _drive(du: Tensor, Bt: Tensor) -> Tensor:
    Bsz, tb, Dm = du.shape
    G = Bt.shape[2]
    return (du.view(Bsz, tb, G, 1, Dm // G) * Bt[..., None]).view(Bsz, tb, -1)


def _read(h: Tensor, Ct: Tensor) -> Tensor:
    Bsz, tb, G, N = Ct.shape
    return (h.reshape(Bsz, tb, G, N, -1) * Ct[..., None]).sum(3).view(Bsz, tb, -1)


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
    quarantine = None
    if seq_idx is not None:  # a sample with a NaN/inf input computes on zeros and returns NaN (ops/_nonfinite.py)
        quarantine = Quarantine(seq_idx, [(u, 2), (delta, 2), (B, B.dim() - 1), (C, C.dim() - 1), (z, 2)])
        u, delta, B, C, z = quarantine.clean()
    out_dtype = u.dtype
    cdt = torch.float32 if u.dtype in (torch.float16, torch.bfloat16) else u.dtype
    u, delta, A, B, C = (t.to(cdt) for t in (u, delta, A, B, C))
    Bsz, Dm, T = u.shape
    N = A.shape[1]
    if delta_bias is not None:
        delta = delta + delta_bias.to(cdt)[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    # time-major, one block of tokens at a time: a block's [tokens, D, N] tensors stay in cache
    # through all the passes over them (and again in the backward); the state is carried from
    # block to block. Only h is stored for the backward.
    G = 1 if B.dim() == 3 else B.shape[1]
    dT = delta.transpose(1, 2).contiguous()  # [B, T, D]
    duT = dT * u.transpose(1, 2)
    Bt = B.reshape(Bsz, G, N, T).permute(0, 3, 1, 2).contiguous()  # [B, T, G, N]
    Ct = C.reshape(Bsz, G, N, T).permute(0, 3, 1, 2).contiguous()
    A_l = A.view(G, Dm // G, N).transpose(1, 2).contiguous()  # [G, N, D/G]
    blk = _block_len(Bsz * Dm * N * torch.finfo(cdt).bits // 8, T)
    starts = None
    if seq_idx is not None:
        first = torch.zeros_like(seq_idx, dtype=torch.bool)
        first[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        starts = first.split(blk, dim=1)
    # split (not slicing in a loop): the backward concatenates once
    parts = [t.split(blk, dim=1) for t in (dT, duT, Bt, Ct)]
    h_last = None
    ys = []
    for i, (d_b, du_b, B_b, C_b) in enumerate(zip(*parts)):
        resets = None
        if starts is not None:
            if starts[i].device.type == "cpu" and _SPARSE_ON_CPU:
                idx = starts[i].nonzero(as_tuple=True)
                resets = idx if idx[0].numel() else None
            else:
                resets = starts[i]
        y_b, h_last = _SelectiveScanBlock.apply(d_b, du_b, A_l, B_b, C_b, h_last, resets)
        ys.append(y_b)
    y = torch.cat(ys, dim=1).transpose(1, 2)  # [B, D, T]
    if D is not None:
        y = y + u * D.to(cdt)[:, None]
    if z is not None:
        y = y * F.silu(z.to(cdt))
    if quarantine is not None:
        y = quarantine.mark(y, 2)
    return y.to(out_dtype)
