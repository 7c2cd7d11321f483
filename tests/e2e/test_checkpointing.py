"""Gradient checkpointing on packed rows gives the gradients of the same model without it (packfree both)."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tests.e2e.conftest import fresh_pair, gradients, max_grad_diff, samples_of


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_checkpointed_packed_gradients_equal_plain(model_type: str, reentrant: bool, record_property) -> None:
    plain, _ = fresh_pair(model_type)
    checkpointed, _ = fresh_pair(model_type)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in samples_of([8, 3, 12, 6])])
    losses = []
    for model in (plain.train(), checkpointed.train()):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    assert checkpointed.is_gradient_checkpointing
    diff = max_grad_diff(gradients(plain), gradients(checkpointed))
    record_property("max_grad_diff", diff)
    assert torch.equal(losses[0], losses[1])
    assert len(gradients(checkpointed)) == len(gradients(plain)) > 0
    assert diff <= 1e-12, f"checkpointed gradients differ by {diff}"
