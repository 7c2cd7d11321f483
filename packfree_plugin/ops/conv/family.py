"""The short-convolution family (LFM2's ``ShortConv``) and the routes of transformers' causal-conv kernel functions,
which every conv-then-scan family (gated delta, KDA, Mamba, Mamba2) routes too."""

from __future__ import annotations

from typing import Any

import torch

from ...boundaries import Boundaries
from .. import opaque
from ..family import KernelRoute, MixerFamily, decoding_only
from ..opaque import PARAMS, TOKENS, Layout, boundary_op

__all__ = ["CONV_ROUTES", "FAMILIES"]


@boundary_op("causal_conv1d", layout=Layout((TOKENS, PARAMS, PARAMS), TOKENS))
def conv_op(boundaries: Boundaries, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
            activation: str | None) -> torch.Tensor:
    """``x [B, T, C]``, ``weight [C, K]`` -> ``[B, T, C]``."""
    from .op import causal_conv1d

    # validate=False: boundaries build their seq_idx valid (reading it back per layer costs a short row dearly)
    return causal_conv1d(x, weight, bias, activation=activation, seq_idx=boundaries.seq_idx, validate=False)


def causal_conv1d_fn(boundaries: Boundaries, layer_name: str, hidden_states: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, activation: str | None = None, **_: Any) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn``: ``[B, C, T]`` in and out."""
    x = hidden_states.to(weight.dtype).transpose(1, 2)
    out = opaque.call("causal_conv1d", boundaries, x, weight, bias, activation=activation)
    return out.transpose(1, 2).to(hidden_states.dtype)


CONV_ROUTES = {
    "causal_conv1d_fn": KernelRoute("causal_conv1d_fn", causal_conv1d_fn),
    "causal_conv1d_update": KernelRoute("causal_conv1d_update", decoding_only("causal_conv1d_update"),
                                        optional=True),
}
"""transformers' causal-conv functions (the same names in every modeling module that has them)."""

FAMILIES = (MixerFamily("short_conv", routes=CONV_ROUTES),)
