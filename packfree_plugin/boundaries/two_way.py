"""Two-way blocks: runs of tokens that attend to each other both ways inside a causal sample (Gemma 3's and Gemma 4's
image tokens, PaliGemma's prefix), laid out per packed sample.

transformers marks them with ``block_sequence_ids`` (``[B, T]``, -1 outside every block) and ORs its
``blockwise_overlay`` onto the causal mask. On a packed row a block is a run of equal non-negative ids inside one
sample: ids that run on across a sample's end start a block of the next sample, so no block crosses samples. A query
inside a block sees its sample's keys up to the block's last token (none further back than a sliding window lets
it); every other query sees what causal attention gives it. Each query's keys are therefore one range of its own
sample, and attention runs per sample (:mod:`packfree_plugin.attention.two_way`): no ``[T, T]`` mask.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy
import torch
from torch.utils.weak import WeakIdKeyDictionary

from .store import host_of
from .tiling import Boundaries

__all__ = ["BlockPlan", "TwoWayBlocks", "is_per_sample_mask", "mark_per_sample"]

_PER_SAMPLE_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The dense masks packfree built for a packed row whose model overlays a pattern: already cut to each sample, so
attention applies them as they are. Keyed by the mask's identity and holding it weakly (nothing is written into the
tensor): each entry goes with its mask."""


def mark_per_sample(mask: torch.Tensor) -> torch.Tensor:
    """Record ``mask`` (``[B, 1, T, T]``) as a dense mask packfree cut to each sample of a packed row; returns it."""
    _PER_SAMPLE_MASKS[mask] = True
    return mask


def is_per_sample_mask(mask: object) -> bool:
    """Whether ``mask`` is a dense mask packfree cut to each sample of a packed row (:func:`mark_per_sample`)."""
    return isinstance(mask, torch.Tensor) and mask in _PER_SAMPLE_MASKS


class BlockPlan(NamedTuple):
    """How the queries of every block gather their keys: ``queries [Mq]`` and ``keys [Mk]`` (flat token indices over
    ``B * T``, block after block) and ``sizes``, ``(queries, keys, first query's key index)`` of each block."""

    queries: torch.Tensor
    keys: torch.Tensor
    sizes: tuple[tuple[int, int, int], ...]


class TwoWayBlocks:
    """The mask of a packed row whose samples hold two-way blocks: its :class:`Boundaries` and the blocks.

    Attributes:
        boundaries: the row's samples.
        spans: host tuple of ``(start, end, sample_start)``, one per block of at least two tokens, offsets over the
            flattened ``B * T`` tokens (``sample_start``: where the block's sample starts).
        window: the sliding window of the mask (keys ``k > q - window`` only), or None.
    """

    __slots__ = ("boundaries", "spans", "window", "_plans")

    def __init__(self, boundaries: Boundaries, spans: tuple[tuple[int, int, int], ...], window: int | None) -> None:
        self.boundaries = boundaries
        self.spans = spans
        self.window = window
        self._plans: dict[torch.device, BlockPlan] = {}

    @classmethod
    def place(cls, boundaries: Boundaries, block_ids: torch.Tensor, window: int | None) -> TwoWayBlocks | None:
        """The blocks of ``block_ids`` (``[B, T]`` or ``[1, T]``, read on the host once per tensor) cut to the samples
        of ``boundaries``; None when a sample holds one id in two runs (such a block is no range of keys) or the ids
        do not cover the row."""
        ids = host_of(block_ids)
        if ids.ndim != 2 or ids.shape[1] != boundaries.seq_len or ids.shape[0] not in (1, boundaries.batch_size):
            return None
        flat = numpy.broadcast_to(ids, (boundaries.batch_size, boundaries.seq_len)).reshape(-1).astype(numpy.int64)
        segment = host_of(boundaries.seq_idx).reshape(-1).astype(numpy.int64)
        starts_run = numpy.ones(flat.size, dtype=bool)
        starts_run[1:] = (flat[1:] != flat[:-1]) | (segment[1:] != segment[:-1])
        starts = numpy.flatnonzero(starts_run)
        ends = numpy.append(starts[1:], flat.size)
        padding = numpy.array(boundaries.padding, dtype=bool)
        kept = (flat[starts] >= 0) & ~padding[segment[starts]]
        starts, ends = starts[kept], ends[kept]
        owners = numpy.stack([segment[starts], flat[starts]], axis=1)
        if len(numpy.unique(owners, axis=0)) != len(owners):
            return None
        offsets = boundaries.offsets
        spans = tuple((int(start), int(end), offsets[segment[start]])
                      for start, end in zip(starts, ends) if end - start > 1)
        return cls(boundaries, spans, window)

    def plan(self, device: torch.device) -> BlockPlan:
        """The gather of every block's queries and keys on ``device``, built once (host offsets, no read)."""
        if device not in self._plans:
            queries, keys, sizes = [], [], []
            for start, end, sample_start in self.spans:
                first_key = sample_start if self.window is None else max(sample_start, start - self.window + 1)
                queries.append(numpy.arange(start, end))
                keys.append(numpy.arange(first_key, end))
                sizes.append((end - start, end - first_key, start - first_key))
            gathered = (torch.from_numpy(numpy.concatenate(parts) if parts else numpy.zeros(0, numpy.int64)).to(device)
                        for parts in (queries, keys))
            self._plans[device] = BlockPlan(*gathered, tuple(sizes))
        return self._plans[device]

    def dense_mask(self) -> torch.Tensor:
        """Bool ``[B, 1, T, T]`` (True: visible), the same pattern as a dense mask, for a model that hands its mask
        to an inner model whose mask helpers read a tensor (PaliGemma's Gemma); O(T^2), marked per-sample."""
        boundaries = self.boundaries
        batch, length = boundaries.batch_size, boundaries.seq_len
        reach = numpy.tile(numpy.arange(length), batch)  # the last key each query sees, in its row
        for start, end, _ in self.spans:
            reach[start:end] = (end - 1) % length
        reach = torch.from_numpy(reach.reshape(batch, length)).to(boundaries.device)
        positions = torch.arange(length, device=boundaries.device)
        segments = boundaries.seq_idx
        visible = (segments[:, :, None] == segments[:, None, :]) & (positions[None, None, :] <= reach[:, :, None])
        if self.window is not None:
            visible &= positions[None, None, :] > positions[None, :, None] - self.window
        return mark_per_sample(visible[:, None])

    def __getitem__(self, index: object) -> TwoWayBlocks:
        """A cut of the mask that keeps every token gives it back, as ``Boundaries[index]`` does (Gemma 4's
        KV-shared layers); a real cut of a packed row raises there."""
        self.boundaries[index]
        return self

    def __repr__(self) -> str:
        return f"TwoWayBlocks({self.boundaries!r}, blocks={len(self.spans)}, window={self.window})"
