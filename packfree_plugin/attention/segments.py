"""Portable packed attention: one fused SDPA call per segment (per group of equal short ones), on any device.

No ``[T, T]`` mask is ever built: each segment attends to itself through
``torch.nn.functional.scaled_dot_product_attention`` (whose CPU kernel keeps O(L) extra memory), so the
cost is that of running the samples one by one, minus everything outside attention that now runs
batched. Chunked attention (Llama 4) runs each chunk of a sample as a segment of its own. Sliding windows are computed
in query blocks over only the keys in reach (O(L * W) memory);
softcapping and sinks, which SDPA cannot express, go through the eager reference in the same blocks.
Padding segments produce zeros.

Each layer moves every token a constant number of times, forward and backward, however many groups and blocks
there are: the groups are gathered by one permutation into group order and split into views (whose backward is one
``cat``), written back by one inverse; query blocks are splits, their key ranges views whose gradients add into one
buffer (:class:`_Narrows`). Slicing each group out of the row made, in backward, a zero gradient of the whole row
for every group and block.

Under ``torch.compile`` the same computation runs inside packfree's opaque custom op
(:mod:`packfree_plugin.ops.opaque`, via :func:`~packfree_plugin.attention.run_packed_attention`), which
receives the boundaries as a small CPU tensor: compiled graphs then neither unroll the segment loop nor
recompile when the packing changes.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy
import torch
import torch.nn.functional as F

from ..boundaries import Boundaries, Seq2SeqBoundaries, memo
from .reference import AttentionOptions, eager_attention, visible_keys

__all__ = ["cross_segment_attention", "segment_attention", "BATCHED_UP_TO", "QUERY_BLOCK"]

QUERY_BLOCK = 256
"""Queries per block when a window, softcap or sinks force blockwise computation."""
BATCHED_UP_TO = 64
"""Segments up to this length that share a length run as one batched call (many short samples would
otherwise cost one call each)."""


class _Group(NamedTuple):
    """``count`` samples of one ``length`` run as one batched call: ``count * length`` consecutive tokens of the
    plan's group order. (Named tuples: built per forward, a frozen dataclass costs several times more.)"""

    length: int
    count: int


class _Plan(NamedTuple):
    """How one packing runs: its groups, laid out one after another in *group order*.

    ``order [M]``: the flat token of each group-order token (None: group order is ``0 .. B*T - 1`` itself).
    ``inverse [B*T]``: the group-order position of each flat token, when the groups cover every token (no padding)
    in another order; None otherwise. Gathering is one ``index_select`` and one ``split`` (whose backward is one
    ``cat``), writing back one ``index_select`` or ``index_copy``: each token is moved a constant number of times per
    layer, forward and backward, however many groups there are."""

    groups: tuple[_Group, ...]
    order: torch.Tensor | None
    inverse: torch.Tensor | None


def _plan(boundaries: Boundaries, device: torch.device, chunk: int | None) -> _Plan:
    """Group the spans of ``boundaries`` that attend only to themselves (:func:`_attended_spans`): short ones that
    share their length batched by length, every other one alone, in place (a row whose groups are all alone keeps its
    order: no gather); built once per forward, on the host."""
    runs: list[tuple[int, list[int]]] = []
    short: dict[int, list[int]] = {}
    spans = _attended_spans(boundaries, chunk)
    shared = Counter(length for _, length in spans if length <= BATCHED_UP_TO)
    for start, length in spans:
        if shared[length] > 1:
            short.setdefault(length, []).append(start)
        else:  # long, or a short length no other span has: batching it would only move it
            runs.append((length, [start]))
    laid_out = (*runs, *short.items())
    groups = tuple(_Group(length, len(starts)) for length, starts in laid_out)
    total = boundaries.batch_size * boundaries.seq_len
    if _in_row_order(laid_out, total):
        return _Plan(groups, None, None)
    starts = numpy.array([start for _, group_starts in laid_out for start in group_starts],
                         dtype=numpy.int64)
    lengths = numpy.array([length for length, group_starts in laid_out for _ in group_starts],
                          dtype=numpy.int64)
    order = numpy.repeat(starts - numpy.cumsum(lengths) + lengths, lengths) + numpy.arange(lengths.sum())
    inverse = None
    if order.size == total:
        inverse = numpy.empty(total, dtype=numpy.int64)
        inverse[order] = numpy.arange(total)
        inverse = torch.from_numpy(inverse).to(device)
    return _Plan(groups, torch.from_numpy(order).to(device), inverse)


