"""Portable packed attention: one fused SDPA call per segment (per group of equal short ones), on any device.

No ``[T, T]`` mask is ever built: each segment attends to itself through
``torch.nn.functional.scaled_dot_product_attention`` (whose CPU kernel keeps O(L) extra memory), so the
cost is that of running the samples one by one, minus everything outside attention that now runs
batched. Chunked attention (Llama 4) runs each chunk of a sample as a segment of its own. Sliding windows are computed
in query blocks over only the keys in reach (O(L * W) memory);
softcapping and sinks, which SDPA cannot express, go through the eager reference in the same blocks.
Padding segments produce zeros.

Under ``torch.compile`` the same computation runs inside packfree's opaque custom op
(:mod:`packfree_plugin.opaque`, via :func:`~packfree_plugin.attention.run_packed_attention`), which
receives the boundaries as a small CPU tensor: compiled graphs then neither unroll the segment loop nor
recompile when the packing changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..boundaries import Boundaries
from .reference import AttentionOptions, eager_attention, visible_keys

__all__ = ["segment_attention", "BATCHED_UP_TO", "QUERY_BLOCK"]

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
) -> torch.Tensor:
    """``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``[B, T, H, Dv]``, each segment on its own.

    ``query_block``: queries per block where a binding window, softcap or sinks force blockwise work.
    """
    batch, heads, seq_len, _ = query.shape
    plan = boundaries.memo(("segment_attention_plan", query.device, options.chunk),
                           lambda: _plan(boundaries, query.device, options.chunk))
    if plan.where is None and plan.groups:  # one group: the whole batch, in order (samples of one length)
        group = plan.groups[0]
        out = _one_segment(_as_group(query, group), _as_group(key, group), _as_group(value, group), options,
                           training=training, query_block=query_block)
        out = out.transpose(1, 2).reshape(batch, seq_len, heads, value.shape[-1])
        return out if out.dtype == query.dtype else out.to(query.dtype)
    # [B*T, H, D] token-major views: transformers hands over q/k/v as transposes of [B, T, H, D] tensors, so
    # these are usually views, not copies
    flat_q, flat_k, flat_v = (t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], t.shape[3])
                              for t in (query, key, value))
    outputs = [
        _one_segment(_gather(flat_q, group), _gather(flat_k, group), _gather(flat_v, group), options,
                     training=training, query_block=query_block).transpose(1, 2)  # [n, L, H, Dv]
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
    query_block: int,
) -> torch.Tensor:
    """Self-attention inside one segment, or ``n`` segments of one length: ``[n, H, L, D]`` x ``[n, Hkv, L, D]`` ->
    ``[n, H, L, Dv]``."""
    length = query.shape[2]
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
