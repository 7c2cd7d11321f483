"""The generic tier: run any causal sequence mixer on a packed batch by unpacking, running, repacking.

The samples of a packed batch are regrouped into a small number of right-padded batches of similar
lengths (length bucketing bounds the padding to ``max_waste``), the layer's own forward runs on each
with no cache and no mask, and the outputs are scattered back into packed order. Right padding is safe
because every mixer this tier serves is causal: a padding token comes after the real ones and cannot
reach them. Padding segments of the packed batch get zeros. Differentiable end to end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..boundaries import Boundaries

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


def run_unpacked(
    run: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    boundaries: Boundaries,
    *,
    max_waste: float = 0.25,
) -> torch.Tensor:
    """``run([n, L, C]) -> [n, L, C']`` applied per sample; ``hidden_states [B, T, C]`` -> ``[B, T, C']``."""
    batch, seq_len = hidden_states.shape[:2]
    if (batch, seq_len) != (boundaries.batch_size, boundaries.seq_len):
        raise ValueError(
            f"hidden states [B={batch}, T={seq_len}] do not match the packed boundaries "
            f"[B={boundaries.batch_size}, T={boundaries.seq_len}]"
        )
    flat = hidden_states.reshape(batch * seq_len, *hidden_states.shape[2:])
    # one extra zero row that padded positions gather from
    source = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    samples = [(start, length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    outputs, destinations = [], []
    for bucket in length_buckets([length for _, length in samples], max_waste=max_waste):
        longest = samples[bucket[0]][1]
        index = torch.full((len(bucket), longest), batch * seq_len, dtype=torch.long)
        for row, sample in enumerate(bucket):
            start, length = samples[sample]
            index[row, :length] = torch.arange(start, start + length)
        index = index.to(hidden_states.device)
        out = run(source[index])
        keep = index < batch * seq_len
        outputs.append(out[keep])
        destinations.append(index[keep])
    if not outputs:
        raise ValueError("the packed batch holds only padding")
    gathered = torch.cat(outputs)
    result = gathered.new_zeros(batch * seq_len, *gathered.shape[1:]).index_copy(0, torch.cat(destinations), gathered)
    return result.view(batch, seq_len, *gathered.shape[1:])
