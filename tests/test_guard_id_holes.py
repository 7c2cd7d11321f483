"""A hole in a packed sample, padding inside it that its ids or segments run across, is refused with a clear
``ValueError``, whatever form carries the packing (2-D ``position_ids`` numbered by kept tokens or by position, MRoPE
``[3, B, T]`` and ``[4, B, T]`` ids, ``seq_idx``, ``cu_seq_lens_q/k``), beside a 2-D ``attention_mask``, in rows padded
on the left or on the right. The same row where a new sample starts after that padding (ids restarting, a segment of
its own) reads as packed samples beside padding, so the refusal is the hole's.

Hypothesis draws the rows: one or two, their samples, their padding, where the hole is and how long."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.forward.reading import boundaries_for_call
from tests.helpers import shared_pair, samples_of
from tests.models.vlm_cases import CASES

ID_REFUSAL = "has padding inside a sample .* packfree cannot leave a hole in a packed sample"
SEGMENT_REFUSAL = "is partly masked .* a packed sample must be entirely kept or entirely padding"
FORMS = {
    # form: the model it runs on, the refusal
    "position_ids counting kept tokens": ("llama", ID_REFUSAL),
    "position_ids counting positions": ("llama", ID_REFUSAL),
    "MRoPE [3, B, T] ids": ("qwen2_vl", ID_REFUSAL),
    "MRoPE [4, B, T] ids": ("qwen2_vl", ID_REFUSAL),
    "seq_idx": ("llama", SEGMENT_REFUSAL),
    "cu_seq_lens": ("llama", SEGMENT_REFUSAL),
}


@dataclass(frozen=True)
class Row:
    """One row: its samples' lengths, its padding (on the row's padded side) and, in sample ``holed``, ``hole``
    padding tokens after its first ``kept_before`` tokens."""

    lengths: tuple[int, ...]
    padding: int
    holed: int | None = None
    kept_before: int = 1
    hole: int = 0


@st.composite
def batches(draw: st.DrawFn) -> list[Row]:
    """One or two rows, the first holding a hole in one of its two or three samples (so the row is packed)."""
    holed_lengths = tuple(draw(st.lists(st.integers(2, 6), min_size=2, max_size=3)))
    holed = draw(st.integers(0, len(holed_lengths) - 1))
    first = Row(holed_lengths, draw(st.integers(0, 2)), holed, draw(st.integers(1, holed_lengths[holed] - 1)),
                draw(st.integers(1, 3)))
    rows = [first]
    if draw(st.booleans()):
        rows.append(Row(tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))), 0))
    return rows


def _layout(rows: list[Row], *, side: str, restart: bool) -> dict[str, torch.Tensor]:
    """Per-token ``input_ids``, ``attention_mask``, ids numbered by kept tokens and by position, and segment
    indices ``[B, T]``, every row padded on ``side`` to the longest. ``restart``: a new sample starts after the hole
    (ids back to 0, a new segment) instead of the sample running on across it."""
    lines = []
    for row in rows:
        pieces = []  # (kept, id by kept tokens, id by position, segment) per token
        segment = 0
        for index, length in enumerate(row.lengths):
            kept_ids, position = 0, 0
            for token in range(length + (row.hole if index == row.holed else 0)):
                in_hole = index == row.holed and row.kept_before <= token < row.kept_before + row.hole
                if index == row.holed and restart and token in (row.kept_before, row.kept_before + row.hole):
                    segment, kept_ids, position = segment + 1, 0, 0
                pieces.append((not in_hole, 0 if in_hole else kept_ids, position, segment))
                kept_ids += not in_hole
                position += 1
            segment += 1
        lines.append((pieces, row.padding))
    width = max(len(pieces) + padding for pieces, padding in lines)
    columns: dict[str, list[list[int]]] = {name: [] for name in ("mask", "kept_ids", "positions", "segments")}
    for pieces, _ in lines:
        pad = width - len(pieces)
        padding = [(False, 0, 0, -1)] * pad
        tokens = padding + pieces if side == "left" else pieces + padding
        for name, values in zip(columns, zip(*tokens, strict=True), strict=True):
            columns[name].append(list(values))
    segments = torch.tensor(columns["segments"])
    ids = torch.tensor(samples_of([width] * len(rows), seed=width))
    return {"input_ids": ids, "attention_mask": torch.tensor(columns["mask"]).long(),
            "kept_ids": torch.tensor(columns["kept_ids"]), "positions": torch.tensor(columns["positions"]),
            "seq_idx": _numbered(segments)}


def _numbered(segments: torch.Tensor) -> torch.Tensor:
    """Segment indices ``[B, T]`` (-1: row padding) as ``seq_idx``: non-decreasing over the flattened batch, each
    run of row padding a segment of its own."""
    flat = segments.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: segments.shape[1]] = True
    return (starts.cumsum(0) - 1).reshape(segments.shape).int()


def _call(form: str, layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments that carry the packing in ``form``."""
    call = {"input_ids": layout["input_ids"], "attention_mask": layout["attention_mask"]}
    kept_ids = layout["kept_ids"]
    if form == "position_ids counting kept tokens":
        call["position_ids"] = kept_ids
    elif form == "position_ids counting positions":
        call["position_ids"] = layout["positions"]
    elif form.startswith("MRoPE"):
        call["position_ids"] = kept_ids[None].expand(3 if "[3" in form else 4, -1, -1).contiguous()
    elif form == "seq_idx":
        call["seq_idx"] = layout["seq_idx"]
    else:
        seq_idx = layout["seq_idx"].reshape(-1)
        offsets = torch.cat([torch.tensor([0]), torch.nonzero(seq_idx[1:] != seq_idx[:-1]).flatten() + 1,
                             torch.tensor([seq_idx.numel()])]).int()
        call["cu_seq_lens_q"] = call["cu_seq_lens_k"] = offsets
    return call


@cache
def _model(model_type: str) -> torch.nn.Module:
    if model_type == "qwen2_vl":
        return CASES["qwen2_vl"].build("packfree")
    return shared_pair(model_type)[0]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("form", list(FORMS))
@given(rows=batches())
def test_a_hole_after_padding_is_refused_in_every_form(form: str, side: str, rows: list[Row]) -> None:
    model_type, refusal = FORMS[form]
    model = _model(model_type)
    with torch.no_grad(), pytest.raises(ValueError, match=refusal):
        model(**_call(form, _layout(rows, side=side, restart=False)))
    restarted = boundaries_for_call(_call(form, _layout(rows, side=side, restart=True)))
    assert restarted.is_packed and restarted.has_padding, "a new sample after the padding reads as one"
