"""Portable packed attention: one fused SDPA call per segment (per group of equal short ones), on any device.

No ``[T, T]`` mask is ever built: each segment attends to itself through
``torch.nn.functional.scaled_dot_product_attention`` (whose CPU kernel keeps O(L) extra memory), so the
cost is that of running the samples one by one, minus everything outside attention that now runs
batched. Chunked attention (Llama 4) runs each chunk of a sample as a segment of its own. Sliding windows are computed
in query blocks over only the keys in reach (O(L * W) memory);
softcapping and sinks, which SDPA cannot express, go through the eager reference in the same blocks.
Padding segments produce zeros.

Under ``torch.compile`` the same computation runs inside packfree's opaque custom op
(:mod:`packfree_plugin.ops.opaque`, via :func:`~packfree_plugin.attention.run_packed_attention`), which
receives the boundaries as a small CPU tensor: compiled graphs then neither unroll the segment loop nor
recompile when the packing changes.
"""

from __future__ import annotations

from typing import NamedTuple

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
    """``count`` samples of one ``length`` run as one batched call. ``start``: their first token when they lie back
    to back (a view then replaces the gather); else None and ``index [count, length]`` holds their flat tokens.
    (Named tuples: built per forward, a frozen dataclass costs several times more.)"""

    length: int
    count: int
    start: int | None
    index: torch.Tensor | None

    def tokens(self, device: torch.device) -> torch.Tensor:
        """``[count * length]`` flat token indices."""
        if self.index is not None:
            return self.index.reshape(-1)
        return torch.arange(self.start, self.start + self.count * self.length, device=device)


class _Plan(NamedTuple):
    """How one packing runs: its groups, and where their outputs go (``where [tokens]``, None when the one group
    is the whole batch in order)."""

    groups: tuple[_Group, ...]
    where: torch.Tensor | None


def _plan(boundaries: Boundaries, device: torch.device, chunk: int | None) -> _Plan:
    """Group the spans of ``boundaries`` that attend only to themselves (:func:`_attended_spans`): long ones alone,
    short ones by length; built once per forward."""
    runs: list[tuple[int, list[int]]] = []
    short: dict[int, list[int]] = {}
    for start, length in _attended_spans(boundaries, chunk):
        if length <= BATCHED_UP_TO:
            short.setdefault(length, []).append(start)
        else:
            runs.append((length, [start]))
    groups = []
    for length, starts in (*runs, *short.items()):
        if starts == list(range(starts[0], starts[0] + length * len(starts), length)):
            groups.append(_Group(length, len(starts), starts[0], None))
        else:
            index = (torch.tensor(starts)[:, None] + torch.arange(length)).to(device)
            groups.append(_Group(length, len(starts), None, index))
    total = boundaries.batch_size * boundaries.seq_len
    if len(groups) == 1 and groups[0].start == 0 and groups[0].count * groups[0].length == total:
        return _Plan(tuple(groups), None)
    return _Plan(tuple(groups), torch.cat([group.tokens(device) for group in groups]) if groups else None)


