"""Portable packed attention: one fused SDPA call per segment (per group of equal short ones), on any device.

No ``[T, T]`` mask is ever built: each segment attends to itself through
``torch.nn.functional.scaled_dot_product_attention`` (whose CPU kernel keeps O(L) extra memory), so the
cost is that of running the samples one by one, minus everything outside attention that now runs
batched. Sliding windows are computed in query blocks over only the keys in reach (O(L * W) memory);
softcapping and sinks, which SDPA cannot express, go through the eager reference in the same blocks.
Padding segments produce zeros.

Under ``torch.compile`` the same computation runs inside packfree's opaque custom op
(:mod:`packfree_plugin.opaque`, via :func:`~packfree_plugin.attention.run_packed_attention`), which
receives the boundaries as a small CPU tensor: compiled graphs then neither unroll the segment loop nor
recompile when the packing changes.
"""

from __future__ import annotations

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
    row_lengths: list[list[tuple[int, bool]]] = [[] for _ in range(boundaries.batch_size)]
    for start, length, padding in zip(boundaries.offsets, boundaries.lengths, boundaries.padding):
        row_lengths[start // boundaries.seq_len].append((length, padding))
    # torch.split (not slicing) so that backward assembles each gradient with one cat instead of
    # one full-size zero tensor per segment; 4-D [1, H, L, D] pieces so CPU SDPA takes its flash kernel.
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    rows: list[list[int]] = []  # indices into pieces, per row
    outputs: list[torch.Tensor | None] = []
    short: dict[int, list[int]] = {}  # length -> pieces of that length, run together
    for q_row, k_row, v_row, segments in zip(query.split(1), key.split(1), value.split(1), row_lengths):
        lengths = [length for length, _ in segments]
        rows.append([])
        for q, k, v, (length, padding) in zip(q_row.split(lengths, dim=2), k_row.split(lengths, dim=2),
                                              v_row.split(lengths, dim=2), segments):
            rows[-1].append(len(pieces))
            pieces.append((q, k, v))
            outputs.append(query.new_zeros(1, query.shape[1], length, value.shape[-1]) if padding else None)
            if not padding and length <= BATCHED_UP_TO:
                short.setdefault(length, []).append(len(pieces) - 1)
    for members in short.values():
        if len(members) == 1:
            continue
        batched = _one_segment(*(torch.cat([pieces[i][part] for i in members]) for part in range(3)), options,
                               training=training, query_block=query_block)
        for index, out in zip(members, batched.split(1)):
            outputs[index] = out
    for index, out in enumerate(outputs):
        if out is None:
            outputs[index] = _one_segment(*pieces[index], options, training=training, query_block=query_block)
    return torch.cat([torch.cat([outputs[i] for i in row], dim=2) for row in rows]).transpose(1, 2).contiguous()


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
    return max(0, q_start - window), min(length, q_end + window)


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
