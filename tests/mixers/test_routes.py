"""The native tier: transformers' kernel functions routed to packfree's boundary-aware ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import packfree_plugin
from packfree_plugin.mixers import entry as mixers
from packfree_plugin.mixers import registry  # noqa: F401 - mixers fills the adapters first
from packfree_plugin.classes import CLASSES
from packfree_plugin.mixers.seam import native_forward
from tests.mixers.test_generic import TINY_HYBRIDS
from tests.conftest import assert_close

NATIVE_CASES = {  # model type: (mixer class, tiny config)
    "qwen3_next": ("Qwen3NextGatedDeltaNet", TINY_HYBRIDS["qwen3_next"]),
    "mamba2": ("Mamba2Mixer", TINY_HYBRIDS["mamba2"]),
    "lfm2": ("Lfm2ShortConv", TINY_HYBRIDS["lfm2"]),
    "mamba": ("MambaMixer", dict(hidden_size=64, num_hidden_layers=2, state_size=8, vocab_size=128, expand=2)),
}


def _model(model_type: str, monkeypatch, *, native: bool):
    packfree_plugin.register()
    mixer, config = NATIVE_CASES[model_type]
    family = CLASSES[mixer].mixer
    adapter = dataclasses.replace(registry.ADAPTERS[family], native=native_forward if native else None)
    monkeypatch.setitem(registry.ADAPTERS, family, adapter)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), attn_implementation="packfree",
                                            dtype=torch.float64, experts_implementation="eager")


@pytest.mark.parametrize("model_type", list(NATIVE_CASES))
def test_native_routes_equal_each_sample_alone_and_the_generic_tier(model_type: str, monkeypatch) -> None:
    lengths = [5, 1, 9, 4]
    ids = torch.randint(3, 128, (2, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    native = _model(model_type, monkeypatch, native=True).eval()
    with torch.no_grad():
        packed = native(input_ids=ids, position_ids=positions).logits
        generic = _model(model_type, monkeypatch, native=False).eval()(input_ids=ids, position_ids=positions).logits
        for row in range(2):
            for piece, sample in zip(packed[row].split(lengths), ids[row].split(lengths)):
                alone = native(input_ids=sample[None], use_cache=False).logits[0]
                assert_close(piece, alone, atol=1e-5, rtol=0, what=f"{model_type} native vs alone")
    assert_close(packed, generic, atol=1e-5, rtol=0, what=f"{model_type} native vs generic")


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_native_gradients_are_isolated(model_type: str, monkeypatch) -> None:
    model = _model(model_type, monkeypatch, native=True).train()
    lengths = [6, 3, 7]
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, position_ids=positions).logits[0]
    logits[6:9].square().sum().backward()
    assert torch.count_nonzero(embeds.grad[0, :6]) == 0 and torch.count_nonzero(embeds.grad[0, 9:]) == 0
    assert torch.count_nonzero(embeds.grad[0, 6:9]) > 0


def test_routes_are_transparent_outside_packfree(monkeypatch) -> None:
    """A stock model in the same process, once routes are installed, computes exactly as before."""
    packed_model = _model("lfm2", monkeypatch, native=True)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model("lfm2", **TINY_HYBRIDS["lfm2"]), dtype=torch.float64)
    stock.load_state_dict(packed_model.state_dict())
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed_model(input_ids=ids, position_ids=torch.tensor([list(range(6)) * 2]))  # installs the routes
        from packfree_plugin.mixers.seam import uninstall_routes

        routed = stock(input_ids=ids, use_cache=False).logits
        uninstall_routes()
        plain = stock(input_ids=ids, use_cache=False).logits
    assert torch.equal(routed, plain)


def test_layer_that_routes_nothing_is_refused(monkeypatch) -> None:
    from packfree_plugin.boundaries import Boundaries

    class PlainMixer(torch.nn.Module):
        def forward(self, hidden_states):
            return hidden_states.cumsum(1)

    boundaries = Boundaries.from_position_ids(torch.tensor([[0, 1, 0, 1]]))
    layer = PlainMixer()
    with pytest.raises(ValueError, match="generic tier"):
        native_forward(layer, layer.forward, boundaries, {"hidden_states": torch.zeros(1, 4, 2)})
