"""Boundary-aware diagonal linear recurrence (RG-LRU of recurrent_gemma; gated scans reducible to it).

``fast.linear_recurrence`` (public, pure PyTorch blocked scan), ``naive.naive_linear_recurrence`` (reference).
"""

from .naive import naive_linear_recurrence
from .fast import linear_recurrence

__all__ = ["linear_recurrence", "naive_linear_recurrence"]
