"""Mamba1 selective scan that restarts its state at every sample boundary of a packed row.

``op.selective_scan`` (public; pure torch on every device: the CUDA kernel has no varlen support),
``scan.selective_scan_chunked`` / ``scan.linear_scan`` (blocked scan), ``naive.selective_scan_naive``.
"""

from .naive import selective_scan_naive
from .op import selective_scan
from .scan import linear_scan, selective_scan_chunked

__all__ = ["linear_scan", "selective_scan", "selective_scan_chunked", "selective_scan_naive"]
