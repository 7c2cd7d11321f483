"""Pure-torch chunked SSD (Mamba2 state-space duality) over packed rows.

Per chunk of L tokens: a masked quadratic (attention-like) term for pairs inside the chunk, plus the
state carried in from earlier chunks; chunk end states are passed on by a short loop over chunks. Sample boundaries are handled by forcing the decay between tokens of different samples to
exactly zero (``exp(-inf)``) in all three places: inside a chunk, from a token to its chunk's end
state, and from one chunk end to the next. A boundary in the middle of a chunk therefore needs no
special case, and the cost is that of the unsplit row plus a few masks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import process_dt

_NEG_INF = float("-inf")


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
    dA = dth * A.view(G, R, 1, 1)  # [b, g, r, c, l]
    xdt = xh * dth[..., None]  # dt_s x_s

    # 1. inside each chunk: y_t = sum_{s<=t, same sample} (C_t.B_s) exp(cs_t - cs_s) dt_s x_s
    pair_ok = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    if seq is None:
        cs = torch.cumsum(dA, dim=-1)
    else:
        same = (seq[..., :, None] == seq[..., None, :]) & pair_ok  # [b, c, l, s]
        # cumsum restarted at every sample start (a masked [l, s] sum): a plain cumsum would let
        # earlier samples' dt into differences that cancel only up to rounding, in the gradient too
        cs = torch.einsum("bcts,bgrcs->bgrct", same.to(dA.dtype), dA)
        pair_ok = same[:, None, None]  # [b, 1, 1, c, l, s]
    decay = (cs[..., :, None] - cs[..., None, :]).masked_fill_(~pair_ok, _NEG_INF).exp_()
    y = ((Ch @ Bh.transpose(-1, -2)) * decay) @ xdt  # [b, g, r, c, l, p]

    # 2. each chunk's end state from its own tokens (same sample as the chunk's last token only)
    to_end = cs[..., -1:] - cs
    if seq is not None:
        to_end = to_end.masked_fill((seq != seq[..., -1:])[:, None, None], _NEG_INF)
    states = (xdt * torch.exp(to_end)[..., None]).transpose(-1, -2) @ Bh  # [b, g, r, c, p, n]

    # 3. chunk end states through the chunks: S_c = exp(total_c) S_{c-1} + states_c, with the
    #    carry cut (exact 0) where chunk c's last token starts or follows a new sample. A loop over
    #    chunks of [P, N] updates is far cheaper than an [nc, nc] decay matmul over P * N.
    carry = torch.exp(cs[..., -1])  # [b, g, r, c]
    if seq is not None:
        end = seq[..., -1]  # [b, c]
        same = torch.ones_like(end, dtype=torch.bool)
        same[:, 1:] = end[:, 1:] == end[:, :-1]
        carry = carry * same[:, None, None].to(carry.dtype)
    S = torch.zeros_like(states[:, :, :, 0])
    entering = []
    # unbind, not indexing: its backward stacks once instead of scattering into nc zero tensors
    for carry_c, states_c in zip(carry[..., None, None].unbind(3), states.unbind(3)):
        entering.append(S)
        S = carry_c * S + states_c
    S_in = torch.stack(entering, dim=3)  # state entering chunk c: [b, g, r, c, p, n]

    # 4. the carried-in state read at every token of the chunk (same sample as previous chunk end)
    into = cs
    if seq is not None:
        prev_end = F.pad(seq[:, :-1, -1], (1, 0), value=-1)  # [b, c]; chunk 0 has S_in = 0
        into = into.masked_fill((seq != prev_end[..., None])[:, None, None], _NEG_INF)
    y = y + (Ch @ S_in.transpose(-1, -2)) * torch.exp(into)[..., None]

    y = y.view(Bsz, H, nc * L, P)[:, :, :T].transpose(1, 2)
    if D is not None:
        y = y + x * (D.to(cdt)[:, None] if D.dim() == 1 else D.to(cdt))
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(out_dtype)
