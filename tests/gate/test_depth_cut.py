"""A config cut in depth after creation (``config.num_hidden_layers = 2`` on a 32-layer config, ``layer_types`` still
32 long) builds and runs on stock transformers: the gate proves it on copies that build too, and the loaded model is
exact on a packed row."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from packfree_plugin.gate import admission
from packfree_plugin.gate.copies import proof_configs

LENGTHS = (6, 9, 5)
"""Packed sample lengths, each longer than the sliding window (4 tokens)."""


def _cut_config(model_type: str, **settings: Any):
    """A small 32-layer config of ``model_type``, then cut to 2 layers the usual way (its per-layer lists untouched)."""
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=128, num_hidden_layers=32,
                                  **settings)
    config.num_hidden_layers = 2
    assert len(config.layer_types) == 32
    return config


CASES = {
    "qwen2": lambda: _cut_config("qwen2"),
    "qwen3": lambda: _cut_config("qwen3"),
    "qwen2-sliding": lambda: _cut_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
}
"""Depth-cut configs; the sliding one keeps a full and a sliding layer in its first two."""


@pytest.fixture
def proved(fresh_verdicts, monkeypatch) -> list[Any]:
    """Every proof the gate runs, with no class verified (the gate cannot skip the proof via ``verified.json``)."""
    proofs: list[Any] = []
    original = admission.prove_copy

    def recording(cls: type, config):
        proofs.append(original(cls, config))
        return proofs[-1]

    monkeypatch.setattr(admission, "is_verified", lambda model: False)
    monkeypatch.setattr(admission, "prove_copy", recording)
    return proofs


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_copy_of_a_depth_cut_config_builds(case: str) -> None:
    """Each copy the gate may prove on keeps as many per-layer entries as layers (the first layers' kinds)."""
    config = CASES[case]()
    for _, make_config in proof_configs(config):
        copy = make_config()
        assert len(copy.layer_types) == copy.num_hidden_layers
        assert set(copy.layer_types) == set(config.layer_types[:2])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_depth_cut_config_loads_proved_and_exact(case: str, proved: list[Any]) -> None:
    """Stock builds and runs the cut config; packfree loads it after proving it (not verified), and a packed row
    of three samples equals each sample alone on the stock sdpa twin with the same weights (float64)."""
    config = CASES[case]()  # each model its own config: loading sets the config's attention implementation
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.float64).eval()
    stock = AutoModelForCausalLM.from_config(CASES[case](), attn_implementation="sdpa", dtype=torch.float64).eval()
    assert len(proved) == 1 and proved[0].exact, proved
    assert len(model.model.layers) == 2
    model.load_state_dict(stock.state_dict())

    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, config.vocab_size, (n,), generator=generator) for n in LENGTHS]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(samples)[None], position_ids=position_ids).logits[0]
        alone = [stock(input_ids=sample[None]).logits[0] for sample in samples]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-10, rtol=1e-10)
