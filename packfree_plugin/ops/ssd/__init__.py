"""Mamba2 SSD chunk scan that restarts its state at every sample boundary of a packed row.

``op.ssd_chunk_scan`` (public, dispatching), ``fast.ssd_chunked`` (pure-torch fast path),
``naive.naive_ssd`` (per-sample, per-token reference).
"""

from .fast import ssd_chunked
from .naive import naive_ssd
from .op import ssd_chunk_scan

__all__ = ["ssd_chunk_scan", "ssd_chunked", "naive_ssd"]
