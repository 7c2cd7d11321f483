"""Pure-torch packed causal depthwise conv1d, channel-last ``[B, T, C]``.

A width-K causal conv is K shifted multiply-adds along T. Only the first K-1 tokens of each sample
("boundary rows") have taps that would reach into the previous sample, so:

* forward: every tile is computed as an unsplit conv, then the boundary rows are recomputed from
  their in-sample taps only and overwritten (not corrected by subtraction);
* backward: the boundary rows' output gradients are zeroed before the unmasked shifted
  multiply-adds, and their valid taps are added back sparsely.

Taps that cross a boundary therefore contribute exact zeros, forward and backward, and the dense
work is that of the unsplit conv plus O(samples * K) gathered rows. On devices other than the CPU
the boundary rows are found without a host sync by multiplying every tap by a ``[B, T, 1]`` mask
instead (same result, more passes).

Speed on CPU: the op is a dozen elementwise passes, memory-bound; streaming a ``[T, C]`` row
through DRAM a dozen times loses to looping over samples that fit in cache, so the row is
processed in cache-sized tiles of tokens (about ``_TILE_BYTES`` per temporary), every pass of a
tile done before the next. The number of tiles depends on ``T * C``, never on the sample count.
"""

from __future__ import annotations

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ...boundaries import host_of, memo
from .._seq import sample_starts


_TILE_BYTES = 1 << 19
_SPREAD_UP_TO_BYTES = 1 << 19
"""Packed rows up to this size (x's bytes) on the CPU run spread out, K - 1 zero tokens before every sample
(:func:`causal_conv1d_masked`); larger ones recompute their boundary rows."""
_SPARSE_ON_CPU = True  # tests set False to run the dense-mask path (what other devices use) on CPU


