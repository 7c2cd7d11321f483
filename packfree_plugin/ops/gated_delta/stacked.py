"""The five inputs of the chunked gated delta rule travel as one tensor: stacked once on entry (one quarantine,
one chunk layout), split back into q, k, v, g, beta per chunk (with the in-kernel L2 norm and the query scale)."""

from __future__ import annotations

import torch

from .._kept import kept_per_mode

__all__ = ["stack_inputs", "unstack_chunks"]


def stack_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 per_channel: bool) -> torch.Tensor:
    """``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H(, K)]``, ``beta [B, T, H]`` -> one
    ``[B, T, H, 2K + V + (K or 1) + 1]`` tensor in their promoted dtype: the non-finite quarantine and the chunk
    layout are then one op each, not one per input (at small widths the op count is the cost)."""
    return torch.cat([q, k, v, g if per_channel else g[..., None], beta[..., None]], dim=-1)


@kept_per_mode(maxsize=16)
def _row_scales(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[2, 1]``: ``scale`` for the q row, 1 for the k row of a joint ``[..., 2, K]`` normalisation."""
    return torch.tensor([[scale], [1.0]], dtype=dtype, device=device)


def unstack_chunks(x: torch.Tensor, K: int, V: int, *, scale: float, use_qk_l2norm_in_kernel: bool,
                   per_channel: bool) -> tuple[torch.Tensor, ...]:
    """``x [M, H, C, D]`` (:func:`stack_inputs`' layout, chunked) -> ``q`` (L2-normalised if asked, times
    ``scale``), ``k [M, H, C, K]``, ``v [M, H, C, V]``, ``g [M, H, C(, K)]``, ``beta [M, H, C]``; views of ``x``
    where no op is needed. The L2 norm (``x / sqrt(sum(x^2) + 1e-6)``, fla's) finds q's and k's factors in one
    reduction, then scales each apart: contiguous q and k (KDA's strided reads of a joint product cost 4%)."""
    # one split, whatever is used: its backward writes the gradient of x in one op, where views read apart would
    # each zero-fill a gradient of x's size to be added up
    Kg = K if per_channel else 1
    if use_qk_l2norm_in_kernel:
        qk, v, g, beta = x.split([2 * K, V, Kg, 1], dim=-1)
        qk = qk.unflatten(-1, (2, K))
        factor = torch.rsqrt((qk * qk).sum(dim=-1, keepdim=True) + 1e-6) * _row_scales(scale, x.dtype, x.device)
        q, k = (t * f for t, f in zip(qk.unbind(-2), factor.unbind(-2)))
    else:
        q, k, v, g, beta = x.split([K, K, V, Kg, 1], dim=-1)
        q = q * scale
    return q, k, v, g if per_channel else g.squeeze(-1), beta.squeeze(-1)

