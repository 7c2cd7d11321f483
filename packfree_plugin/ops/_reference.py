"""What the naive references share, and only they: every sample's token span and the accumulation dtype.

Written for the references alone (``tests/ops/test_naive_independent.py`` keeps every fast path off this module and
every reference off the fast paths' helpers), so a reference never computes with the code it checks.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "sample_spans"]


def sample_spans(cu_seqlens: torch.Tensor | None, rows: int, length: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every sample among the ``rows * length`` tokens of a ``[rows, length, ...]`` input
    flattened: one sample per row without ``cu_seqlens [N+1]``, else its consecutive values (which must start at
    0, never decrease, and end at ``rows * length``)."""
    if cu_seqlens is None:
        return [(r * length, (r + 1) * length) for r in range(rows)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != rows * length or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} does not cut {rows * length} tokens into samples")
    return list(zip(bounds[:-1], bounds[1:]))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other dtype accumulates in float32."""
    return torch.float64 if dtype is torch.float64 else torch.float32