def _tile_len(x: Tensor, K: int) -> int:
    per_token = x.shape[0] * x.shape[2] * x.element_size()
    return max(4 * K, min(x.shape[1], _TILE_BYTES // max(per_token, 1)))


class _Boundary:
    """Where taps cross a sample start. ``sparse``: the boundary rows (CPU); else dense tap masks."""

    def __init__(self, seq_idx: Tensor | None, T: int, K: int, tile: int):
        self.none = seq_idx is None or K == 1
        self.sparse = not self.none and seq_idx.device.type == "cpu" and _SPARSE_ON_CPU
        self.masks: list[Tensor | None] = [None] * K
        if self.none:
            return
        if not self.sparse:  # masks[s][:, t]: token t + s shares token t's sample
            for s in range(1, K):
                self.masks[s] = (seq_idx[:, s:] == seq_idx[:, :-s]).unsqueeze(-1)
            return
        # rows t >= 1 whose sample started less than K - 1 tokens ago: pos(t) = t - start(t)
        start = sample_starts(seq_idx)
        pos = torch.arange(T) - start
        rows = ((pos < K - 1) & (start > 0)).nonzero()  # [R, 2] (b, t), sorted by b then t
        self.b, self.t = rows[:, 0], rows[:, 1]
        self.pos = pos[self.b, self.t]
        taps = torch.arange(K)
        self.src_t = (self.t[:, None] - taps).clamp(min=0)  # [R, K]: token read by tap s
        self.valid = taps[None, :] <= self.pos[:, None]  # [R, K]: tap s stays in the sample
        # the same as rows of the [B * T, C] flattened tokens: one index_select / index_copy_ each, where
        # two-tensor advanced indexing costs several times more at small sizes
        self.flat = self.b * T + self.t  # [R]
        self.flat_src = self.b[:, None] * T + self.src_t  # [R, K]
        if self.t.numel():
            self._split_by_tile(tile, T, K)

    def _split_by_tile(self, tile: int, T: int, K: int) -> None:
        """``self.tiles[i]``: the boundary rows whose gradient tile i reads (t in ``[t0, e)``, ``e = min(t0 + tile
        + K - 1, T)``), as indices into that tile's ``[B * (e - t0)]`` flattened tokens (None if there are none)."""
        order = torch.argsort(self.t, stable=True)
        b, t = self.b[order], self.t[order]
        t0s = torch.arange(0, T, tile)
        ends = (t0s + tile + K - 1).clamp(max=T)
        lo = torch.searchsorted(t, t0s).tolist()
        hi = torch.searchsorted(t, ends).tolist()
        self.tiles = [b[i:j] * (e - t0) + t[i:j] - t0 if j > i else None
                      for i, j, t0, e in zip(lo, hi, t0s.tolist(), ends.tolist())]

    def recompute(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Pre-activation of the boundary rows from their in-sample taps only: ``[R, C]``."""
        xs = _rows(x, self.flat_src)  # [R, K, C]
        w = weight.flip(1).T  # [K, C]: w[s] multiplies x[t - s]
        out = (_keep(xs, self.valid[..., None]) * w).sum(1)
        return out + bias if bias is not None else out


def _rows(x: Tensor, flat: Tensor) -> Tensor:
    """Tokens ``flat [...]`` (indices into the ``B * T`` flattened tokens) of ``x [B, T, C]``: ``[..., C]``."""
    C = x.shape[-1]
    return x.reshape(-1, C).index_select(0, flat.reshape(-1)).view(*flat.shape, C)


def _keep(t: Tensor, mask: Tensor) -> Tensor:
    """``t`` where ``mask``, exact 0 elsewhere: a select, not a product, so a NaN or inf across a boundary
    stays out (``0 * nan`` is NaN)."""
    return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _boundary(seq_idx: Tensor | None, T: int, K: int, tile: int) -> _Boundary:
    """The :class:`_Boundary` of ``seq_idx``, built once per tensor and shape: every conv layer of a forward gets
    the same ``seq_idx``, so the rows are found once, not once per layer (kept for the tensor by
    :func:`~packfree_plugin.boundaries.memo`, freed with it)."""
    if seq_idx is None:
        return _Boundary(None, T, K, tile)
    return memo(seq_idx, "conv_boundary", (T, K, tile), lambda: _Boundary(seq_idx, T, K, tile))


def _pre(x: Tensor, taps: Tensor, bias: Tensor | None, bnd: _Boundary, t0: int, t1: int,
         out: Tensor) -> Tensor:
    """Pre-activation of tokens ``[t0, t1)`` into ``out``. ``taps [K, C]``: the weight transposed, contiguous (a
    strided ``weight[:, k]`` column halves the speed of every multiply-add it feeds)."""
    K = taps.shape[0]
    if bias is not None:
        torch.addcmul(bias, x[:, t0:t1], taps[K - 1], out=out)
    else:
        torch.mul(x[:, t0:t1], taps[K - 1], out=out)
    for s in range(1, K):
        lo = max(t0, s)  # first token with a source s steps back
        if lo >= t1:
            break
        src = x[:, lo - s : t1 - s]
        if bnd.masks[s] is not None:
            src = _keep(src, bnd.masks[s][:, lo - s : t1 - s])
        out[:, lo - t0 :].addcmul_(src, taps[K - 1 - s])
    return out


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, silu: bool
             ) -> tuple[Tensor, Tensor, _Boundary, int]:
    """``(out, pre-activation, boundary rows, tile)`` of ``x [B, T, C]``, tile by tile."""
    T, K = x.shape[1], weight.shape[1]
    tile = _tile_len(x, K)
    bnd = _boundary(seq_idx, T, K, tile)
    taps = weight.T.contiguous()
    pre = torch.empty_like(x)
    out = torch.empty_like(x) if silu else pre
    for t0 in range(0, T, tile):
        t1 = min(t0 + tile, T)
        p = _pre(x, taps, bias, bnd, t0, t1, out=pre[:, t0:t1])
        if silu:
            torch.ops.aten.silu.out(p, out=out[:, t0:t1])
    if bnd.sparse and bnd.t.numel():  # overwrite the boundary rows with their in-sample value
        fixed = bnd.recompute(x, weight, bias)
        pre.view(-1, x.shape[2]).index_copy_(0, bnd.flat, fixed)
        if silu:
            out.view(-1, x.shape[2]).index_copy_(0, bnd.flat, F.silu(fixed))
    return out, pre, bnd, tile


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, silu: bool) -> Tensor:
    """:class:`_MaskedCausalConv1d` where autograd records, else its forward alone (no graph node to build)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _MaskedCausalConv1d.apply(x, weight, bias, seq_idx, silu)
    return _forward(x, weight, bias, seq_idx, silu)[0]


class _MaskedCausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
                silu: bool) -> Tensor:
        out, pre, bnd, tile = _forward(x, weight, bias, seq_idx, silu)
        ctx.silu, ctx.has_bias, ctx.tile, ctx.bnd = silu, bias is not None, tile, bnd
        ctx.save_for_backward(x, weight, pre if silu else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, weight, pre = ctx.saved_tensors
        bnd: _Boundary = ctx.bnd
        T, K = x.shape[1], weight.shape[1]
        taps = weight.T.contiguous()  # [K, C]: taps[k] is weight[:, k], contiguous (see _pre)
        tile = ctx.tile
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if need_x else None
        # weight / bias gradients accumulate per token slot of a tile (one fused addcmul_ per tap),
        # reduced over the slots once at the end
        acc_w = x.new_zeros(K, x.shape[0], min(tile, T), x.shape[2]) if need_w else None
        acc_b = x.new_zeros(x.shape[0], min(tile, T), x.shape[2]) if (need_b and ctx.has_bias) else None

        def g_pre(t0: int, t1: int) -> Tensor:  # gradient w.r.t. the pre-activation, a fresh tensor
            g = grad_out[:, t0:t1]
            return torch.ops.aten.silu_backward(g, pre[:, t0:t1]) if ctx.silu else g.clone()

        for t0 in range(0, T, tile):
            t1 = min(t0 + tile, T)
            e = min(t1 + K - 1, T)  # outputs that read tokens of this tile
            n = t1 - t0
            g = g_pre(t0, e)
            xt = x[:, t0:t1]
            # tap 0 never crosses a boundary
            if need_x:
                torch.mul(g[:, :n], taps[K - 1], out=grad_x[:, t0:t1])
            if need_w:
                acc_w[K - 1, :, :n].addcmul_(g[:, :n], xt)
            if acc_b is not None:
                acc_b[:, :n].add_(g[:, :n])
            if bnd.sparse and bnd.t.numel():  # boundary rows leave the dense taps (added back below)
                rows = bnd.tiles[t0 // tile]
                if rows is not None:
                    g.view(-1, g.shape[2]).index_fill_(0, rows, 0.0)
            for s in range(1, K):
                m = min(n, e - t0 - s)  # tokens t of the tile whose output t + s exists
                if m <= 0:
                    break
                gs = g[:, s : s + m]
                if bnd.masks[s] is not None:
                    gs = _keep(gs, bnd.masks[s][:, t0 : t0 + m])
                if need_x:
                    grad_x[:, t0 : t0 + m].addcmul_(gs, taps[K - 1 - s])
                if need_w:
                    acc_w[K - 1 - s, :, :m].addcmul_(gs, xt[:, :m])
        grad_wt = acc_w.sum((1, 2)) if need_w else None
        grad_b = acc_b.sum((0, 1)) if acc_b is not None else None
        if bnd.sparse and bnd.t.numel():
            gb = _rows(grad_out, bnd.flat)  # [R, C]
            if ctx.silu:
                gb = torch.ops.aten.silu_backward(gb, _rows(pre, bnd.flat))
            g_taps = _keep(gb[:, None, :], bnd.valid[:, 1:, None])  # [R, K-1, C]: taps s >= 1 inside the sample
            if need_x:
                w = weight[:, : K - 1].flip(1).T  # [K-1, C]: w[s-1] multiplies x[t - s]
                flat = bnd.flat_src[:, 1:].reshape(-1)
                grad_x.view(-1, x.shape[2]).index_add_(0, flat, (g_taps * w).reshape(-1, x.shape[2]))
            if need_w:
                xs = _keep(_rows(x, bnd.flat_src[:, 1:]), bnd.valid[:, 1:, None])  # [R, K-1, C]
                grad_wt[: K - 1] += (g_taps * xs).sum(0).flip(0)
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
    silu = activation in ("silu", "swish")
    K = weight.shape[1]
    if (seq_idx is not None and K > 1 and seq_idx.device.type == "cpu" and _SPARSE_ON_CPU
            and x.numel() * x.element_size() <= _SPREAD_UP_TO_BYTES):
        # a small row: the fixed cost of the boundary rows' dozen gathers and scatters is most of the op (1.25x
        # stock's unsplit conv at 16 samples of 4-32 tokens, C = 64, against 1.0x spread out), so give every
        # sample its own K - 1 zero tokens and run the unsplit conv on the spread-out row
        B, T, C = x.shape
        slots, length = _spread(seq_idx, K)
        spread = x.new_zeros(1, length, C).index_copy_(1, slots, x.reshape(1, B * T, C))
        return _conv(spread, weight, bias, None, silu).index_select(1, slots).view(B, T, C)
    return _conv(x.contiguous(), weight, bias, seq_idx, silu)


def _spread(seq_idx: Tensor, K: int) -> tuple[Tensor, int]:
    """``(slots [B * T] long, length)``: token ``j`` of the flattened rows at ``slots[j]`` of a ``length``-token
    row where K - 1 zero tokens precede every sample. Kept for ``seq_idx`` (:func:`~packfree_plugin.boundaries.memo`:
    every layer of a forward passes the same tensor); CPU only, so it is computed on the host, in numpy (a quarter of
    torch's per-call cost)."""
    def build() -> tuple[Tensor, int]:
        ids = host_of(seq_idx)
        starts = numpy.empty(ids.shape, dtype=bool)
        starts[:, :1] = True  # rows start samples too
        numpy.not_equal(ids[:, 1:], ids[:, :-1], out=starts[:, 1:])
        count = starts.ravel().cumsum()  # [B * T] int64: samples started so far
        slots = numpy.arange(count.size)
        slots += (K - 1) * count
        return torch.from_numpy(slots), count.size + (K - 1) * int(count[-1])

    return memo(seq_idx, "conv_spread", (K, tuple(seq_idx.shape)), build)
