"""Boundary-aware decay-gated linear attention (MiniMax lightning attention, simple GLA, RetNet-style decay).

Pure PyTorch on every device (no fla route yet: fla's ``chunk_simple_gla`` could serve CUDA later).
"""

from packfree_plugin.ops.linear_attention.chunk import chunk_linear_attention
from packfree_plugin.ops.linear_attention.naive import naive_linear_attention

__all__ = ["chunk_linear_attention", "naive_linear_attention"]
