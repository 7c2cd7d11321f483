"""Boundary-aware gated delta rule family: Gated DeltaNet (Qwen3-Next / Qwen3.5) and KDA (Kimi Linear).

``op.chunk_gated_delta_rule`` / ``op.chunk_kda`` (public, dispatching: fla on CUDA), ``fast.*_torch`` (pure-torch
chunked fast path), ``naive.naive_*`` (per-sample, per-token references).
"""

from .fast import chunk_gated_delta_rule_torch, chunk_kda_torch
from .op import chunk_gated_delta_rule, chunk_kda
from .naive import naive_gated_delta_rule, naive_kda

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gated_delta_rule_torch",
    "chunk_kda_torch",
    "naive_gated_delta_rule",
    "naive_kda",
]
