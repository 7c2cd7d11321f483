"""Mamba2 SSD chunk scan that restarts its state at every sample boundary of a packed row.

``op.ssd_chunk_scan`` (public, dispatching), ``chunk.ssd_chunked`` (pure-torch fast path),
``naive.ssd_naive`` (per-sample, per-token reference).
"""

from .chunk import ssd_chunked
from .naive import ssd_naive
from .op import ssd_chunk_scan

__all__ = ["ssd_chunk_scan", "ssd_chunked", "ssd_naive"]
