"""Boundary-aware decay-gated linear attention (MiniMax lightning attention, simple GLA, RetNet-style decay).

``fast.chunk_linear_attention`` (public, pure PyTorch on every device: no fla route yet, fla's ``chunk_simple_gla``
could serve CUDA later), ``naive.naive_linear_attention`` (per-sample reference).
"""

from packfree_plugin.ops.linear_attention.fast import chunk_linear_attention
from packfree_plugin.ops.linear_attention.naive import naive_linear_attention

__all__ = ["chunk_linear_attention", "naive_linear_attention"]
