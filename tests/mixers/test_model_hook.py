"""The model hook's stack discipline: every forward leaves the per-thread stack as it found it."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.forward.context import boundaries_here
from tests.helpers import fresh_pair


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
        assert boundaries_here() is None
        assert torch.equal(model(input_ids=ids, cu_seq_lens_q=good, cu_seq_lens_k=good).logits, expected)
    assert boundaries_here() is None


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_boundaries_built_ahead_allow_a_full_graph(model_type: str) -> None:
    """A caller may build the Boundaries itself and pass them as ``packfree_boundaries``: nothing is read on
    the host during the forward, so ``torch.compile(fullgraph=True)`` traces it whole, and the result is the
    eager packed one."""
    from packfree_plugin import Boundaries

    model, _ = fresh_pair(model_type)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    ids = torch.randint(3, 128, (1, 17))
    positions = torch.cat([torch.arange(n) for n in (5, 9, 3)])[None]
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        given = Boundaries.from_position_ids(positions)
        actual = compiled(input_ids=ids, position_ids=positions, use_cache=False, packfree_boundaries=given).logits
    torch._dynamo.reset()
    assert torch.allclose(actual, expected, atol=1e-10, rtol=0)


def test_boundaries_that_do_not_fit_the_tokens_are_refused() -> None:
    from packfree_plugin import Boundaries

    model, _ = fresh_pair("mamba2")  # no attention layer would catch the mismatch later
    ids = torch.randint(3, 128, (1, 17))
    with torch.no_grad(), pytest.raises(ValueError, match=r"describe \[B=1, T=16\]"):
        model(input_ids=ids, packfree_boundaries=Boundaries([0, 8, 16], batch_size=1, seq_len=16, device="cpu"))
    with torch.no_grad(), pytest.raises(ValueError, match="must be a packfree_plugin.Boundaries"):
        model(input_ids=ids, packfree_boundaries=[0, 8, 17])
    assert boundaries_here() is None