def _gather(flat: torch.Tensor, group: _Group) -> torch.Tensor:
    """``flat [B*T, H, D]`` -> the group's ``[n, H, L, D]``."""
    if group.index is None:
        tokens = flat[group.start:group.start + group.count * group.length]
        return tokens.view(group.count, group.length, *flat.shape[1:]).transpose(1, 2)
    return flat[group.index].transpose(1, 2)


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
    if plan.where is None and plan.groups:  # one group: the whole batch, in order (samples of one length)
        group = plan.groups[0]
        out = _one_segment(_as_group(query, group), _as_group(key, group), _as_group(value, group), options,
                           training=training, query_block=query_block, bias=bias)
        # contiguous, as stock's output is (Dory views it)
        out = out.transpose(1, 2).reshape(batch, seq_len, heads, value.shape[-1]).contiguous()
        return out if out.dtype == query.dtype else out.to(query.dtype)
    # [B*T, H, D] token-major views: transformers hands over q/k/v as transposes of [B, T, H, D] tensors, so
    # these are usually views, not copies
    flat_q, flat_k, flat_v = (t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], t.shape[3])
                              for t in (query, key, value))
    outputs = [
        _one_segment(_gather(flat_q, group), _gather(flat_k, group), _gather(flat_v, group), options,
                     training=training, query_block=query_block, bias=bias).transpose(1, 2)  # [n, L, H, Dv]
        for group in plan.groups
    ]
    result = query.new_zeros(batch * seq_len, heads, value.shape[-1])
    if plan.where is not None:
        values = torch.cat([out.reshape(-1, heads, value.shape[-1]) for out in outputs])
        result = result.index_copy(0, plan.where, values.to(result.dtype))
    return result.view(batch, seq_len, heads, value.shape[-1])


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
            spans.extend((offset, min(chunk, start + length - offset)) for offset in range(start, start + length, chunk))
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
    blocks = []
    for q_start in range(0, length, query_block):
        q_end = min(q_start + query_block, length)
        k_start, k_end = _keys_in_reach(q_start, q_end, length, options)
        blocks.append(
            _block(query[:, :, q_start:q_end], key[:, :, k_start:k_end], value[:, :, k_start:k_end], options,
                   q_offset=q_start - k_start, training=training)
        )
    return torch.cat(blocks, dim=2)


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
class _CrossGroup(NamedTuple):
    """``count`` decoder samples of one length reading encoder samples of one length: their flat decoder tokens
    ``queries [count, Lq]`` and encoder tokens ``keys [count, Lk]``."""

    queries: torch.Tensor
    keys: torch.Tensor


def _cross_plan(pairing: Seq2SeqBoundaries,
                device: torch.device) -> tuple[tuple[_CrossGroup, ...], torch.Tensor | None]:
    """Pairs grouped by (decoder length, encoder length), and ``where [tokens]``: the decoder tokens the groups'
    outputs fill, in order. Built once per forward."""
    by_lengths: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for decoder_start, decoder_length, encoder_start, encoder_length in pairing.pairs:
        by_lengths.setdefault((decoder_length, encoder_length), []).append((decoder_start, encoder_start))
    groups = []
    for (decoder_length, encoder_length), starts in by_lengths.items():
        first = torch.tensor(starts)
        groups.append(_CrossGroup((first[:, :1] + torch.arange(decoder_length)).to(device),
                                  (first[:, 1:] + torch.arange(encoder_length)).to(device)))
    where = torch.cat([group.queries.reshape(-1) for group in groups]) if groups else None
    return tuple(groups), where


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
    encoder_len = key.shape[2]
    flat_q = query.transpose(1, 2).reshape(batch * decoder_len, heads, query.shape[3])
    flat_k, flat_v = (t.transpose(1, 2).reshape(batch * encoder_len, t.shape[1], t.shape[3]) for t in (key, value))
    groups, where = memo(pairing.decoder, ("cross_attention_plan", query.device), None,
                         lambda: _cross_plan(pairing, query.device))
    result = query.new_zeros(batch * decoder_len, heads, value.shape[-1])
    if not groups:  # every decoder row is padding
        return result.view(batch, decoder_len, heads, value.shape[-1])
    outputs = []
    for group in groups:
        q = flat_q[group.queries].transpose(1, 2)  # [n, H, Lq, D]
        k, v = flat_k[group.keys].transpose(1, 2), flat_v[group.keys].transpose(1, 2)  # [n, Hkv, Lk, D]
        if options.needs_eager:
            out = eager_attention(q, k, v, options, training=training)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=options.dropout if training else 0.0,
                                                 scale=options.scale, enable_gqa=q.shape[1] != k.shape[1])
        outputs.append(out.transpose(1, 2).reshape(-1, heads, value.shape[-1]))
    result = result.index_copy(0, where, torch.cat(outputs).to(result.dtype))
    return result.view(batch, decoder_len, heads, value.shape[-1])
