"""Pure-torch packed causal depthwise conv1d, channel-last ``[B, T, C]``.

A width-K causal conv is K shifted multiply-adds along T. Tap ``s`` (reading token ``t - s``) is
multiplied by a mask that is 0 exactly where ``t - s`` lies in an earlier sample, so samples never
see each other, forward or backward: masked taps contribute exact zeros (no subtracted correction).

Speed on CPU: the op is a dozen elementwise passes, memory-bound. Streaming a ``[T, C]`` row
through DRAM a dozen times is slower than looping over samples that fit in cache, so the row is
processed in cache-sized tiles of tokens (about ``_TILE_BYTES`` per temporary), every pass of a tile
done before the next tile; tiles without a boundary skip the masks. The number of tiles depends on
``T * C``, never on the number of samples. The backward is written by hand and recomputes the
pre-activation per tile instead of storing it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._seq import first_token_mask

_TILE_BYTES = 1 << 19


def _tile_len(x: Tensor, K: int) -> int:
    per_token = x.shape[0] * x.shape[2] * x.element_size()
    return max(4 * K, min(x.shape[1], _TILE_BYTES // max(per_token, 1)))


def _tile_flags(seq_idx: Tensor | None, T: int, tile: int, K: int) -> list[bool]:
    """Per tile: does any tap of a token in ``[t0, t0 + tile + K - 1)`` cross a boundary?"""
    n_tiles = (T + tile - 1) // tile
    if seq_idx is None:
        return [False] * n_tiles
    if seq_idx.device.type != "cpu":  # a host sync per call is not worth it there: mask every tile
        return [True] * n_tiles
    starts = first_token_mask(seq_idx).any(0)
    starts[0] = False
    count = torch.cumsum(starts.to(torch.int64), 0)
    lo = torch.arange(n_tiles) * tile
    hi = torch.clamp(lo + tile + K - 1, max=T) - 1
    before = torch.where(lo > 0, count[torch.clamp(lo - 1, min=0)], torch.zeros_like(lo))
    return (count[hi] > before).tolist()


def _masks(seq_idx: Tensor | None, K: int, dtype: torch.dtype) -> list[Tensor | None]:
    """``masks[s][:, t]`` = 1 where token ``t + s`` and token ``t`` share a sample (``[B, T-s, 1]``)."""
    out: list[Tensor | None] = [None]
    for s in range(1, K):
        out.append(None if seq_idx is None else
                   (seq_idx[:, s:] == seq_idx[:, :-s]).unsqueeze(-1).to(dtype))
    return out


def _pre(x: Tensor, weight: Tensor, bias: Tensor | None, masks: list[Tensor | None], t0: int,
         t1: int, use_mask: bool, out: Tensor | None = None) -> Tensor:
    """Pre-activation of tokens ``[t0, t1)`` (into ``out`` if given)."""
    K = weight.shape[1]
    pre = torch.mul(x[:, t0:t1], weight[:, K - 1], out=out) if out is not None \
        else x[:, t0:t1] * weight[:, K - 1]
    if bias is not None:
        pre.add_(bias)
    for s in range(1, K):
        lo = max(t0, s)  # first token with a source s steps back
        if lo >= t1:
            break
        src = x[:, lo - s : t1 - s]
        if use_mask:
            src = src * masks[s][:, lo - s : t1 - s]
        pre[:, lo - t0 :].addcmul_(src, weight[:, K - 1 - s])
    return pre


class _MaskedCausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
                silu: bool) -> Tensor:
        T, K = x.shape[1], weight.shape[1]
        tile = _tile_len(x, K)
        flags = _tile_flags(seq_idx, T, tile, K)
        masks = _masks(seq_idx, K, x.dtype)
        out = torch.empty_like(x)
        for i, t0 in enumerate(range(0, T, tile)):
            t1 = min(t0 + tile, T)
            o = _pre(x, weight, bias, masks, t0, t1, flags[i], out=out[:, t0:t1])
            if silu:
                F.silu(o, inplace=True)
        ctx.silu, ctx.has_bias, ctx.tile, ctx.flags = silu, bias is not None, tile, flags
        ctx.save_for_backward(x, weight, bias, seq_idx)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, weight, bias, seq_idx = ctx.saved_tensors
        T, K = x.shape[1], weight.shape[1]
        tile, flags = ctx.tile, ctx.flags
        masks = _masks(seq_idx, K, x.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if need_x else None
        grad_wt = torch.zeros(K, x.shape[2], dtype=x.dtype, device=x.device) if need_w else None
        grad_b = torch.zeros_like(bias) if (need_b and ctx.has_bias) else None
        for i, t0 in enumerate(range(0, T, tile)):
            t1 = min(t0 + tile, T)
            e = min(t1 + K - 1, T)  # outputs that read tokens of this tile
            use_mask = flags[i]
            g = grad_out[:, t0:e]
            if ctx.silu:
                g = torch.ops.aten.silu_backward(g, _pre(x, weight, bias, masks, t0, e, use_mask))
            n = t1 - t0
            xt = x[:, t0:t1]
            if need_x:
                torch.mul(g[:, :n], weight[:, K - 1], out=grad_x[:, t0:t1])
            if need_w:
                grad_wt[K - 1] += (g[:, :n] * xt).sum((0, 1))
            if grad_b is not None:
                grad_b += g[:, :n].sum((0, 1))
            for s in range(1, K):
                m = min(n, e - t0 - s)  # tokens t of the tile whose output t + s exists
                if m <= 0:
                    break
                gs = g[:, s : s + m]
                if use_mask:
                    gs = gs * masks[s][:, t0 : t0 + m]
                if need_x:
                    grad_x[:, t0 : t0 + m].addcmul_(gs, weight[:, K - 1 - s])
                if need_w:
                    grad_wt[K - 1 - s] += (gs * xt[:, :m]).sum((0, 1))
        grad_w = grad_wt.T.contiguous() if need_w else None
        return grad_x, grad_w, grad_b, None, None


def causal_conv1d_masked(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    seq_idx: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """``x [B, T, C]``, ``weight [C, K]``, ``bias [C]``, ``seq_idx [B, T]`` int32 -> ``[B, T, C]``.

    No argument checks here (the public op does them); ``seq_idx=None`` means one sample per row.
    """
    return _MaskedCausalConv1d.apply(x.contiguous(), weight, bias, seq_idx,
                                     activation in ("silu", "swish"))