def _in_row_order(laid_out: tuple[tuple[int, list[int]], ...], total: int) -> bool:
    """Whether groups ``(length, starts)`` laid out one after another cover all ``total`` flat tokens in row order,
    so group order is the row itself (checked in Python: numpy's per-call cost exceeds a short row's loop)."""
    position = 0
    for length, starts in laid_out:
        for start in starts:
            if start != position:
                return False
            position += length
    return position == total


def _grouped(t: torch.Tensor, plan: _Plan) -> list[torch.Tensor]:
    """``t [B, H, T, D]`` -> each group's ``[n, H, L, D]``: one gather into group order, then views."""
    batch, heads, seq_len, dim = t.shape
    flat = t.transpose(1, 2).reshape(batch * seq_len, heads, dim)  # a view for transformers' layout
    if plan.order is not None:
        flat = flat.index_select(0, plan.order)
    pieces = flat.split([group.count * group.length for group in plan.groups])
    return [piece.view(group.count, group.length, heads, dim).transpose(1, 2)
            for piece, group in zip(pieces, plan.groups)]


def _as_group(t: torch.Tensor, group: _Group) -> torch.Tensor:
    """``t [B, H, T, D]`` whose ``B * T`` tokens are the ``group`` in order -> the group's ``[n, H, L, D]`` (a view
    when ``t`` is the transpose of a ``[B, T, H, D]`` tensor, as transformers hands it over; ``t`` itself for one
    sample per row)."""
    batch, heads, seq_len, dim = t.shape
    if group.length == seq_len:
        return t
    if batch == 1:  # splitting one dimension is always a view
        return t.view(heads, group.count, group.length, dim).transpose(0, 1)
    return t.transpose(1, 2).reshape(group.count, group.length, heads, dim).transpose(1, 2)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: Boundaries,
    options: AttentionOptions,
    *,
    training: bool = False,
    query_block: int = QUERY_BLOCK,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``[B, T, H, Dv]``, each segment on its own.

    ``query_block``: queries per block where a binding window, softcap or sinks force blockwise work.
    ``bias``: a relative position bias ``[1, H, L, L]`` added to the scores (T5's), ``L`` at least the longest segment:
    it depends only on the distance between query and key, so every segment takes its top-left corner.
    """
    batch, heads, seq_len, _ = query.shape
    plan = memo(boundaries, ("segment_attention_plan", query.device, options.chunk), None,
                lambda: _plan(boundaries, query.device, options.chunk))
    if plan.order is None and len(plan.groups) == 1:  # one group: the whole batch, in order (one sample length)
        group = plan.groups[0]
        out = _one_segment(_as_group(query, group), _as_group(key, group), _as_group(value, group), options,
                           training=training, query_block=query_block, bias=bias)
        # contiguous, as stock's output is (Dory views it)
        out = out.transpose(1, 2).reshape(batch, seq_len, heads, value.shape[-1]).contiguous()
        return out if out.dtype == query.dtype else out.to(query.dtype)
    outputs = [
        _one_segment(q, k, v, options, training=training, query_block=query_block, bias=bias).transpose(1, 2)
        for q, k, v in zip(_grouped(query, plan), _grouped(key, plan), _grouped(value, plan))
    ]  # [n, L, H, Dv] each
    dim = value.shape[-1]
    values = torch.cat([out.reshape(-1, heads, dim) for out in outputs]) if outputs else query.new_zeros(0, heads, dim)
    values = values.to(query.dtype)
    if plan.order is None:
        result = values
    elif plan.inverse is not None:
        result = values.index_select(0, plan.inverse)
    else:  # padding tokens keep zeros
        result = query.new_zeros(batch * seq_len, heads, dim).index_copy(0, plan.order, values)
    return result.view(batch, seq_len, heads, dim)


def _attended_spans(boundaries: Boundaries, chunk: int | None) -> list[tuple[int, int]]:
    """``(start, length)`` over the flattened rows of every span whose tokens attend only to each other: the samples
    (padding spans keep the zeros they start with), or with ``chunk`` each sample's chunks, counted from its start."""
    spans = []
    for start, length, padding in zip(boundaries.offsets, boundaries.lengths, boundaries.padding):
        if padding:
            continue
        if not chunk:
            spans.append((start, length))
        else:
            spans.extend((offset, min(chunk, start + length - offset))
                         for offset in range(start, start + length, chunk))
    return spans


def _one_segment(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: AttentionOptions, *, training: bool,
    query_block: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Self-attention inside one segment, or ``n`` segments of one length: ``[n, H, L, D]`` x ``[n, Hkv, L, D]`` ->
    ``[n, H, L, Dv]``."""
    length = query.shape[2]
    if bias is not None:
        return _biased_segment(query, key, value, options, bias, training=training)
    window_binds = options.window is not None and options.window < length
    if not options.needs_eager and not window_binds:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=options.dropout if training else 0.0,
            is_causal=options.causal and length > 1,
            scale=options.scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    if length <= query_block:
        return eager_attention(query, key, value, options, q_offset=0, training=training)
    reach = [_keys_in_reach(q_start, min(q_start + query_block, length), length, options)
             for q_start in range(0, length, query_block)]
    every_key = all(bounds == (0, length) for bounds in reach)  # bidirectional, no window: each block sees all keys
    keys, values = ([t] * len(reach) if every_key else _Narrows.apply(t, reach) for t in (key, value))
    blocks = [_block(q, k, v, options, q_offset=index * query_block - k_start, training=training)
              for index, (q, k, v, (k_start, _)) in enumerate(zip(query.split(query_block, dim=2), keys, values,
                                                                    reach))]
    return torch.cat(blocks, dim=2)


class _Narrows(torch.autograd.Function):
    """``x [n, H, L, D]`` -> its views ``x[:, :, start:end]``, one per ``(start, end)`` of ``ranges`` (key ranges of
    query blocks, which overlap). Backward adds their gradients into one buffer: slicing's own backward would fill a
    zero tensor of ``x``'s size for every view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.ranges, ctx.shape = ranges, x.shape
        return tuple(x[:, :, start:end] for start, end in ranges)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        present = [(grad, bounds) for grad, bounds in zip(grads, ctx.ranges) if grad is not None]
        if not present:
            return None, None
        buffer = present[0][0].new_zeros(ctx.shape)
        for grad, (start, end) in present:
            buffer[:, :, start:end] += grad
        return buffer, None


def _keys_in_reach(q_start: int, q_end: int, length: int, options: AttentionOptions) -> tuple[int, int]:
    """Key range ``[k_start, k_end)`` that queries ``[q_start, q_end)`` can see under causality and window."""
    window = options.window
    if options.causal:
        return (0 if window is None else max(0, q_start - window + 1)), q_end
    if window is None:
        return 0, length
    return max(0, q_start - window + 1), min(length, q_end + window - 1)


def _block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: AttentionOptions, *, q_offset: int,
    training: bool,
) -> torch.Tensor:
    if options.needs_eager:
        return eager_attention(query, key, value, options, q_offset=q_offset, training=training)
    visible = visible_keys(
        query.shape[2], key.shape[2], causal=options.causal, window=options.window, device=query.device,
        q_offset=q_offset,
    )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, dropout_p=options.dropout if training else 0.0, scale=options.scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _biased_segment(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: AttentionOptions,
                    bias: torch.Tensor, *, training: bool) -> torch.Tensor:
    """:func:`_one_segment` with a relative position ``bias [1, H, >=L, >=L]`` added to the scores (its top-left
    ``L x L`` corner), causal where ``options`` say so: what stock sdpa computes for a sample alone."""
    if options.window is not None or options.chunk is not None or options.needs_eager:
        raise ValueError("packfree applies a relative position bias only to full attention without softcap or sinks")
    length = query.shape[2]
    mask = bias[:, :, :length, :length].to(query.dtype)
    if options.causal:
        later = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
        mask = mask.masked_fill(later, torch.finfo(query.dtype).min)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=options.dropout if training else 0.0, scale=options.scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )


