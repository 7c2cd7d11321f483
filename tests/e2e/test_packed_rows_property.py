"""A property over packed rows as users build them: B >= 1 rows of drawn sample lengths (one-token samples
included), padding tails, boundaries from ``position_ids``, ``cu_seq_lens`` or ``seq_idx``, with a 2-D mask or
without, and no targets, collator ``labels``, ``shift_labels`` inside their samples or ``shift_labels`` rolled
over the row (each sample's last token targets the next one's first). Every draw is exact against the stock model
on each sample alone (logits and loss, float64), or, for rolled ``shift_labels`` on a row of several segments, a
``ValueError`` naming them; any other exception, and any other refusal, fails. Explicit examples hold the layouts
that caught bugs: lengths ``[2, 2, 1, 2]`` (a length group whose first two samples are adjacent and whose third is
not), one-token samples at a row's edges, and B = 2 with tails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from tests.conftest import assert_close
from tests.helpers import shared_pair

MODEL_TYPES = ["llama", "qwen3_next", "mamba2"]
TOLERANCE = {"llama": 1e-9}
"""Logits; 1e-6 else: the stock scans of Qwen3-Next and Mamba2 compute in float32 inside."""
LOSS_TOLERANCE = 1e-6
"""transformers computes the loss in float32 whatever the model's dtype."""

rows = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=3)
draws = st.fixed_dictionaries({
    "rows": rows,
    "tails": st.lists(st.integers(0, 2), min_size=3, max_size=3),
    "source": st.sampled_from(["position_ids", "cu_seq_lens", "seq_idx"]),
    "mask": st.booleans(),
    "targets": st.sampled_from(["none", "labels", "shift_labels", "rolled shift_labels"]),
})
EXAMPLES = [
    {"rows": [[2, 2, 1, 2]], "tails": [0, 0, 0], "source": "position_ids", "mask": False, "targets": "shift_labels"},
    {"rows": [[2, 2, 1, 2]], "tails": [1, 0, 0], "source": "cu_seq_lens", "mask": True, "targets": "labels"},
    {"rows": [[1, 3, 1], [2, 1]], "tails": [0, 2, 0], "source": "seq_idx", "mask": True, "targets": "shift_labels"},
    {"rows": [[4, 1], [5]], "tails": [1, 0, 0], "source": "position_ids", "mask": False,
     "targets": "rolled shift_labels"},
]


def _build(draw: dict) -> tuple[dict[str, torch.Tensor], list[list[tuple[int, int]]], torch.Tensor]:
    """The call, each row's samples as ``(start, length)``, and the row's targets ``[B, T]`` as the loss reads them
    (``shift_labels``: what each token predicts)."""
    lengths = [sum(row) + tail for row, tail in zip(draw["rows"], draw["tails"])]
    seq_len = max(lengths)
    generator = torch.Generator().manual_seed(seq_len * 31 + len(draw["rows"]))
    batch = len(draw["rows"])
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    positions = torch.zeros(batch, seq_len, dtype=torch.long)
    seq_idx = torch.zeros(batch, seq_len, dtype=torch.int32)
    mask = torch.zeros(batch, seq_len, dtype=torch.long)
    labels = torch.full((batch, seq_len), -100)
    offsets, samples = [0], []
    for row, sample_lengths in enumerate(draw["rows"]):
        start, mine = 0, []
        for index, length in enumerate(sample_lengths):
            span = slice(start, start + length)
            ids[row, span] = torch.randint(3, 128, (length,), generator=generator)
            positions[row, span] = torch.arange(length)
            seq_idx[row, span] = index
            mask[row, span] = 1
            labels[row, start + 1:start + length] = ids[row, start + 1:start + length]
            mine.append((start, length))
            offsets.append(row * seq_len + start + length)
            start += length
        if start < seq_len:  # the row's padding tail: a segment of its own, ids restarting at 0
            positions[row, start:] = torch.arange(seq_len - start)
            seq_idx[row, start:] = len(sample_lengths)
            offsets.append((row + 1) * seq_len)
        samples.append(mine)
    call: dict[str, torch.Tensor] = {"input_ids": ids}
    if draw["source"] == "position_ids":
        call["position_ids"] = positions
    elif draw["source"] == "cu_seq_lens":
        call["cu_seq_lens_q"] = call["cu_seq_lens_k"] = torch.tensor(offsets, dtype=torch.int32)
    else:
        call["seq_idx"] = seq_idx
    if draw["mask"]:
        call["attention_mask"] = mask
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    if draw["targets"] == "labels":
        call["labels"] = labels
    elif draw["targets"] == "shift_labels":
        call["shift_labels"] = call["labels"] = targets
    elif draw["targets"] == "rolled shift_labels":
        # every kept token targets the row's next token, across samples too
        targets = torch.roll(ids, -1, dims=1).masked_fill(mask == 0, -100)
        call["shift_labels"] = call["labels"] = targets
    return call, samples, targets


def _segments_per_row(draw: dict) -> list[int]:
    """Segments a row holds by packfree's reading: its samples, and its padding tail unless a mask marks it padding."""
    seq_len = max(sum(row) + tail for row, tail in zip(draw["rows"], draw["tails"]))
    return [len(row) + (sum(row) < seq_len and not draw["mask"]) for row in draw["rows"]]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@given(draw=draws)
@example(draw=EXAMPLES[0])
@example(draw=EXAMPLES[1])
@example(draw=EXAMPLES[2])
@example(draw=EXAMPLES[3])
def test_packed_rows_are_exact_or_refused(model_type: str, draw: dict) -> None:
    model, stock = shared_pair(model_type)
    call, samples, targets = _build(draw)
    crossing = draw["targets"] == "rolled shift_labels" and max(_segments_per_row(draw)) > 1
    if crossing:
        with pytest.raises(ValueError, match=r"shift_labels at the last token before a packed sample .* not -100"):
            model(**call)
        return
    with torch.no_grad():
        output = model(**call)
        total, count = torch.zeros((), dtype=torch.float64), (targets != -100).sum()
        for row, row_samples in enumerate(samples):
            for start, length in row_samples:
                span = slice(start, start + length)
                alone = stock(input_ids=call["input_ids"][row:row + 1, span], use_cache=False).logits[0]
                assert_close(output.logits[row, span], alone, atol=TOLERANCE.get(model_type, 1e-6), rtol=0,
                             what=f"{model_type} {draw} row {row} sample at {start}")
                total += F.cross_entropy(alone.double(), targets[row, span], ignore_index=-100, reduction="sum")
    if draw["targets"] != "none" and count > 0:
        assert_close(output.loss.double(), total / count, atol=LOSS_TOLERANCE, rtol=0, what=f"{model_type} {draw} loss")
