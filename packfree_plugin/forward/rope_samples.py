"""Each packed sample's multimodal-RoPE positions, numbered by the model's own ``get_rope_index`` on that sample alone.

The image and video grids of a packed batch go to the samples whose placeholders they fill: in order, row after
row, as the model's forward scatters the vision features over its placeholders. Each sample takes grids until they
cover its placeholders of that kind (a grid ``[t, h, w]`` of patches fills ``t * h * w / merge**2`` of them), and
``get_rope_index`` numbers it with those grids alone, as the model's forward numbers a lone sample; the pieces are
laid out as ``[R, B, T]`` ids. Read by :mod:`.rope_ids` for a packed row the model gets with 2-D ids or boundary
keywords alone, and by :class:`packfree_plugin.packing.VisionPackedCollator` at collate time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch
from torch import nn

from ..boundaries import Boundaries, host_of

__all__ = ["GRID_KEYS", "RopeIndex", "lay_out_positions", "packed_rope_positions", "rope_index_of",
           "sample_positions"]

RopeIndex = Callable[..., tuple[torch.Tensor, Any]]
"""``get_rope_index(input_ids [1, T], mm_token_type_ids [1, T], image_grid_thw=, video_grid_thw=, ...)`` ->
``(positions [R, 1, T], deltas)``."""
GRID_KEYS = {1: "image_grid_thw", 2: "video_grid_thw"}
"""``mm_token_type_ids`` value -> the argument holding the grids ``[n, 3]`` (t, h, w in patches) of what it marks."""
_KINDS = {1: "image", 2: "video"}

Placement = tuple[int, int, int, "dict[int, tuple[int, int]] | None"]
"""``(row, start, end, spans)`` of one segment; ``spans``: kind -> ``(first, last)`` grids it takes (None: padding)."""


def rope_index_of(model: nn.Module | None) -> RopeIndex | None:
    """The ``get_rope_index`` of ``model`` or of its inner ``model`` (a ``...ForConditionalGeneration``'s), or None."""
    owner = next((m for m in (model, getattr(model, "model", None)) if hasattr(m, "get_rope_index")), None)
    return None if owner is None else owner.get_rope_index


def sample_positions(rope_index: RopeIndex, input_ids: torch.Tensor, token_types: torch.Tensor,
                     **grids: torch.Tensor) -> torch.Tensor:
    """``[R, T]`` positions of one sample (``input_ids``, ``token_types`` ``[T]``; its own grids and, for Qwen2.5-VL,
    ``second_per_grid_ts``), numbered as the model numbers it alone."""
    positions = rope_index(input_ids=input_ids[None], mm_token_type_ids=token_types[None], **grids)[0]
    if positions.ndim != 3 or positions.shape[1] != 1 or positions.shape[2] != len(input_ids):
        raise ValueError(f"get_rope_index returned positions of shape {list(positions.shape)} for a sample of "
                         f"{len(input_ids)} tokens; expected [R, 1, {len(input_ids)}]")
    return positions[:, 0].to(torch.int64)


def lay_out_positions(rows: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """``[R, B, T]`` from each row's pieces in order: a sample's ``[R, L]`` positions, or a padding span's ``[L]`` ids
    (the same on every plane)."""
    planes = {piece.shape[0] for pieces in rows for piece in pieces if piece.ndim == 2} or {3}
    if len(planes) != 1:
        raise ValueError(f"get_rope_index returned {sorted(planes)} position planes for samples of one batch")
    (count,) = planes
    return torch.stack([torch.cat([piece.expand(count, -1) for piece in pieces], dim=-1) for pieces in rows], dim=1)


def packed_rope_positions(rope_index: RopeIndex, arguments: dict[str, Any], boundaries: Boundaries, *, merge: int,
                          takes_seconds: bool, model: str) -> torch.Tensor:
    """``[R, B, T]``: every sample of ``boundaries`` numbered by ``rope_index`` alone with the grids it takes
    (module docstring); a padding span counts 0, 1, ... on every plane. ``arguments``: the call's ``input_ids`` and
    ``mm_token_type_ids`` ``[B, T]``, ``image_grid_thw`` / ``video_grid_thw`` and, where ``takes_seconds``,
    ``second_per_grid_ts`` (one per video); ``merge``: the vision tower's spatial merge; ``model``: named in
    refusals. Reads nothing from the device but what the forward's one read copied (:func:`host_of`)."""
    input_ids, token_types = arguments["input_ids"], arguments["mm_token_type_ids"]
    grids = {kind: arguments.get(key) for kind, key in GRID_KEYS.items()}
    seconds = arguments.get("second_per_grid_ts") if takes_seconds else None
    videos = grids[2]
    if seconds is not None and (videos is None or len(seconds) != len(videos)):
        raise ValueError(f"{model}: second_per_grid_ts holds {len(seconds)} values for "
                         f"{0 if videos is None else len(videos)} video grids; pass one per video, in sample order")
    rows: list[list[torch.Tensor]] = [[] for _ in range(boundaries.batch_size)]
    for row, start, end, spans in _grids_by_sample(host_of(token_types), boundaries, grids, merge, model):
        if spans is None:
            rows[row].append(torch.arange(end - start, device=input_ids.device))
            continue
        own = {GRID_KEYS[kind]: grids[kind][first:last] for kind, (first, last) in spans.items() if last > first}
        if seconds is not None and spans[2][1] > spans[2][0]:
            own["second_per_grid_ts"] = seconds[spans[2][0]:spans[2][1]]
        rows[row].append(sample_positions(rope_index, input_ids[row, start:end], token_types[row, start:end], **own))
    return lay_out_positions(rows)


def _grid_tokens(grids: torch.Tensor | None, merge: int, model: str, key: str) -> numpy.ndarray:
    """How many placeholders each grid of ``grids [n, 3]`` fills (none given: no grids)."""
    if grids is None:
        return numpy.zeros(0, dtype=numpy.int64)
    if grids.ndim != 2 or grids.shape[-1] != 3 or grids.is_floating_point():
        raise ValueError(f"{model}: {key} has shape {list(grids.shape)} ({grids.dtype}); pass integer [n, 3] grids "
                         "(t, h, w in patches), one row per image or video, in sample order")
    return host_of(grids).astype(numpy.int64).prod(axis=-1) // merge ** 2


def _grids_by_sample(token_types: numpy.ndarray, boundaries: Boundaries, grids: dict[int, torch.Tensor | None],
                     merge: int, model: str) -> list[Placement]:
    """Every segment of ``boundaries`` in order, with the grids each sample takes (module docstring);
    ``token_types [B, T]`` on the host (0 text, 1 image, 2 video). Refused: a sample whose placeholders of a kind the
    grids that come next do not cover exactly, grids left over once every sample took its own."""
    unknown = sorted(set(numpy.unique(token_types).tolist()) - {0, *GRID_KEYS})
    if unknown:
        raise ValueError(f"{model}: mm_token_type_ids hold {unknown}; packfree numbers text (0), image (1) and video "
                         "(2) tokens. Pass the processor's mm_token_type_ids")
    tokens = {kind: _grid_tokens(grids[kind], merge, model, GRID_KEYS[kind]) for kind in GRID_KEYS}
    taken = dict.fromkeys(GRID_KEYS, 0)
    held: dict[int, list[int]] = {kind: [] for kind in GRID_KEYS}
    placed: list[Placement] = []
    sample = 0
    for first, last, padding in zip(boundaries.offsets, boundaries.offsets[1:], boundaries.padding):
        row, start = divmod(first, boundaries.seq_len)
        end = start + last - first
        if padding:
            placed.append((row, start, end, None))
            continue
        spans = {}
        for kind, counts in tokens.items():
            wanted = int((token_types[row, start:end] == kind).sum())
            begin = stop = taken[kind]
            while counts[begin:stop].sum() < wanted and stop < len(counts):
                stop += 1
            if int(counts[begin:stop].sum()) != wanted:
                raise ValueError(_misfit(model, sample, (row, start, end), kind, wanted, counts[begin:stop], merge))
            spans[kind] = (begin, stop)
            taken[kind] = stop
            held[kind].append(wanted)
        placed.append((row, start, end, spans))
        sample += 1
    for kind, counts in tokens.items():
        if taken[kind] < len(counts):
            raise ValueError(
                f"{model}: {GRID_KEYS[kind]} holds {len(counts)} grids, but the packed samples' {_KINDS[kind]} "
                f"placeholders ({held[kind]} tokens, sample by sample) take only the first {taken[kind]}; the rest "
                f"would fill nothing. Pass one grid per {_KINDS[kind]} of the batch, in sample order"
            )
    return placed


def _misfit(model: str, sample: int, where: tuple[int, int, int], kind: int, wanted: int, fills: numpy.ndarray,
            merge: int) -> str:
    row, start, end = where
    key, what = GRID_KEYS[kind], _KINDS[kind]
    given = f"the {key} grids that come next fill {[int(n) for n in fills]} tokens" if len(fills) else \
        f"no {key} grid is left for it"
    return (f"{model}: sample {sample} of the packed batch (row {row}, tokens {start}-{end - 1}) holds {wanted} "
            f"{what} placeholder tokens (mm_token_type_ids {kind}), but {given}, in order after the earlier samples'. "
            f"Pass every sample's grids in the order of its {what}s, the samples in row order (a grid [t, h, w] fills "
            f"t * h * w / {merge ** 2} placeholders)")
