"""The Mamba2 family (Mamba2, Bamba, FalconH1, Granite 4 hybrids, NemotronH, Zamba2): its causal conv and SSD chunk
scan routed to packfree's ops; the fused whole-layer kernel declines, so the layer takes its split path."""

from __future__ import annotations

from typing import Any

import torch

from ...boundaries import Boundaries
from .. import opaque
from ..conv.family import CONV_ROUTES
from ..family import KernelRoute, MixerFamily, declines, decoding_only, refuse_state
from ..opaque import GROUPS, PARAMS, TOKENS, Layout, boundary_op

__all__ = ["FAMILIES"]


@boundary_op("ssd_chunk_scan", layout=Layout((TOKENS, TOKENS, PARAMS, GROUPS, GROUPS, PARAMS, TOKENS, PARAMS), TOKENS))
def ssd_op(boundaries: Boundaries, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
           C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None, *,
           chunk_size: int, dt_softplus: bool, dt_limit: list[float]) -> torch.Tensor:
    """``x [B, T, H, P]`` -> ``[B, T, H, P]``."""
    from .op import ssd_chunk_scan

    return ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=tuple(dt_limit), seq_idx=boundaries.seq_idx, validate=False).to(x.dtype).contiguous()


def mamba_chunk_scan_combined(boundaries: Boundaries, layer_name: str, hidden_states, dt, A, B, C, chunk_size,
                              D=None, dt_bias=None, initial_states=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                              **_: Any) -> torch.Tensor:
    """transformers' ``mamba2_chunk_scan`` (mamba-ssm's ``mamba_chunk_scan_combined``): ``x [B, T, H, P]``."""
    refuse_state(layer_name, "mamba_chunk_scan_combined", initial_states=initial_states,
                 return_final_states=return_final_states)
    # contiguous: callers .view() the result, as mamba-ssm allows
    return opaque.call("ssd_chunk_scan", boundaries, hidden_states, dt, A, B, C, D, z, dt_bias,
                       chunk_size=int(chunk_size), dt_softplus=bool(dt_softplus),
                       dt_limit=[float(v) for v in dt_limit])


FAMILIES = (
    MixerFamily("mamba2", routes={
        **CONV_ROUTES,
        "mamba2_chunk_scan": KernelRoute("mamba_chunk_scan_combined", mamba_chunk_scan_combined),
        "mamba2_split_conv1d_scan_combined": KernelRoute("mamba_split_conv1d_scan_combined", declines,
                                                         optional=True),
        "mamba2_selective_state_update": KernelRoute("selective_state_update",
                                                     decoding_only("selective_state_update"), optional=True),
    }),
)
