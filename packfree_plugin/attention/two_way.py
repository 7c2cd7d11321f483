"""Two-way blocks inside packed samples: which mask functions packfree lays out per sample, and the attention that
computes them.

transformers builds Gemma 3's, Gemma 4's and PaliGemma's masks as the causal pattern ORed with a
``blockwise_overlay`` of ``block_sequence_ids`` (tokens of one block attend both ways), possibly ANDed with a sliding
window, the packed samples or padding, and wrapped in ``remap_positions_for_packed_sequence`` (packed
``position_ids`` without an ``attention_mask``, where stock's overlay then reads another sample's ids).
:func:`placed_blocks` recognises exactly those compositions and returns the blocks cut to the samples
(:class:`~packfree_plugin.boundaries.TwoWayBlocks`); :func:`two_way_attention` runs them: causal attention per
segment (:mod:`.segments`), then each block's queries once more over their sample's keys up to the block's end, one
fused SDPA call per block (O(L_block x L_sample) extra memory, no ``[T, T]`` mask).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..boundaries import Boundaries, TwoWayBlocks, host_of
from .reference import AttentionOptions, eager_attention
from .segments import segment_attention

__all__ = ["placed_blocks", "two_way_attention"]

_RESTRICTING = ("packed_sequence_mask_function.", "padding_mask_function.")
"""Overlays that only hide keys the boundaries hide too (other samples, padding spans)."""


def _cells(function: Callable) -> dict[str, object]:
    """The closure variables of ``function`` by name."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))


class _Pattern:
    """What :func:`_kind` found while reading one mask function: the widening block ids and the sliding window."""

    def __init__(self) -> None:
        self.block_ids: list[torch.Tensor] = []
        self.windows: list[int] = []


def _kind(function: Callable, found: _Pattern) -> str | None:
    """``"causal"`` (the causal pattern, widened by the blocks added to ``found``), ``"restricts"`` (an overlay that
    only hides keys: a sliding window, recorded in ``found``, the samples, padding) or None (anything else)."""
    from transformers import masking_utils as masks

    name = getattr(function, "__qualname__", "")
    if function is masks.causal_mask_function:
        return "causal"
    if name.startswith("sliding_window_overlay."):
        found.windows.append(int(_cells(function)["sliding_window"]))
        return "restricts"
    if name.startswith(_RESTRICTING):
        return "restricts"
    if name.startswith("remap_positions_for_packed_sequence."):
        # positions renumbered per sample: the causal pattern and a window read distances, unchanged; the blocks
        # are taken by their row positions below, as each sample alone numbers them
        return _kind(_cells(function)["mask_function"], found)
    if name.startswith("and_masks."):
        kinds = [_kind(part, found) for part in _cells(function)["mask_functions"]]
        return "causal" if None not in kinds and kinds.count("causal") == 1 else None
    if name.startswith("or_masks."):
        base, *added = _cells(function)["mask_functions"]
        windows = len(found.windows)
        if _kind(base, found) != "causal" or len(found.windows) != windows:  # a window under the union: not a range
            return None
        for part in added:
            if not getattr(part, "__qualname__", "").startswith("blockwise_overlay."):
                return None
            ids = _cells(part)["block_sequence_ids"]
            if (host_of(ids) >= 0).any():
                found.block_ids.append(ids)
        return "causal"
    return None


def placed_blocks(boundaries: Boundaries, mask_function: Callable | None) -> TwoWayBlocks | None:
    """The two-way blocks of ``mask_function`` laid out on the packed samples of ``boundaries``, or None when its
    pattern is not the causal one widened by one tensor of block ids (then the caller serves or refuses it)."""
    if mask_function is None:
        return None
    found = _Pattern()
    if _kind(mask_function, found) != "causal" or len({id(ids) for ids in found.block_ids}) != 1 \
            or len(set(found.windows)) > 1:
        return None
    return TwoWayBlocks.place(boundaries, found.block_ids[0], found.windows[0] if found.windows else None)


def two_way_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: TwoWayBlocks,
                      options: AttentionOptions, *, training: bool, layer: str) -> torch.Tensor:
    """``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``[B, T, H, Dv]``: causal inside each segment, and
    the queries of each block over their sample's keys up to the block's last token (``layer`` names the caller in
    refusals)."""
    if options.chunk is not None or options.window != blocks.window:
        raise ValueError(
            f"{layer} attends with chunk={options.chunk}, sliding_window={options.window}, but its two-way mask has "
            f"window {blocks.window}; packfree lays two-way blocks out only under the mask's own sliding window. "
            "Pass one sample per row for this model"
        )
    out = segment_attention(query, key, value, blocks.boundaries, options, training=training)
    if not blocks.spans:
        return out
    batch, heads, seq_len, _ = query.shape
    plan = blocks.plan(query.device)

    def gathered(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], t.shape[3]).index_select(0, index)

    q, k, v = gathered(query, plan.queries), gathered(key, plan.keys), gathered(value, plan.keys)
    eager = AttentionOptions(options.scale, False, None, options.softcap, options.sinks, options.dropout)
    outputs = []
    for q_block, k_block, v_block, (queries, keys, offset) in zip(
            q.split([size[0] for size in plan.sizes]), k.split([size[1] for size in plan.sizes]),
            v.split([size[1] for size in plan.sizes]), plan.sizes):
        q_block, k_block, v_block = (t.transpose(0, 1).unsqueeze(0) for t in (q_block, k_block, v_block))
        visible = None
        if blocks.window is not None:  # keys no further back than the window; later keys of the block all visible
            first = torch.arange(queries, device=query.device)[:, None] + offset - blocks.window
            visible = torch.arange(keys, device=query.device)[None, :] > first
        if options.needs_eager:
            block_out = eager_attention(q_block, k_block, v_block, eager, mask=visible, training=training)
        else:
            block_out = F.scaled_dot_product_attention(
                q_block, k_block, v_block, attn_mask=visible, dropout_p=options.dropout if training else 0.0,
                scale=options.scale, enable_gqa=q_block.shape[1] != k_block.shape[1])
        outputs.append(block_out[0].transpose(0, 1))  # [queries, H, Dv]
    dim = out.shape[-1]
    values = torch.cat(outputs).to(out.dtype)
    return out.reshape(batch * seq_len, heads, dim).index_copy(0, plan.queries, values).view(batch, seq_len, heads, dim)
