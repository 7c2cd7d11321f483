"""The model hook's stack discipline: every forward leaves the per-thread stack as it found it."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.active import active_boundaries
from tests.e2e.conftest import fresh_pair


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_a_refused_batch_leaves_nothing_behind(model_type: str) -> None:
    model, _ = fresh_pair(model_type)
    ids = torch.randint(3, 128, (1, 10))
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with torch.no_grad():
        expected = model(input_ids=ids, cu_seq_lens_q=good, cu_seq_lens_k=good).logits
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                  cu_seq_lens_k=torch.tensor([0, 4, 9], dtype=torch.int32))
        assert active_boundaries.top() is None
        assert torch.equal(model(input_ids=ids, cu_seq_lens_q=good, cu_seq_lens_k=good).logits, expected)
    assert active_boundaries.top() is None
