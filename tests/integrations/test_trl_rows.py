""":class:`PackedRows`, the layout every packed TRL forward uses: real tokens move and come back unchanged, no label
or prediction crosses a sample (each token's prediction is read only where its target is in the same sample), and
masks it cannot pack are refused."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.integrations.trl import PackedRows


def padded_mask(spans: list[tuple[int, int]], length: int) -> torch.Tensor:
    """``[B, L]`` mask with ones on ``start:start + size`` of each row (right, left and both-side padding)."""
    mask = torch.zeros(len(spans), length, dtype=torch.long)
    for row, (start, size) in enumerate(spans):
        mask[row, start:start + size] = 1
    return mask


SPANS = [(0, 5), (2, 3), (0, 7), (1, 1), (3, 4)]


@pytest.mark.parametrize("budget", [None, 8, 9])
def test_tokens_round_trip_and_predictions_stay_in_their_sample(budget) -> None:
    mask = padded_mask(SPANS, 8)
    rows = PackedRows.of(mask, budget)
    assert rows.rows == (1 if budget is None else rows.rows) and rows.row_len <= (budget or 20)
    ids = torch.arange(1, 41).view(5, 8) * mask  # every real token unique, padding 0
    packed = rows.pack(ids)
    assert sorted(packed[packed > 0].tolist()) == sorted(ids[ids > 0].tolist())
    # a packed prediction at (r, t) carries the id of its target token t + 1; unpacked, it must land where the
    # padded row predicts that same token from the token before it in the same sample
    targets = packed[:, 1:].to(torch.float64)
    sources = packed[:, :-1].to(torch.float64)
    back_targets, back_sources = rows.unpack_predictions(targets), rows.unpack_predictions(sources)
    kept = back_targets != 0
    expected_targets = (ids[:, 1:] * mask[:, :-1] * mask[:, 1:]).to(torch.float64)
    assert torch.equal(back_targets, expected_targets)  # every in-sample prediction, none other
    assert torch.equal(back_sources[kept], ids[:, :-1].to(torch.float64)[kept])


def test_labels_are_ignored_at_every_sample_start_and_on_padding() -> None:
    mask = padded_mask(SPANS, 8)
    rows = PackedRows.of(mask, 9)
    labels = torch.full((5, 8), 7) * mask + (mask - 1) * 100  # 7 on real tokens, -100 on padding
    packed = rows.packed_labels(labels).reshape(-1)
    assert (packed[rows.sample_starts] == -100).all()
    keep = torch.zeros_like(packed, dtype=torch.bool)
    keep[rows.packed_index] = True
    keep[rows.sample_starts] = False
    assert (packed[keep] == 7).all() and (packed[~keep] == -100).all()


def test_scores_return_in_row_order() -> None:
    rows = PackedRows.of(padded_mask(SPANS, 8), 8)
    per_sample = rows.order.to(torch.float64)[:, None]  # packed order, each sample's own row index as its score
    assert torch.equal(rows.in_row_order(per_sample).flatten(), torch.arange(5, dtype=torch.float64))


@pytest.mark.parametrize(("mask", "message"), [
    (torch.tensor([[1, 0, 1, 1]]), "not contiguous"),
    (torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]), "no real token"),
    (torch.ones(2, 2, 2), "2-D"),
])
def test_refuses_what_it_cannot_pack(mask, message) -> None:
    with pytest.raises(ValueError, match=message):
        PackedRows.of(mask)


def test_budget_smaller_than_a_sample_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        PackedRows.of(padded_mask(SPANS, 8), 6)


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2"])
def test_hybrid_state_never_crosses_a_packed_sample(model_type: str) -> None:
    """Scoring through :func:`pack_scoring` (all samples in one row): changing every token of one sample leaves the
    other samples' per-token log-probs bit for bit unchanged, and they equal the stock model's on the padded batch."""
    from trl.trainer.utils import add_fused_lm_head

    from packfree_plugin.integrations.trl import pack_scoring
    from tests.integrations.trl_runs import models, tolerance

    packed_model, stock = (model.eval() for model in models(model_type))
    for model in (packed_model, stock):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    pack_scoring(packed_model)
    mask = padded_mask([(0, 9), (0, 4), (0, 7), (0, 6)], 9)
    ids = torch.randint(3, 128, (4, 9), generator=torch.Generator().manual_seed(0)) * mask
    labels = ids.masked_fill(mask == 0, -100)

    def log_probs(model, tokens):
        with torch.no_grad():
            return model(input_ids=tokens, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs

    reference = log_probs(packed_model, ids)
    torch.testing.assert_close(reference, log_probs(stock, ids), rtol=tolerance(model_type), atol=1e-6)
    changed = ids.clone()
    changed[1, :4] = (changed[1, :4] + 17) % 125 + 3  # the second sample, the row's second segment
    moved = log_probs(packed_model, changed)
    others = [0, 2, 3]
    assert torch.equal(moved[others], reference[others]), "a packed sample's log-probs moved with another sample"
    assert not torch.equal(moved[1], reference[1])
