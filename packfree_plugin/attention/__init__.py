"""Packed attention: the ``"packfree"`` attention/mask functions and their backends."""

from .interface import choose_backend, packfree_attention_forward, run_packed_attention
from .masks import packfree_attention_mask
from .reference import AttentionOptions, eager_attention

__all__ = [
    "AttentionOptions",
    "choose_backend",
    "eager_attention",
    "packfree_attention_forward",
    "packfree_attention_mask",
    "run_packed_attention",
]
