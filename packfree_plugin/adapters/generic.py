"""The generic tier: run any causal sequence mixer on a packed batch by unpacking, running, repacking.

The samples of a packed batch are regrouped into a small number of right-padded batches of similar
lengths (length bucketing bounds the padding to ``max_waste``), the layer's own forward runs on each
with no cache and no mask, and the outputs are scattered back into packed order. Right padding is safe
for causal mixers: a padding token comes after the real ones and cannot reach them. Bidirectional layers
(encoders) would see it, so they run in groups of samples of one length (``max_waste=0``), unpadded.
Padding segments of the packed batch get zeros. Differentiable end to end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..boundaries import Boundaries
from ..forward.signature import tensor_leaves

__all__ = ["length_buckets", "run_unpacked"]


def length_buckets(lengths: list[int], *, max_waste: float = 0.25) -> list[list[int]]:
    """Group segment indices so each group's padded size ``n * max_len <= (1 + max_waste) * sum_len``.

    Longest first; deterministic. Returns lists of indices into ``lengths``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    buckets: list[list[int]] = []
    for index in order:
        if buckets:
            bucket = buckets[-1]
            longest = lengths[bucket[0]]
            total = sum(lengths[i] for i in bucket) + lengths[index]
            if (len(bucket) + 1) * longest <= (1 + max_waste) * total:
                bucket.append(index)
                continue
        buckets.append([index])
    return buckets


def _map(tree: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return function(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(item, function) for item in tree)
    if isinstance(tree, dict):
        return {key: _map(item, function) for key, item in tree.items()}
    return tree


def run_unpacked(
    run: Callable[[Any], Any],
    hidden_states: Any,
    boundaries: Boundaries,
    *,
    max_waste: float = 0.25,
) -> Any:
    """``run(inputs [n, L, ...]) -> outputs [n, L, ...]`` applied per sample; ``[B, T, ...]`` -> ``[B, T, ...]``.

    ``hidden_states`` is a tensor ``[B, T, C]`` or a tuple/list/dict of them (e.g. hidden states together with
    ``input_ids`` or per-token ``(cos, sin)``); a leaf ``[1, T, ...]`` is shared by every row. ``run`` gets the
    same structure for each right-padded group of samples and returns a tensor or a tuple/list/dict of them
    (nested, entries may be None); the result has that structure with every tensor scattered back into packed order.
    ``max_waste``: padding allowed per group (:func:`length_buckets`); 0 runs only samples of one length together,
    so no sample is padded at all (what bidirectional layers need).
    """
    batch, seq_len = boundaries.batch_size, boundaries.seq_len
    for leaf in tensor_leaves(hidden_states):
        if leaf.ndim < 2 or leaf.shape[1] != seq_len or leaf.shape[0] not in (1, batch):
            raise ValueError(
                f"per-token input of shape {list(leaf.shape)} does not match the packed boundaries "
                f"[B={batch}, T={seq_len}]"
            )
    device = tensor_leaves(hidden_states)[0].device

    def with_zero_row(leaf: torch.Tensor) -> torch.Tensor:
        # one extra zero row that padded positions gather from
        flat = leaf.expand(batch, *leaf.shape[1:]).reshape(batch * seq_len, *leaf.shape[2:])
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])

    sources = _map(hidden_states, with_zero_row)
    samples = [(start, length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    if not samples:
        raise ValueError("the packed batch holds only padding")
    outputs, keeps, destinations = [], [], []
    for bucket in length_buckets([length for _, length in samples], max_waste=max_waste):
        longest = samples[bucket[0]][1]
        index = torch.full((len(bucket), longest), batch * seq_len, dtype=torch.long)
        for row, sample in enumerate(bucket):
            start, length = samples[sample]
            index[row, :length] = torch.arange(start, start + length)
        index = index.to(device)
        out = run(_map(sources, lambda source: source[index]))
        keep = index < batch * seq_len
        outputs.append(out)
        keeps.append(keep)
        destinations.append(index[keep])
    where = torch.cat(destinations)

    def scatter(pieces: list[Any]) -> Any:
        """One output (a tensor, None, or a tuple/list/dict of them) per group -> that structure in packed order."""
        first = pieces[0]
        if isinstance(first, (tuple, list)):
            return type(first)(scatter([piece[i] for piece in pieces]) for i in range(len(first)))
        if isinstance(first, dict):
            return {key: scatter([piece[key] for piece in pieces]) for key in first}
        if any(piece is None for piece in pieces):
            return None
        gathered = torch.cat([piece[keep] for piece, keep in zip(pieces, keeps)])
        result = gathered.new_zeros(batch * seq_len, *gathered.shape[1:]).index_copy(0, where, gathered)
        return result.view(batch, seq_len, *gathered.shape[1:])

    return scatter(outputs)
