"""Batches that pack nothing: one sample per row, which packfree runs exactly as stock runs them.

A batch carries a *packing signal* when it passes ``cu_seq_lens_q/k`` or ``seq_idx``, or position ids that restart
inside a row. Without one, each row is one sample, and its 2-D ``attention_mask`` may hold zeros anywhere in the row,
inside it too (transformers' tests build such padded references, and stock sdpa/eager mask those keys and run on).
:class:`~packfree_plugin.boundaries.Boundaries` cannot carry a hole inside a sample, so such a batch gets none: the
call runs on transformers' own mask, and every mixer on its own forward with the stock mask, which is what stock does.

Ids that start a sample after a row's first kept token (``attention_mask`` 1, every token without a mask) are read by
the one rule of :func:`packfree_plugin.boundaries.id_starts`, the same with a mask and without: an id that continues
the kept token before it neither by 1 nor by their distance (integer or float ids, as stock accepts both). Ids that run
on across padding (``arange``, or ``(cumsum(mask) - 1) * mask``) start nothing; ids that restart or jump forward
start a sample. ``[4, B, T]`` MRoPE ids: the same on the first (text) plane; ``[3, B, T]`` MRoPE ids: a kept token
whose three planes are all 0 (vision tokens repeat and go back in h and w).
"""

from __future__ import annotations

from typing import Any

import numpy
import torch

from ..boundaries import host_of, id_starts
from ..classes import inherited_entry, switched_on
from .keywords import PACKING_KWARGS

__all__ = ["carries_packing_signal", "has_holes", "ids_start_samples",
           "reads_as_one_sample_per_row", "slices_its_mask"]

def has_holes(attention_mask: torch.Tensor) -> bool:
    """Whether some row of a 2-D ``attention_mask [B, T]`` (nonzero = kept) has a 0 between two kept tokens."""
    kept = host_of(attention_mask) != 0
    runs = (kept[:, 1:] & ~kept[:, :-1]).sum(axis=1) + kept[:, 0]  # starts of runs of kept tokens
    return bool((runs > 1).any())


def ids_start_samples(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether ``position_ids`` (``[B, T]``, ``[1, T]``, ``[3 | 4, B, T]``) start a new sample after the first kept
    token of some row (see the module docstring); ``attention_mask [B, T]``: nonzero on kept tokens, None: all kept."""
    host = host_of(position_ids).astype(numpy.float64 if position_ids.is_floating_point() else numpy.int64)
    if host.ndim == 3 and host.shape[0] == 4:
        host = host[0]
    planes = host.ndim == 3
    if not planes:
        host = host[None]
    rows = host.shape[1]
    kept = None if attention_mask is None else host_of(attention_mask) != 0
    for row in range(rows if kept is None else kept.shape[0]):
        ids = host[:, row if rows > 1 else 0]
        tokens = None
        if kept is not None:
            tokens = numpy.flatnonzero(kept[row])
            ids = ids[:, tokens]
        starts = id_starts(ids if planes else ids[0], planes=planes, tokens=tokens)
        if bool(starts[1:].any()):
            return True
    return False


def carries_packing_signal(arguments: dict[str, Any]) -> bool:
    """Whether a call's bound ``arguments`` say its rows are packed: a boundary keyword (:data:`.keywords.PACKING_KWARGS`), or
    ``position_ids`` that restart inside a row's kept tokens (read with a 2-D ``attention_mask`` where one is given)."""
    if any(arguments.get(name) is not None for name in PACKING_KWARGS):
        return True
    position_ids, mask = arguments.get("position_ids"), arguments.get("attention_mask")
    mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
    return isinstance(position_ids, torch.Tensor) and ids_start_samples(position_ids, mask)


def reads_as_one_sample_per_row(arguments: dict[str, Any]) -> bool:
    """Whether a call's bound ``arguments`` carry a 2-D ``attention_mask`` and no packing signal: its rows are
    one sample each, read from the mask alone (position ids then only number positions, as in stock)."""
    mask = arguments.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.ndim == 2 and not carries_packing_signal(arguments)


def slices_its_mask(config: Any) -> bool:
    """Whether the model of ``config`` (a text config, as mask functions receive it) indexes its masks: a
    ``slices_mask`` quirk of its config class (:data:`packfree_plugin.classes.CLASSES`), as found by a sweep of
    transformers' modeling files (subscripts of ``create_*_mask`` results and of their mappings' values) and confirmed
    by running each (the sweep's other finds, VisualBERT under ``bypass_transformer`` and Longformer, are refused at
    load for their attention). An unpacked batch of these gets stock's mask tensors; on a packed row the boundaries
    are indexed (:meth:`~packfree_plugin.boundaries.Boundaries.__getitem__`: exact where nothing is cut, refused
    otherwise)."""
    return switched_on(inherited_entry(config).slices_mask, config)
