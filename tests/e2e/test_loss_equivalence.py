"""Training on packed rows gives the loss and gradients of the same samples padded (stock reference).

One representative model per family (Llama, Qwen3-Next's Gated DeltaNet hybrid, Mamba2, LFM2), float64.
Packed: :class:`packfree_plugin.packing.PackedCollator` rows of a drawn token budget (several samples per
row, padded row tails, sometimes an empty padding row). Padded: one sample per row, stock attention.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packfree_plugin.packing import PackedCollator, pack_best_fit_decreasing
from tests.conftest import assert_close
from tests.helpers import FAMILIES, gradients, padded_batch, samples_of, shared_pair


@st.composite
def layouts(draw) -> tuple[list[int], int, int]:
    """Sample lengths, row budget, rows. The budget fits the two shortest samples together, so best-fit
    decreasing puts >= 2 samples in some row: the batch is packed (the one-sample-per-row case is tested below)."""
    lengths = draw(st.lists(st.integers(1, 12), min_size=2, max_size=5))
    shortest = sorted(lengths)[:2]
    budget = draw(st.integers(max(max(lengths), sum(shortest)), sum(lengths) + 4))
    rows = len(pack_best_fit_decreasing(lengths, budget)) + draw(st.integers(0, 1))
    return lengths, budget, rows


@pytest.mark.parametrize("model_type", FAMILIES)
@settings(max_examples=5)
@given(layout=layouts())
def test_packed_rows_train_like_the_padded_batch(model_type: str, layout: tuple[list[int], int, int]) -> None:
    lengths, budget, rows = layout
    model, stock = shared_pair(model_type)
    samples = samples_of(lengths)
    packed = PackedCollator(rows_per_batch=rows, max_tokens=budget)([{"input_ids": s} for s in samples])
    model.zero_grad()
    stock.zero_grad()
    packed_loss = model(**packed).loss
    packed_loss.backward()
    if sum(lengths) == len(lengths):  # every sample has one token: nothing to predict, both losses are NaN
        assert torch.isnan(packed_loss)
        return
    padded_loss = stock(**padded_batch(samples), use_cache=False).loss
    padded_loss.backward()
    # transformers computes the loss in float32 whatever the model dtype
    assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-6, what=f"{model_type} loss")
    mine, theirs = gradients(model), gradients(stock)
    for name, grad in theirs.items():
        if name not in mine:
            assert torch.count_nonzero(grad) == 0, f"{name}: stock has a gradient, packfree none"
            continue
        assert_close(mine[name], grad, atol=1e-6, rtol=1e-5, what=f"{model_type} grad {name}")
    model.zero_grad()
    stock.zero_grad()


def test_one_sample_per_row_with_boundary_fields_trains_like_the_padded_batch() -> None:
    model, stock = shared_pair("qwen3_next")
    samples = samples_of([5, 5])
    packed = PackedCollator(rows_per_batch=2, max_tokens=5)([{"input_ids": s} for s in samples])
    try:
        loss = model(**packed).loss
    finally:
        model.zero_grad()
    expected = stock(**padded_batch(samples), use_cache=False).loss
    assert_close(loss, expected, atol=1e-6, rtol=1e-6, what="loss")
