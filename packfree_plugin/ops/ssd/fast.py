"""Pure-torch chunked SSD (Mamba2 state-space duality) over packed rows.

Per chunk of L tokens: a masked quadratic (attention-like) term for pairs inside the chunk, plus
the state carried in from earlier chunks; chunk end states are passed on by a short loop over
chunks. Sample boundaries are handled by forcing the decay between tokens of different samples to
exactly zero (``exp(-inf)``) everywhere it appears: between two tokens inside a chunk, from a token
to its chunk's end state, and from one chunk end to the next. A boundary in the middle of a chunk
needs no special case, and the dense work is that of the unsplit row. Every decay exponent is a sum
of the ``dt A`` it spans (no difference of cumulative sums), so fp32 keeps stock's precision.
Chunks run in cache-sized groups (``_GROUP_BYTES``) with the state carried between groups, so the
working set does not grow with T.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ...boundaries import memo
from .._kept import kept_per_mode
from .._nonfinite import Quarantine

_NEG_INF = float("-inf")


def _preprocessed_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    """mamba_ssm's dt preprocessing, ``dt [B, T, H]``: add ``dt_bias [H]``, softplus (identity above 20), clamp
    to ``dt_limit`` unless it is ``(0, inf)``."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt, threshold=20.0)
    low, high = dt_limit
    return dt if (low, high) == (0.0, math.inf) else dt.clamp(min=low, max=high)


_GROUP_BYTES = 1 << 20
"""Size of a group's ``[b, h, k, l, l]`` decay tensor: 1 chunk at a time at Mamba2's widths (chunk 256: 8 MiB
per chunk at 32 heads), all of a short row at once at tiny widths (each group costs a few dozen small ops)."""


