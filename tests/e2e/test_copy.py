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


def _pickled(model, tmp_path):
    return pickle.loads(pickle.dumps(model))


def _torch_saved(model, tmp_path):
    torch.save(model, tmp_path / "model.pt")
    return torch.load(tmp_path / "model.pt", weights_only=False)


def _deep_copied(model, tmp_path):
    return copy.deepcopy(model)


def _saved_pretrained(model, tmp_path):
    from transformers import AutoModelForCausalLM

    model.save_pretrained(tmp_path / "saved")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="packfree",
                                                dtype=torch.float64, experts_implementation="eager").eval()


ROUND_TRIPS = {"pickle": _pickled, "torch.save": _torch_saved, "deepcopy": _deep_copied,
               "save_pretrained": _saved_pretrained}


@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2", "jamba", "llama"])
def test_a_round_tripped_model_still_packs_exactly(model_type: str, trip: str, tmp_path) -> None:
    """A prepared model (hybrids whose mixers packfree routes through transformers' kernel functions, and an attention
    model) loads back from ``pickle``, ``torch.save``/``torch.load``, ``copy.deepcopy`` and ``save_pretrained`` +
    ``from_pretrained(attn_implementation="packfree")`` into a model whose packed samples, in logits and in the
    gradient of every parameter, equal the stock twin on each sample alone. Where stock itself cannot be pickled
    (transformers < 5.24), packfree's model fails the same way and adds no failure of its own."""
    model, stock = fresh_pair(model_type)
    if trip in ("pickle", "torch.save") and not _stock_pickles(model_type):
        with pytest.raises((AttributeError, pickle.PicklingError)):
            pickle.dumps(model)
        return
    twin = ROUND_TRIPS[trip](model, tmp_path)
    assert twin.config._attn_implementation == "packfree"
    lengths = [6, 9, 4]
    samples = samples_of(lengths)
    batch = packed_row([torch.tensor(s) for s in samples])
    packed = twin(**batch).logits[0]
    packed.square().sum().backward()
    for piece, sample in zip(packed.split(lengths), samples):
        alone = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
        alone.square().sum().backward()
        assert_close(piece, alone, atol=1e-6, rtol=0, what=f"{model_type} after {trip}")
    # gradients to 1e-5 of their largest entry: stock's Mamba mixers run their scans in float32 inside a float64 model
    stock_grads = dict(stock.named_parameters())
    for name, parameter in twin.named_parameters():
        expected = stock_grads[name].grad
        if expected is None:
            assert parameter.grad is None or not parameter.grad.any(), name
            continue
        assert_close(parameter.grad, expected, atol=1e-5 * max(1.0, expected.abs().max().item()), rtol=0,
                     what=f"{model_type} after {trip}: gradient of {name}")
