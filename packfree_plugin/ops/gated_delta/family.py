"""The Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid) and Kimi Delta Attention families: their causal convs and
chunked delta rules routed to packfree's ops, on the flattened rows (fla's ``cu_seqlens`` contract, ``B == 1``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...boundaries import Boundaries, host_of, keep_host, memo
from .. import opaque
from .._seq import describe_cu_seqlens
from ..conv.family import CONV_ROUTES
from ..family import KernelRoute, MixerFamily, decoding_only, like_value, refuse_state
from ..opaque import TOKENS, Layout, boundary_op

__all__ = ["FAMILIES"]


@boundary_op("chunk_gated_delta_rule", layout=Layout((TOKENS,) * 5, TOKENS), output=like_value)
def gated_delta_op(boundaries: Boundaries, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, *, scale: float | None,
                   use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """``q/k [B, T, H, K]``, ``v [B, T, H, V]``, ``g/beta [B, T, H]`` -> ``[B, T, H, V]``."""
    from .op import chunk_gated_delta_rule

    return _flattened(boundaries, chunk_gated_delta_rule, query, key, value, g, beta, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


@boundary_op("chunk_kda", layout=Layout((TOKENS,) * 5, TOKENS), output=like_value)
def kda_op(boundaries: Boundaries, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, *, scale: float | None, use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """``q/k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]``, ``beta [B, T, H]`` -> ``[B, T, H, V]``."""
    from .op import chunk_kda

    return _flattened(boundaries, chunk_kda, q, k, v, g, beta, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _flattened(boundaries: Boundaries, op: Callable, *tensors: torch.Tensor, **options: Any) -> torch.Tensor:
    """Run an fla-style op (``[B, T, ...]`` tensors; ``cu_seqlens`` needs B == 1) on the flattened rows.
    validate=False: boundaries build their cu_seqlens valid (reading it back per layer costs a short row dearly),
    and hand over the per-token form they hold (the op would derive it again)."""
    batch, seq_len = tensors[0].shape[:2]
    flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in tensors]
    flat_ids = memo(boundaries, "flat_seq_idx", None, lambda: keep_host(
        boundaries.seq_idx.view(1, batch * seq_len), host_of(boundaries.seq_idx).reshape(1, -1)))
    cu_seqlens = describe_cu_seqlens(boundaries.cu_seqlens, flat_ids)
    out, _ = op(*flat, cu_seqlens=cu_seqlens, validate=False, **options)
    return out.reshape(batch, seq_len, *out.shape[2:]).to(tensors[2].dtype)


def _value_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped value heads (more value than key heads, ``[B, T, H, D]``): repeat q/k heads as transformers does."""
    repeat = value.shape[2] // key.shape[2]
    if repeat == 1:
        return query, key
    return query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)


def chunk_gated_delta_rule(boundaries: Boundaries, layer_name: str, query, key, value, g, beta, chunk_size=64,
                           initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, scale=None,
                           **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``torch_chunk_gated_delta_rule``: ``[B, T, H, D]`` tensors."""
    refuse_state(layer_name, "chunk_gated_delta_rule", initial_state=initial_state,
                 output_final_state=output_final_state)
    query, key = _value_heads(query, key, value)
    return opaque.call("chunk_gated_delta_rule", boundaries, query, key, value, g, beta, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None


def chunk_kda(boundaries: Boundaries, layer_name: str, q, k, v, g, beta, scale=None, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``chunk_kimi_delta_attention``: ``[B, T, H, D]`` tensors."""
    refuse_state(layer_name, "chunk_kda", initial_state=initial_state, output_final_state=output_final_state)
    q, k = _value_heads(q, k, v)
    return opaque.call("chunk_kda", boundaries, q, k, v, g, beta, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None


FAMILIES = (
    MixerFamily("gated_delta", routes={
        **CONV_ROUTES,
        "torch_chunk_gated_delta_rule": KernelRoute("chunk_gated_delta_rule", chunk_gated_delta_rule),
        "torch_recurrent_gated_delta_rule": KernelRoute(
            "fused_recurrent_gated_delta_rule", decoding_only("fused_recurrent_gated_delta_rule"), optional=True),
    }),
    MixerFamily("kimi_delta", routes={
        **CONV_ROUTES,
        "chunk_kimi_delta_attention": KernelRoute("chunk_kda", chunk_kda),
        "recurrent_kimi_delta_attention": KernelRoute("fused_recurrent_kda", decoding_only("fused_recurrent_kda"),
                                                      optional=True),
    }),
)
