"""What packfree derives from a boundary tensor, built once per tensor: :func:`memo`.

Every layer of a forward passes the same ``seq_idx`` / ``cu_seqlens`` tensor, so masks, index maps and value checks
derived from it are built for the first layer and kept on the tensor itself (freed with it). An in-place write to
the tensor bumps its version, which makes every value kept on it stale.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from torch import Tensor

__all__ = ["memo"]

_ATTR = "_packfree_memo"
Value = TypeVar("Value")


def memo(tensor: Tensor, name: str, key: Hashable, build: Callable[[], Value]) -> Value:
    """``build()``, kept on ``tensor`` under ``name`` while ``key`` and the tensor's version stay what they were.

    One value per name: a call with another ``key`` (a new chunk size, dtype or length) builds and keeps its own in
    place of the old. A ``build`` that raises keeps nothing.
    """
    kept = tensor.__dict__.setdefault(_ATTR, {})
    stamp = (key, tensor._version)
    entry = kept.get(name)
    if entry is None or entry[0] != stamp:
        entry = (stamp, build())
        kept[name] = entry
    return entry[1]
