"""Mamba1 selective scan that restarts its state at every sample boundary of a packed row.

``op.selective_scan`` (public; pure torch on every device: the CUDA kernel has no varlen support),
``fast.selective_scan_chunked`` / ``fast.linear_scan`` (blocked scan), ``naive.naive_selective_scan``.
"""

from .naive import naive_selective_scan
from .op import selective_scan
from .fast import linear_scan, selective_scan_chunked

__all__ = ["linear_scan", "selective_scan", "selective_scan_chunked", "naive_selective_scan"]
