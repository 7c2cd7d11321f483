"""HF ``Trainer`` + ``DataCollatorWithFlattening`` under packfree: each step's loss equals the stock padded
run's on the same samples, step after step (same initial weights, optimizer and order)."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from packfree_plugin.cli.demo import PaddedCollator, train
from tests.helpers import fresh_pair, samples_of

LENGTHS = [9, 3, 14, 6, 11, 2, 8, 5, 12, 7, 4, 10]


@pytest.mark.parametrize("model_type, collator_kwargs", [
    ("llama", {}),  # position_ids only, the collator's default
    ("qwen3_next", {"return_flash_attn_kwargs": True, "return_seq_idx": True}),
], ids=["llama-position_ids", "qwen3_next-flash_kwargs"])
def test_trainer_with_flattening_collator_follows_the_padded_run(tmp_path, model_type, collator_kwargs) -> None:
    model, stock = fresh_pair(model_type)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    samples = [{"input_ids": sample} for sample in samples_of(LENGTHS)]
    common = dict(steps=3, batch_size=4, learning_rate=1e-2, seed=0, out=tmp_path, progress=False)
    padded = train(stock.train(), samples, PaddedCollator(), label="padded", **common)
    packed = train(model.train(), samples, DataCollatorWithFlattening(**collator_kwargs), label="packed", **common)
    assert len(packed.losses) == len(padded.losses) == 3
    for step, (a, b) in enumerate(zip(packed.losses, padded.losses), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: packed loss {a} vs padded {b}"
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items()), "the model did not train"