# ------------------------------------------------------------------------------------- cross-attention
class _CrossPlan(NamedTuple):
    """Pairs grouped by (decoder length, encoder length): ``sizes`` holds each group's ``(count, Lq, Lk)``, in the
    order its decoder tokens take in ``queries [Mq]`` and its encoder tokens in ``keys [Mk]`` (flat tokens, group
    after group): one gather each, then views of consecutive tokens."""

    sizes: tuple[tuple[int, int, int], ...]
    queries: torch.Tensor
    keys: torch.Tensor


def _cross_plan(pairing: Seq2SeqBoundaries, device: torch.device) -> _CrossPlan:
    """The pairs of ``pairing`` by lengths, built once per forward on the host."""
    by_lengths: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for decoder_start, decoder_length, encoder_start, encoder_length in pairing.pairs:
        by_lengths.setdefault((decoder_length, encoder_length), []).append((decoder_start, encoder_start))
    queries, keys = [], []
    for (decoder_length, encoder_length), starts in by_lengths.items():
        first = numpy.array(starts, dtype=numpy.int64).reshape(-1, 2)
        queries.append((first[:, :1] + numpy.arange(decoder_length)).reshape(-1))
        keys.append((first[:, 1:] + numpy.arange(encoder_length)).reshape(-1))
    sizes = tuple((len(starts), lq, lk) for (lq, lk), starts in by_lengths.items())
    flat = (torch.from_numpy(numpy.concatenate(parts) if parts else numpy.zeros(0, numpy.int64)).to(device)
            for parts in (queries, keys))
    return _CrossPlan(sizes, *flat)


