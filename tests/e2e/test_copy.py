"""``copy.deepcopy`` of a packfree model (TRL reference models, EMA copies) must run its own weights."""

from __future__ import annotations

import copy

import torch

from packfree_plugin.verify import packed_row
from tests.e2e.conftest import fresh_pair, samples_of


def test_deep_copy_of_a_hybrid_runs_its_own_weights() -> None:
    model, _ = fresh_pair("qwen3_next")
    twin = copy.deepcopy(model)
    batch = {k: v for k, v in packed_row([torch.tensor(s) for s in samples_of([6, 9])]).items()}
    with torch.no_grad():
        before = twin(**batch).logits
        for parameter in model.parameters():
            parameter.mul_(0.5)
        after = twin(**batch).logits
    assert torch.equal(before, after), "changing the original's weights changed the copy's outputs"
