"""The tiny-config builder: any config shrinks to a small model that keeps every distinct layer kind."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from packfree_plugin.gate.shrink import TINY_VOCAB, WINDOW, shrink_config, tiny_config_for

HYBRID_DEFAULTS = ["gemma3_text", "qwen3_next", "llama4_text", "gpt_oss", "cohere2", "modernbert", "jamba",
                   "qwen2_moe", "deepseek_v3", "gemma2"]


def _is_index_list(name: str, value) -> bool:
    return "layer" in name and all(isinstance(i, int) for i in value) and list(value) == sorted(set(value))


def _per_layer_lists(config) -> dict[str, list]:
    """Lists with one entry per layer (``layer_types``, ...), not lists of layer indices (``moe_layers``)."""
    count = config.num_hidden_layers
    return {name: list(value) for name, value in config.to_dict().items()
            if isinstance(value, (list, tuple)) and len(value) == count and count > 1
            and not _is_index_list(name, value)}


@pytest.mark.parametrize("model_type", HYBRID_DEFAULTS)
def test_every_distinct_layer_kind_survives(model_type: str) -> None:
    """Each value of each per-layer list of the default config appears in the tiny one, which is small."""
    full = AutoConfig.for_model(model_type)
    tiny = shrink_config(full)
    assert type(tiny) is type(full)
    assert tiny.hidden_size <= 64 and tiny.vocab_size <= TINY_VOCAB and tiny.num_hidden_layers <= 6
    for name, values in _per_layer_lists(full).items():
        kept = getattr(tiny, name)
        assert len(kept) == tiny.num_hidden_layers, name
        assert {repr(v) for v in kept} == {repr(v) for v in values}, f"{model_type}.{name}: {kept} vs {set(values)}"


def test_periodic_patterns_and_windows_shrink_to_short_samples() -> None:
    tiny = shrink_config(AutoConfig.for_model("gemma3_text"))
    assert set(tiny.layer_types) == {"sliding_attention", "full_attention"}
    assert tiny.sliding_window == WINDOW
    modern = shrink_config(AutoConfig.for_model("modernbert"))
    assert modern.layer_types == ["full_attention", "sliding_attention"] and modern.local_attention == WINDOW


def test_a_users_large_config_shrinks_with_its_special_ids_inside_the_vocabulary() -> None:
    """A Llama-3-like config (128k vocabulary, bos 128000): the tiny copy builds, runs, and every special id fits."""
    user = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, bos_token_id=128000, eos_token_id=[128001, 128009],
                       pad_token_id=128004)
    tiny = shrink_config(user)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads) == (64, 4, 2)
    assert tiny.bos_token_id == 1 and tiny.pad_token_id == 0
    assert all(0 <= i < tiny.vocab_size for i in tiny.eos_token_id) and len(set(tiny.eos_token_id)) == 2
    model = AutoModelForCausalLM.from_config(tiny, attn_implementation="sdpa")
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert model(input_ids=torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, tiny.vocab_size)
    assert user.hidden_size == 4096  # the user's config is left as it was


@pytest.mark.parametrize(("model_type", "name", "indices"), [("qwen2_moe", "mlp_only_layers", [3, 6]),
                                                             ("llama4_text", "moe_layers", [1, 3, 5, 7])])
def test_layer_index_lists_follow_the_kept_layers(model_type: str, name: str, indices: list[int]) -> None:
    """A list of layer indices (dense layers among MoE ones, MoE among dense) keeps a layer in it and one out."""
    tiny = shrink_config(AutoConfig.for_model(model_type, num_hidden_layers=8, **{name: indices}))
    kept = getattr(tiny, name)
    assert kept and len(kept) < tiny.num_hidden_layers
    assert all(0 <= i < tiny.num_hidden_layers for i in kept)


def test_catalogue_types_use_their_hand_written_config() -> None:
    from packfree_plugin.catalogue import CATALOGUE

    assert tiny_config_for("qwen3_next").layer_types == CATALOGUE["qwen3_next"]["layer_types"]
