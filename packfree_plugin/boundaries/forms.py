"""The one builder of each per-token form of a batch's boundaries, from its offsets (``cu_seqlens``).

Torch only, on the offsets' device: the boundaries build their host forms with them on their CPU offsets (into host
arrays packfree owns, so nothing is read back), an op derives ``seq_idx`` from a ``cu_seqlens`` on its device (no
host sync), and a compiled loss traces them (the offsets are graph data).
"""

from __future__ import annotations

import torch

__all__ = ["position_ids_of", "seq_idx_of"]


def seq_idx_of(offsets: torch.Tensor, tokens: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``offsets [N+1]`` (integer, non-decreasing, ``0`` to ``tokens``) -> ``[tokens]`` int64 on their device (int32
    into an int32 ``out``): the segment of every token, the number of offsets after the first at or before it.
    Empty segments (repeated offsets) hold no token: their numbers do not appear."""
    positions = torch.arange(tokens, device=offsets.device, dtype=offsets.dtype)
    int32 = out is not None and out.dtype == torch.int32
    return torch.searchsorted(offsets[1:].contiguous(), positions, right=True, out_int32=int32, out=out)


def position_ids_of(offsets: torch.Tensor, tokens: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``offsets [N+1]`` (as :func:`seq_idx_of`) -> ``[tokens]`` int64 on their device: the position of every token
    inside its segment (0 at each segment's first token)."""
    starts = offsets.to(torch.int64)[seq_idx_of(offsets, tokens)]
    return torch.sub(torch.arange(tokens, device=offsets.device), starts, out=out)
