"""Boundary-aware gated delta rule family: Gated DeltaNet (Qwen3-Next / Qwen3.5) and KDA (Kimi Linear).

``chunk_gated_delta_rule`` / ``chunk_kda`` are the public ops (fla on CUDA, PyTorch chunked elsewhere);
``naive_*`` are the per-sample, per-token references the fast paths are tested against.
"""

from packfree_plugin.ops.gated_delta.chunk import chunk_gated_delta_rule_torch, chunk_kda_torch
from packfree_plugin.ops.gated_delta.dispatch import chunk_gated_delta_rule, chunk_kda
from packfree_plugin.ops.gated_delta.naive import naive_gated_delta_rule, naive_kda

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gated_delta_rule_torch",
    "chunk_kda_torch",
    "naive_gated_delta_rule",
    "naive_kda",
]