def cross_segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pairing: Seq2SeqBoundaries,
    options: AttentionOptions,
    *,
    training: bool = False,
) -> torch.Tensor:
    """Packed cross-attention: ``query [B, H, Td, D]`` (decoder rows), ``key/value [B, Hkv, Te, D]`` (encoder rows) ->
    ``[B, Td, H, Dv]``. Each decoder sample attends to all of its own encoder sample and nothing else: one fused call
    per group of pairs of equal lengths, O(sum of Lq x Lk) extra memory; decoder padding gets zeros."""
    if options.window is not None or options.chunk is not None or options.causal:
        raise ValueError("packfree's packed cross-attention is full and bidirectional (no window, chunk or causality)")
    batch, heads, decoder_len, _ = query.shape
    encoder_len, dim = key.shape[2], value.shape[-1]
    plan = memo(pairing.decoder, ("cross_attention_plan", query.device), None,
                lambda: _cross_plan(pairing, query.device))
    result = query.new_zeros(batch * decoder_len, heads, dim)
    if not plan.sizes:  # every decoder row is padding
        return result.view(batch, decoder_len, heads, dim)
    flat_q = query.transpose(1, 2).reshape(batch * decoder_len, heads, query.shape[3]).index_select(0, plan.queries)
    flat_k, flat_v = (t.transpose(1, 2).reshape(batch * encoder_len, t.shape[1], t.shape[3]).index_select(0, plan.keys)
                      for t in (key, value))
    outputs = []
    for q, k, v, (count, lq, lk) in zip(flat_q.split([n * lq for n, lq, _ in plan.sizes]),
                                        flat_k.split([n * lk for n, _, lk in plan.sizes]),
                                        flat_v.split([n * lk for n, _, lk in plan.sizes]), plan.sizes):
        q = q.view(count, lq, *q.shape[1:]).transpose(1, 2)  # [n, H, Lq, D]
        k, v = (t.view(count, lk, *t.shape[1:]).transpose(1, 2) for t in (k, v))  # [n, Hkv, Lk, D]
        if options.needs_eager:
            out = eager_attention(q, k, v, options, training=training)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=options.dropout if training else 0.0,
                                                 scale=options.scale, enable_gqa=q.shape[1] != k.shape[1])
        outputs.append(out.transpose(1, 2).reshape(-1, heads, dim))
    result = result.index_copy(0, plan.queries, torch.cat(outputs).to(result.dtype))
    return result.view(batch, decoder_len, heads, dim)
