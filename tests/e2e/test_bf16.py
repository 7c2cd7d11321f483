"""bf16 autocast on packed rows: finite, close to float32, and still isolated per sample."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tests.helpers import fresh_pair, samples_of


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "lfm2"])
def test_bf16_autocast_packed_is_finite_and_close_to_float32(model_type: str, record_property) -> None:
    model, stock = fresh_pair(model_type, dtype=torch.float32)
    lengths = [9, 4, 13, 6]
    samples = samples_of(lengths)
    batch = DataCollatorWithFlattening()([{"input_ids": s} for s in samples])
    with torch.no_grad():
        full = model(**batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = model(**batch)
            alone = [stock(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]
    assert torch.isfinite(half.logits).all() and torch.isfinite(half.loss)
    logit_diff = float((half.logits.float() - full.logits).abs().max())
    loss_diff = float((half.loss - full.loss).abs())
    record_property("bf16_vs_fp32_max_logit_diff", logit_diff)
    record_property("bf16_vs_fp32_loss_diff", loss_diff)
    scale = float(full.logits.abs().max())
    assert logit_diff <= 0.05 * scale, f"bf16 logits differ by {logit_diff} (fp32 logits up to {scale})"
    assert loss_diff <= 0.01 * float(full.loss), f"bf16 loss differs by {loss_diff}"
    # isolation holds in bf16 too: each packed piece is as close to stock-alone (bf16) as bf16 allows
    for index, (piece, expected) in enumerate(zip(half.logits[0].split(lengths), alone)):
        assert float((piece.float() - expected.float()).abs().max()) <= 0.05 * scale, f"sample {index}"
