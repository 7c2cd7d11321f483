"""Pure-torch chunked SSD (Mamba2 state-space duality) over packed rows.

Per chunk of L tokens: a masked quadratic (attention-like) term for pairs inside the chunk, plus
the state carried in from earlier chunks; chunk end states are passed on by a short loop over
chunks. Sample boundaries are handled by forcing the decay between tokens of different samples to
exactly zero (``exp(-inf)``) everywhere it appears: between two tokens inside a chunk, from a token
to its chunk's end state, and from one chunk end to the next. A boundary in the middle of a chunk
needs no special case, and the dense work is that of the unsplit row. Every decay exponent is a sum
of the ``dt A`` it spans (no difference of cumulative sums), so fp32 keeps stock's precision.
Chunks run in cache-sized groups (``_GROUP_TOKENS``) with the state carried between groups, so the
working set does not grow with T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._nonfinite import Quarantine
from .naive import process_dt

_NEG_INF = float("-inf")


_GROUP_TOKENS = 128


def _chunk_group(xh: Tensor, dth: Tensor, Bh: Tensor, Ch: Tensor, seq: Tensor | None, A: Tensor,
                 S: Tensor, prev_end: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """k consecutive chunks: ``xh [b,g,r,k,l,p]``, ``dth [b,g,r,k,l]``, ``Bh/Ch [b,g,1,k,l,n]``,
    ``seq [b,k,l]``; ``S [b,g,r,p,n]`` is the state entering the group and ``prev_end [b,1]`` the
    sample of the token before it. Returns the group's output, its end state and last sample."""
    L = xh.shape[4]
    dA = dth * A  # [b, g, r, k, l]
    xdt = xh * dth[..., None]  # dt_s x_s

    # 1. inside each chunk: y_t = sum_{s<=t, same sample} (C_t.B_s) exp(seg[t, s]) dt_s x_s with
    #    seg[t, s] = sum_{s<j<=t} dA_j summed pair by pair (as transformers' segment_sum does), never
    #    as cumsum_t - cumsum_s: that difference of two large sums loses up to |cumsum| * eps of every
    #    decay, 20x fp32 stock's error at Mamba2 sizes.
    strict = torch.ones(L, L, dtype=torch.bool, device=xh.device).tril(-1)
    pair_ok = torch.ones(L, L, dtype=torch.bool, device=xh.device).tril()
    if seq is not None:
        pair_ok = ((seq[..., :, None] == seq[..., None, :]) & pair_ok)[:, None, None]  # [b,1,1,k,l,s]
    seg = dA[..., :, None].expand(*dA.shape, L).masked_fill(~strict, 0.0).cumsum(-2)
    decay = seg.masked_fill_(~pair_ok, _NEG_INF).exp_()  # [b, g, r, k, l, s]; 0 across samples
    y = ((Ch @ Bh.transpose(-1, -2)) * decay) @ xdt  # [b, g, r, k, l, p]

    # 2. each chunk's end state from its own tokens: decay to the chunk's last token (its row of
    #    `decay`, already 0 for tokens of other samples than the last one's)
    states = (xdt * decay[..., -1, :, None]).transpose(-1, -2) @ Bh  # [b, g, r, k, p, n]

    # 3. decay from the chunk start to every token: exp(dA_0) * decay[t, 0], cut (exact 0) where
    #    token t does not continue the sample of the token before the chunk.
    into = decay[..., :, 0] * torch.exp(dA[..., :1])  # [b, g, r, k, l]
    end = None
    if seq is not None:
        end = seq[..., -1]  # [b, k]
        before = torch.cat([prev_end, end[:, :-1]], dim=1)  # sample of the token before each chunk
        into = into * (seq[..., :1] == before[..., None])[:, None, None].to(into.dtype)
    carry = into[..., -1]  # [b, g, r, k]: S_c = carry_c S_{c-1} + states_c
    entering = []
    # unbind, not indexing: its backward stacks once instead of scattering into k zero tensors
    for carry_c, states_c in zip(carry[..., None, None].unbind(3), states.unbind(3)):
        entering.append(S)
        S = carry_c * S + states_c
    S_in = torch.stack(entering, dim=3)  # state entering each chunk: [b, g, r, k, p, n]

    # 4. the carried-in state read at every token of the chunk
    y = y + (Ch @ S_in.transpose(-1, -2)) * into[..., None]
    return y, S, (end[:, -1:] if end is not None else None)


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    seq_idx: Tensor | None = None,
) -> Tensor:
    """Torch path of :func:`packfree_plugin.ops.ssd.ssd_chunk_scan` (no argument checks here).

    Computes in float32 for half-precision inputs; returns x's dtype.
    """
    quarantine = None
    if seq_idx is not None:  # a sample with a NaN/inf input computes on zeros and returns NaN (ops/_nonfinite.py)
        quarantine = Quarantine(seq_idx, [(x, 1), (dt, 1), (B, 1), (C, 1), (z, 1)])
        x, dt, B, C, z = (quarantine.clean(t) for t in (x, dt, B, C, z))
    out_dtype = x.dtype
    cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x, dt, A, B, C = (t.to(cdt) for t in (x, dt, A, B, C))
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G
    L = chunk_size
    nc = -(-T // L)
    pad = nc * L - T

    dt = process_dt(dt, None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    xs, Bs, Cs = x, B, C
    if pad:  # zero dt and x: padded tokens neither write state nor matter (they come last)
        xs = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        Bs = F.pad(B, (0, 0, 0, 0, 0, pad))
        Cs = F.pad(C, (0, 0, 0, 0, 0, pad))
    seq = None
    if seq_idx is not None:
        # padded tokens join the last sample (integer replicate-padding is not on every device)
        seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], 1) if pad else seq_idx
        seq = seq.view(Bsz, nc, L)

    # head-major layout [b, g, r, c, l, *] (H = G * R heads, head h reads group h // R): one copy of
    # x in, one copy of y out, and every matmul below runs on contiguous operands.
    xh = xs.view(Bsz, nc * L, G, R, P).permute(0, 2, 3, 1, 4).reshape(Bsz, G, R, nc, L, P)
    dth = dt.view(Bsz, nc * L, G, R).permute(0, 2, 3, 1).reshape(Bsz, G, R, nc, L)
    Bh = Bs.transpose(1, 2).reshape(Bsz, G, 1, nc, L, N)
    Ch = Cs.transpose(1, 2).reshape(Bsz, G, 1, nc, L, N)
    # Chunks are processed in groups of about _GROUP_TOKENS tokens, the state carried from group to
    # group: a group's [L, L] decay and score tensors stay in cache through all their passes (and
    # again in the backward). split, not slicing in a loop: the backward concatenates once.
    k = max(1, _GROUP_TOKENS // L)
    seq_groups = seq.split(k, dim=1) if seq is not None else [None] * (-(-nc // k))
    S = xh.new_zeros(Bsz, G, R, P, N)
    prev_end = torch.full((Bsz, 1), -1, dtype=torch.int32, device=x.device) if seq is not None else None
    ys = []
    for xg, dtg, Bg, Cg, sg in zip(xh.split(k, 3), dth.split(k, 3), Bh.split(k, 3), Ch.split(k, 3),
                                   seq_groups):
        y_g, S, prev_end = _chunk_group(xg, dtg, Bg, Cg, sg, A.view(G, R, 1, 1), S, prev_end)
        ys.append(y_g)
    y = torch.cat(ys, dim=3)  # [b, g, r, c, l, p]

    y = y.view(Bsz, H, nc * L, P)[:, :, :T].transpose(1, 2)
    if D is not None:
        y = y + x * (D.to(cdt)[:, None] if D.dim() == 1 else D.to(cdt))
    if z is not None:
        y = y * F.silu(z.to(cdt))
    if quarantine is not None:
        y = quarantine.mark(y)
    return y.to(out_dtype)
