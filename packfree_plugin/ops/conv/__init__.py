"""Causal depthwise conv1d that restarts at every sample boundary of a packed row.

``op.causal_conv1d`` (public, dispatching), ``masked.causal_conv1d_masked`` (pure-torch fast path),
``naive.causal_conv1d_naive`` (per-sample reference).
"""

from .naive import causal_conv1d_naive
from .op import causal_conv1d

__all__ = ["causal_conv1d", "causal_conv1d_naive"]
