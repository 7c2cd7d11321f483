"""The MiniMax lightning-attention family: transformers computes its decay linear attention inline, so its forward
is written here, the layer's own projections and gates around packfree's decay linear-attention op on the packed rows
(one batched call instead of the per-sample tier's runs). ``tests/models/test_hybrids.py`` checks it against stock
transformers on every sample alone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...boundaries import Boundaries
from .. import opaque
from ..family import MixerFamily, flat_rows, like_value
from ..opaque import PARAMS, TOKENS, Layout, boundary_op

__all__ = ["FAMILIES"]


@boundary_op("decay_linear_attention", layout=Layout((TOKENS,) * 3 + (PARAMS,), TOKENS), output=like_value)
def _decay_linear_attention(boundaries: Boundaries, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            log_decay: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``q/k/v [B, T, H, D]``, ``log_decay [H]`` (a constant per-head log decay) -> ``[B, T, H, D]``."""
    from .fast import chunk_linear_attention

    out, _ = chunk_linear_attention(flat_rows(q), flat_rows(k), flat_rows(v), g_gamma=log_decay, scale=scale,
                                    cu_seqlens=boundaries.cu_seqlens)
    return out.view_as(v)


def lightning_forward(layer: nn.Module, boundaries: Boundaries, arguments: dict[str, Any]) -> tuple:
    """``MiniMaxLightningAttention`` on packed rows: ``hidden_states [B, T, C]`` -> ``([B, T, C], None)``.

    Stock computes ``o_t = sum_{j <= t} exp(-slope * (t - j)) (q_t . k_j) v_j`` per head in blocks; this is
    the same recurrence with the decay state reset at every sample start. Padding segments are segments of
    their own, so stock's zeroing of padded q/k/v is not needed to keep them out of the samples."""
    if arguments.get("cache") is not None:
        raise ValueError(f"{type(layer).__name__}: a cache was passed with a packed batch")
    hidden = arguments["hidden_states"]
    batch, seq_len, _ = hidden.shape
    heads, head_dim = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.qkv_proj(hidden)).reshape(batch, seq_len, heads, 3 * head_dim)
    query, key, value = torch.split(qkv, head_dim, dim=3)
    log_decay = -layer.slope_rate.reshape(heads).to(torch.float32 if hidden.dtype != torch.float64 else hidden.dtype)
    out = opaque.call("decay_linear_attention", boundaries, query, key, value, log_decay, scale=1.0)
    out = layer.norm(out.reshape(batch, seq_len, heads * head_dim))
    out = torch.sigmoid(layer.output_gate(hidden)) * out
    return layer.out_proj(out), None


FAMILIES = (MixerFamily("lightning", forward=lightning_forward, output_index=0),)
