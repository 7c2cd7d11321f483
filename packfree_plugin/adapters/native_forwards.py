"""Native forwards for mixer families whose transformers code calls no kernel function packfree could route.

MiniMax's lightning attention and RecurrentGemma's RG-LRU block compute their recurrences inline, so the
native tier cannot reach them through an entry's ``routes`` (:data:`packfree_plugin.classes.CLASSES`). Each forward
here is the layer's own forward with its projections and gates computed by the layer's modules and parameters, and
only its sequence mixing replaced by packfree's boundary-aware ops (:mod:`packfree_plugin.ops.linear_attention`,
:mod:`packfree_plugin.ops.lru`, :mod:`packfree_plugin.ops.conv`) on the packed rows: one batched call instead
of the generic tier's per-sample runs. ``tests/models/test_hybrids.py`` checks each against stock
transformers on every sample alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..ops import opaque
from ..boundaries import Boundaries
from ..ops.opaque import PARAMS, TOKENS, Layout, boundary_op

__all__ = ["lightning_forward", "rg_lru_forward"]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[1, B * T, ...]`` (a view): the ops' ``cu_seqlens`` describe the flattened rows."""
    return tensor.reshape(1, tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])


def _like_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    return torch.empty_like(v)


@boundary_op("decay_linear_attention", layout=Layout((TOKENS,) * 3 + (PARAMS,), TOKENS), output=_like_value)
def _decay_linear_attention(boundaries: Boundaries, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            log_decay: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``q/k/v [B, T, H, D]``, ``log_decay [H]`` (a constant per-head log decay) -> ``[B, T, H, D]``."""
    from ..ops.linear_attention import chunk_linear_attention

    out, _ = chunk_linear_attention(_flat(q), _flat(k), _flat(v), g_gamma=log_decay, scale=scale,
                                    cu_seqlens=boundaries.cu_seqlens)
    return out.view_as(v)


def lightning_forward(layer: nn.Module, original: Any, boundaries: Boundaries, arguments: dict[str, Any]) -> tuple:
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


@boundary_op("rg_lru", layout=Layout((TOKENS,) * 3, TOKENS))
def _rg_lru(boundaries: Boundaries, x: torch.Tensor, input_gate: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """RecurrentGemma's RG-LRU scan from a zero state at every segment start: ``x``, ``input_gate``, ``log_decay``
    ``[B, T, D]`` -> ``[B, T, D]`` in ``x``'s dtype. Stock's input normalisation ``sqrt(1 - a^2)`` (with its
    bounded derivative) is skipped at each sample's first token, where the state resets."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import SqrtBoundDerivative

    from ..ops.lru import linear_recurrence

    reset = (boundaries.position_ids == 0)[:, :, None]
    multiplier = SqrtBoundDerivative.apply(1 - torch.exp(2 * log_decay))
    multiplier = reset + ~reset * multiplier
    normalized = x * input_gate * multiplier.type(x.dtype)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32  # stock accumulates in fp32
    states, _ = linear_recurrence(_flat(torch.exp(log_decay).to(accumulate)), _flat(normalized.to(accumulate)),
                                  cu_seqlens=boundaries.cu_seqlens)
    return states.view_as(x).to(x.dtype)


def rg_lru_forward(layer: nn.Module, original: Any, boundaries: Boundaries, arguments: dict[str, Any]) -> tuple:
    """``RecurrentGemmaRecurrentBlock`` on packed rows: ``input_states [B, T, C]`` -> ``([B, T, C], None)``.

    Its depthwise causal conv and its RG-LRU run on every sample from a zero state; the gates and the
    decay are the layer's own computation."""
    hidden = arguments["input_states"]
    batch, seq_len, _ = hidden.shape
    layer.conv1d_state = None  # what stock leaves after a call without cache
    layer.rg_lru.recurrent_states = None
    y_branch = layer.act_fn(layer.linear_y(hidden))
    x_branch = layer.linear_x(hidden)
    conv = layer.conv_1d
    x_branch = opaque.call("causal_conv1d", boundaries, x_branch, conv.weight[:, 0, :], conv.bias,
                           activation=None)

    lru = layer.rg_lru
    width = x_branch.shape[-1]
    blocks = x_branch.reshape(batch * seq_len, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    input_gate = torch.sigmoid(torch.baddbmm(lru.input_gate_bias[:, None, :], blocks, lru.input_gate_weight)
                               .transpose(0, 1).reshape(batch, seq_len, width))
    recurrent_gate = torch.sigmoid(torch.baddbmm(lru.recurrent_gate_bias[:, None, :], blocks,
                                                 lru.recurrent_gate_weight).transpose(0, 1).reshape(batch, seq_len, width))
    log_decay = -8.0 * recurrent_gate * nn.functional.softplus(lru.recurrent_param)
    states = opaque.call("rg_lru", boundaries, x_branch, input_gate, log_decay)
    return layer.linear_out(states * y_branch), None
