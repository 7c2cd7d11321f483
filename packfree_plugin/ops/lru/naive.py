"""Slow, obviously-right reference: loop over samples, loop over tokens, ``h = a_t * h + b_t``."""

from __future__ import annotations

import torch

from .._reference import accumulation_dtype, sample_spans

__all__ = ["naive_linear_recurrence"]


def naive_linear_recurrence(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token reference for :func:`packfree_plugin.ops.lru.fast.linear_recurrence`
    (same arguments and shapes)."""
    Bsz, T, D = a.shape
    cdt = accumulation_dtype(b.dtype)
    a, b = a.reshape(Bsz * T, D).to(cdt), b.reshape(Bsz * T, D).to(cdt)
    outs, finals = [], []
    for i, (start, end) in enumerate(sample_spans(cu_seqlens, Bsz, T)):
        h = a.new_zeros(D) if initial_state is None else initial_state[i].to(cdt)
        for t in range(start, end):
            h = a[t] * h + b[t]
            outs.append(h)
        finals.append(h)
    out = torch.stack(outs).view(Bsz, T, D) if outs else a.new_zeros(Bsz, T, D)
    return out.to(b.dtype), (torch.stack(finals) if output_final_state else None)
