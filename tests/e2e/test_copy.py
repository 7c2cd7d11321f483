"""``copy.deepcopy`` of a packfree model (TRL reference models, EMA copies) must run its own weights."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from packfree_plugin.gate.audit import packed_row
from tests.conftest import assert_close
from tests.helpers import fresh_pair, samples_of


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


def _stock_pickles(model_type: str) -> bool:
    """transformers before 5.24 builds models that stock pickle cannot write (a local class in its kernels'
    fallback), so there is nothing for packfree to keep working there."""
    try:
        pickle.dumps(fresh_pair(model_type)[1])
    except (AttributeError, pickle.PicklingError):
        return False
    return True


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2"])
def test_saved_and_loaded_hybrid_still_packs_exactly(model_type: str, tmp_path) -> None:
    """``torch.save(model)`` / ``pickle`` of a prepared hybrid loads back into a model that still keeps packed samples
    apart: each packed sample equals the stock twin on that sample alone. Where stock itself cannot be pickled
    (transformers < 5.24), packfree's model fails the same way and adds no failure of its own."""
    model, stock = fresh_pair(model_type)
    if not _stock_pickles(model_type):
        with pytest.raises((AttributeError, pickle.PicklingError)):
            pickle.dumps(model)
        return
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    unpickled = pickle.loads(pickle.dumps(model))
    lengths = [6, 9, 4]
    samples = samples_of(lengths)
    batch = packed_row([torch.tensor(s) for s in samples])
    with torch.no_grad():
        for twin in (loaded, unpickled):
            packed = twin(**batch).logits[0]
            for piece, sample in zip(packed.split(lengths), samples):
                alone = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
                assert_close(piece, alone, atol=1e-6, rtol=0, what=f"{model_type} after save/load")
