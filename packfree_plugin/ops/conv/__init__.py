"""Causal depthwise conv1d that restarts at every sample boundary of a packed row.

``op.causal_conv1d`` (public, dispatching), ``fast.causal_conv1d_masked`` (pure-torch fast path),
``naive.naive_causal_conv1d`` (per-sample reference).
"""

from .naive import naive_causal_conv1d
from .op import causal_conv1d

__all__ = ["causal_conv1d", "naive_causal_conv1d"]
