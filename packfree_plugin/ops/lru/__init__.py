"""Boundary-aware diagonal linear recurrence (RG-LRU of recurrent_gemma; gated scans reducible to it)."""

from packfree_plugin.ops.lru.naive import naive_linear_recurrence
from packfree_plugin.ops.lru.scan import linear_recurrence

__all__ = ["linear_recurrence", "naive_linear_recurrence"]
