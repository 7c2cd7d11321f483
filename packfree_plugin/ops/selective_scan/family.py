"""The Mamba1 family (Mamba, FalconMamba, Jamba, Zamba): its causal conv and selective scan routed to packfree's ops;
the fused whole-layer kernel declines, so the layer takes its split path."""

from __future__ import annotations

from typing import Any

import torch

from ...boundaries import Boundaries
from .. import opaque
from ..conv.family import CONV_ROUTES
from ..family import KernelRoute, MixerFamily, declines, decoding_only, refuse_state
from ..opaque import CHANNELS, PARAMS, SHARED, Layout, boundary_op

__all__ = ["FAMILIES"]


@boundary_op("selective_scan", layout=Layout(
    (CHANNELS, CHANNELS, PARAMS, SHARED, SHARED, PARAMS, CHANNELS, PARAMS), CHANNELS))
def selective_scan_op(boundaries: Boundaries, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor,
                      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                      delta_bias: torch.Tensor | None, *, delta_softplus: bool) -> torch.Tensor:
    """``u [B, D, T]`` -> ``[B, D, T]``."""
    from .op import selective_scan

    return selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                          seq_idx=boundaries.seq_idx, validate=False).to(u.dtype).contiguous()


def selective_scan_fn(boundaries: Boundaries, layer_name: str, hidden_states, dt, A, B, C, D=None, z=None,
                      delta_bias=None, delta_softplus=False, return_last_state=False, **_: Any) -> torch.Tensor:
    """transformers' ``mamba_selective_scan`` (mamba-ssm's ``selective_scan_fn``): ``u [B, D, T]``."""
    refuse_state(layer_name, "selective_scan_fn", return_last_state=return_last_state)
    return opaque.call("selective_scan", boundaries, hidden_states, dt, A, B, C, D, z, delta_bias,
                       delta_softplus=bool(delta_softplus), rows=(hidden_states.shape[0], hidden_states.shape[2]))


FAMILIES = (
    MixerFamily("mamba", routes={
        **CONV_ROUTES,
        "mamba_selective_scan": KernelRoute("selective_scan_fn", selective_scan_fn),
        "mamba_inner_fn": KernelRoute("mamba_inner_fn", declines, optional=True),
        "mamba_selective_state_update": KernelRoute("selective_state_update",
                                                    decoding_only("selective_state_update"), optional=True),
    }),
)