@kept_per_mode(maxsize=16)
def _triangles(L: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(above_or_on [L, L], above [L, L])`` bool: pairs outside the strict and the inclusive lower triangle."""
    ones = torch.ones(L, L, dtype=torch.bool, device=device)
    return ~ones.tril(-1), ~ones.tril()


def _boundary_masks(seq_idx: Tensor, seq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """For the chunked ``seq [b, c, l]`` (sample of every token): ``cut [b, 1, 1, c, l, l]`` bool, pairs that are
    not (same sample, s <= t), and ``cont [b, 1, 1, c, l]`` in ``dtype``, 1 where a token continues the sample of
    the token before its chunk. Built once per ``seq_idx`` tensor and chunk size: every layer of a forward
    passes the same one."""
    L = seq.shape[-1]

    def build() -> tuple[Tensor, Tensor]:
        above = _triangles(L, seq.device)[1]
        cut = ((seq[..., :, None] != seq[..., None, :]) | above)[:, None, None]
        end = seq[..., -1]  # [b, c]
        before = torch.cat([torch.full_like(end[:, :1], -1), end[:, :-1]], dim=1)  # the token before each chunk's
        cont = (seq == before[..., None])[:, None, None].to(dtype)
        return cut, cont

    return memo(seq_idx, "ssd_masks", (tuple(seq.shape), dtype), build)


def _chunk_group(xh: Tensor, dth: Tensor, Bh: Tensor, Ch: Tensor, cut: Tensor, cont: Tensor | None, A: Tensor,
                 S: Tensor) -> tuple[Tensor, Tensor]:
    """k consecutive chunks: ``xh [b,g,r,k,l,p]``, ``dth [b,g,r,k,l]``, ``Bh/Ch [b,g,1,k,l,n]``; ``cut``: pairs
    of tokens with no decay between them (``[l, l]``, or ``[b,1,1,k,l,l]`` across samples too), ``cont
    [b,1,1,k,l]``: 1 where a token continues the sample of the token before its chunk (None: all do);
    ``S [b,g,r,p,n]`` is the state entering the group. Returns the group's output and its end state."""
    L = xh.shape[4]
    dA = dth * A  # [b, g, r, k, l]
    xdt = xh * dth[..., None]  # dt_s x_s

    # 1. inside each chunk: y_t = sum_{s<=t, same sample} (C_t.B_s) exp(seg[t, s]) dt_s x_s with
    #    seg[t, s] = sum_{s<j<=t} dA_j summed pair by pair (as transformers' segment_sum does), never
    #    as cumsum_t - cumsum_s: that difference of two large sums loses up to |cumsum| * eps of every
    #    decay, 20x fp32 stock's error at Mamba2 sizes.
    seg = dA[..., :, None].expand(*dA.shape, L).masked_fill(_triangles(L, xh.device)[0], 0.0).cumsum(-2)
    decay = seg.masked_fill_(cut, _NEG_INF).exp_()  # [b, g, r, k, l, s]; 0 across samples
    y = ((Ch @ Bh.transpose(-1, -2)) * decay) @ xdt  # [b, g, r, k, l, p]

    # 2. each chunk's end state from its own tokens: decay to the chunk's last token (its row of
    #    `decay`, already 0 for tokens of other samples than the last one's)
    states = (xdt * decay[..., -1, :, None]).transpose(-1, -2) @ Bh  # [b, g, r, k, p, n]

    # 3. decay from the chunk start to every token: exp(dA_0) * decay[t, 0], cut (exact 0) where
    #    token t does not continue the sample of the token before the chunk.
    into = decay[..., :, 0] * torch.exp(dA[..., :1])  # [b, g, r, k, l]
    if cont is not None:
        into = into * cont
    carry = into[..., -1]  # [b, g, r, k]: S_c = carry_c S_{c-1} + states_c
    entering = []
    # unbind, not indexing: its backward stacks once instead of scattering into k zero tensors
    for carry_c, states_c in zip(carry[..., None, None].unbind(3), states.unbind(3)):
        entering.append(S)
        S = carry_c * S + states_c
    S_in = torch.stack(entering, dim=3)  # state entering each chunk: [b, g, r, k, p, n]

    # 4. the carried-in state read at every token of the chunk
    y = y + (Ch @ S_in.transpose(-1, -2)) * into[..., None]
    return y, S


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
        x, dt, B, C, z = quarantine.clean()
    out_dtype = x.dtype
    cdt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x, dt, A, B, C = (t.to(cdt) for t in (x, dt, A, B, C))
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    R = H // G
    L = chunk_size
    nc = -(-T // L)
    pad = nc * L - T
    if nc == 0:  # no tokens
        return x.new_zeros(x.shape, dtype=out_dtype)

    dt = _preprocessed_dt(dt, None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    xs, Bs, Cs = x, B, C
    if pad:  # zero dt and x: padded tokens neither write state nor matter (they come last)
        xs = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        Bs = F.pad(B, (0, 0, 0, 0, 0, pad))
        Cs = F.pad(C, (0, 0, 0, 0, 0, pad))
    k = max(1, _GROUP_BYTES // (Bsz * H * L * L * x.element_size()))  # chunks per group
    groups = -(-nc // k)
    if seq_idx is not None:
        # padded tokens join the last sample (integer replicate-padding is not on every device)
        seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], 1) if pad else seq_idx
        cut, cont = _boundary_masks(seq_idx, seq.view(Bsz, nc, L), cdt)
        cuts, conts = cut.split(k, dim=3), cont.split(k, dim=3)
    else:
        cuts, conts = [_triangles(L, x.device)[1]] * groups, [None] * groups

    # head-major layout [b, g, r, c, l, *] (H = G * R heads, head h reads group h // R): one copy of
    # x in, one copy of y out, and every matmul below runs on contiguous operands.
    xh = xs.view(Bsz, nc * L, G, R, P).permute(0, 2, 3, 1, 4).reshape(Bsz, G, R, nc, L, P)
    dth = dt.view(Bsz, nc * L, G, R).permute(0, 2, 3, 1).reshape(Bsz, G, R, nc, L)
    Bh = Bs.transpose(1, 2).reshape(Bsz, G, 1, nc, L, N)
    Ch = Cs.transpose(1, 2).reshape(Bsz, G, 1, nc, L, N)
    # Chunks are processed in groups of about _GROUP_BYTES, the state carried from group to
    # group: a group's [L, L] decay and score tensors stay in cache through all their passes (and
    # again in the backward). split, not slicing in a loop: the backward concatenates once.
    S = xh.new_zeros(Bsz, G, R, P, N)
    ys = []
    for xg, dtg, Bg, Cg, cut_g, cont_g in zip(xh.split(k, 3), dth.split(k, 3), Bh.split(k, 3), Ch.split(k, 3),
                                            cuts, conts):
        y_g, S = _chunk_group(xg, dtg, Bg, Cg, cut_g, cont_g, A.view(G, R, 1, 1), S)
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
