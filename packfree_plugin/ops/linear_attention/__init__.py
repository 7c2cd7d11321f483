"""Boundary-aware decay-gated linear attention (MiniMax lightning attention, simple GLA, RetNet-style decay).

``fast.chunk_linear_attention`` (public, pure PyTorch on every device: no fla route yet, fla's ``chunk_simple_gla``
could serve CUDA later), ``naive.naive_linear_attention`` (per-sample reference).
"""

from .fast import chunk_linear_attention
from .naive import naive_linear_attention

__all__ = ["chunk_linear_attention", "naive_linear_attention"]
