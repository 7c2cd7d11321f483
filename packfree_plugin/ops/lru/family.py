"""The RecurrentGemma family: its recurrent block (depthwise causal conv and RG-LRU) is computed inline in
transformers, so its forward is written here, the layer's own gates and decay around packfree's conv and
linear-recurrence ops on the packed rows. ``tests/models/test_hybrids.py`` checks it against stock transformers on
every sample alone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...boundaries import Boundaries
from .. import opaque
from ..conv import family as _conv_family  # noqa: F401 - declares the causal_conv1d op this forward calls
from ..family import MixerFamily, flat_rows, positions_per_sample
from ..opaque import TOKENS, Layout, boundary_op

__all__ = ["FAMILIES"]


@boundary_op("rg_lru", layout=Layout((TOKENS,) * 3, TOKENS))
def _rg_lru(boundaries: Boundaries, x: torch.Tensor, input_gate: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """RecurrentGemma's RG-LRU scan from a zero state at every segment start: ``x``, ``input_gate``, ``log_decay``
    ``[B, T, D]`` -> ``[B, T, D]`` in ``x``'s dtype. Stock's input normalisation ``sqrt(1 - a^2)`` (with its
    bounded derivative) is skipped at each sample's first token, where the state resets."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import SqrtBoundDerivative

    from .fast import linear_recurrence

    reset = (boundaries.position_ids == 0)[:, :, None]
    multiplier = SqrtBoundDerivative.apply(1 - torch.exp(2 * log_decay))
    multiplier = reset + ~reset * multiplier
    normalized = x * input_gate * multiplier.type(x.dtype)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32  # stock accumulates in fp32
    states, _ = linear_recurrence(flat_rows(torch.exp(log_decay).to(accumulate)), flat_rows(normalized.to(accumulate)),
                                  cu_seqlens=boundaries.cu_seqlens)
    return states.view_as(x).to(x.dtype)


def rg_lru_forward(layer: nn.Module, boundaries: Boundaries, arguments: dict[str, Any]) -> tuple:
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


FAMILIES = (MixerFamily("rg_lru", forward=rg_lru_forward, hidden_arg="input_states", output_index=0,
                        per_sample=positions_per_sample),)
