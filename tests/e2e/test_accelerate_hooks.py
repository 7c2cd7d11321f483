"""Models that carry accelerate's hooks, as the guides load them: ``cpu_offload`` / ``dispatch_model`` after packfree
prepared the model, ``packfree_plugin.apply`` on a model that already has them, and ``from_pretrained(...,
device_map="auto")``. Each runs packfree's entry together with the hooks: a packed row equals every sample alone
on the stock twin, which carries the same hooks (float64, Llama, Qwen3-Next, Mamba2)."""

from __future__ import annotations

import pytest
import torch

import packfree_plugin
from packfree_plugin.gate.audit import packed_row
from packfree_plugin.forward.hook import has_entry
from tests.conftest import assert_close
from tests.helpers import STOCK, fresh_pair, samples_of

accelerate = pytest.importorskip("accelerate")

MODEL_TYPES = ["llama", "qwen3_next", "mamba2"]
TOLERANCE = {"llama": 1e-9}
"""Logits; 1e-6 else: the stock scans of Qwen3-Next and Mamba2 compute in float32 inside."""
LENGTHS = [6, 1, 9]


def _cpu_offload(model: torch.nn.Module, _) -> None:
    accelerate.cpu_offload(model, execution_device="cpu")


def _dispatch(model: torch.nn.Module, _) -> None:
    accelerate.dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)


def _hooked(model: torch.nn.Module) -> bool:
    return hasattr(model, "_hf_hook")


def _assert_packed_row_equals_each_sample_alone(model: torch.nn.Module, stock: torch.nn.Module,
                                                model_type: str) -> None:
    samples = samples_of(LENGTHS)
    with torch.no_grad():
        logits = model(**packed_row([torch.tensor(s) for s in samples])).logits[0]
        for index, (piece, sample) in enumerate(zip(logits.split(LENGTHS), samples)):
            alone = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
            assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-6), rtol=0,
                         what=f"{model_type} sample {index}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("hook", [_cpu_offload, _dispatch], ids=["cpu_offload", "dispatch_model"])
@pytest.mark.parametrize("order", ["hooks after packfree", "packfree after hooks"])
def test_accelerate_hooks_run_with_packfree_entry(model_type: str, hook, order: str) -> None:
    model, stock = fresh_pair(model_type)
    if order == "packfree after hooks":  # a model loaded elsewhere, hooked, then prepared
        model.set_attn_implementation(STOCK.get(model_type, "sdpa"))
        assert not has_entry(model)
        hook(model, None)
        packfree_plugin.apply(model)
    else:
        hook(model, None)
    hook(stock, None)
    assert _hooked(model) and _hooked(stock) and has_entry(model)
    _assert_packed_row_equals_each_sample_alone(model, stock, model_type)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_from_pretrained_with_device_map_auto(model_type: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    _, stock = fresh_pair(model_type)
    stock.save_pretrained(tmp_path)
    load = dict(dtype=torch.float64, device_map="auto")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="packfree", **load).eval()
    twin = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=STOCK.get(model_type, "sdpa"),
                                                **load).eval()
    assert has_entry(model) and _hooked(model) == _hooked(twin)  # on a CPU-only machine: none (transformers 5.25)
    _assert_packed_row_equals_each_sample_alone(model, twin, model_type)
