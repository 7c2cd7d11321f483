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
    from packfree_plugin.gate.catalogue import CATALOGUE

    assert tiny_config_for("qwen3_next").layer_types == CATALOGUE["qwen3_next"].sized["layer_types"]


def _runs(config, class_name: str) -> torch.Tensor:
    """The tiny model of ``config`` built on stock, its output on 5 tokens: ``[1, 5, *]``."""
    import transformers

    from packfree_plugin.gate.proof import build_stock

    cls = getattr(transformers, class_name)
    if not isinstance(config, cls.config_class):
        config = config.get_text_config()
    model, _ = build_stock(cls, config)
    with torch.no_grad():
        output = model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), use_cache=False)
    return output.logits if getattr(output, "logits", None) is not None else output[0]


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("dbrx", "DbrxForCausalLM"),  # default attention config without rope_theta
    ("dots1", "Dots1ForCausalLM"),  # default without routed experts
    ("cohere_compass_text", "CohereCompassForCausalLM"),  # default rope parameters not keyed by layer type
    ("qwen4_exp", "Qwen4ExpForCausalLM"),  # text config without the indexer's budget: the catalogue's text entry
    ("emu3", "Emu3Model"),  # no vocabulary map of image tokens
])
def test_types_whose_default_config_stock_cannot_build_get_a_published_shape(model_type: str,
                                                                            class_name: str) -> None:
    assert _runs(tiny_config_for(model_type), class_name).shape[:2] == (1, 5)


@pytest.mark.model_types("dots3_note_text")
def test_per_layer_overrides_shrink_with_the_layers_head_dims_still_adding_up() -> None:
    """Dots3-Note's sliding layers override the MLA heads and dims (``per_layer_config``): shrunk like the global
    ones, the layer's head_dim is still qk_nope + qk_rope; the indexer keeps fewer keys than a test sample has."""
    tiny = tiny_config_for("dots3_note_text")
    assert {"sliding_attention", "indexed_attention"} <= set(tiny.layer_types)
    sliding = tiny.per_layer_config["sliding_attention"]
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim <= 64
    assert sliding.num_attention_heads == sliding.num_key_value_heads <= 4
    assert tiny.index_topk == WINDOW
    assert _runs(tiny, "Dots3NoteForCausalLM").shape[:2] == (1, 5)
    assert _runs(tiny_config_for("dots3_note"), "Dots3NoteForCausalLM").shape[:2] == (1, 5)  # adapters' widths


@pytest.mark.model_types("dory")
def test_stack_sections_keep_every_layer_kind_and_still_add_up() -> None:
    """Dory: input, recurrent and output sections (``n_*_layers``) that sum to the depth, serialized with an "mlp"
    block after every layer (``to_dict`` doubles them): each section keeps each layer kind, and the sections still
    sum to the kept layers."""
    full = AutoConfig.for_model("dory")
    tiny = shrink_config(full)
    sections = (tiny.n_input_layers, tiny.n_recurrent_layers, tiny.n_output_layers)
    assert sum(sections) == tiny.num_hidden_layers <= 6 and min(sections) >= 1
    starts = [0, tiny.n_input_layers, tiny.n_input_layers + tiny.n_recurrent_layers, tiny.num_hidden_layers]
    for start, end in zip(starts, starts[1:]):
        assert set(tiny.layer_types[start:end]) == set(full.layer_types)
    assert _runs(tiny, "DoryForCausalLM").shape[:2] == (1, 5)


def test_a_width_equal_to_a_hidden_size_of_the_config_becomes_the_tiny_hidden_size() -> None:
    """BLT's local decoder projects the global transformer's patches (``hidden_size_global``, the global hidden
    size): both shrink together."""
    tiny = tiny_config_for("blt")
    assert tiny.decoder_config.hidden_size_global == tiny.global_config.hidden_size <= 64
    assert tiny.encoder_hash_byte_group_vocab <= 1024  # hash embeddings: 6 x 500k x hidden before
    assert _runs(tiny, "BltForCausalLM").shape[:2] == (1, 5)


@pytest.mark.parametrize(("model_type", "class_name"), [("musicgen", "MusicgenForCausalLM"),
                                                        ("musicgen_melody", "MusicgenMelodyForCausalLM")])
def test_the_sweep_proves_a_composite_types_decoder_on_one_codebook(model_type: str, class_name: str) -> None:
    """MusicGen's config holds a text encoder and the decoder: the sweep takes the decoder, shrunk to one codebook
    so that a text-only row ``[1, T]`` is its input (``[B * codebooks, T]``); its positions are numbered per sample."""
    from tooling.sweep.run import Target, run_target

    assert tiny_config_for(model_type).decoder.num_codebooks == 1
    result = run_target(Target("causal", model_type, class_name))
    assert (result.status, result.config_type) == ("exact", f"{model_type}_decoder"), result.detail


def test_an_assistant_whose_every_layer_reads_shared_keys_and_values_shrinks() -> None:
    """Gemma 4's assistant reuses the target model's keys and values in all its layers
    (``num_kv_shared_layers == num_hidden_layers``): still all of the kept layers."""
    full = AutoConfig.for_model("gemma4_assistant", text_config=dict(hidden_size_per_layer_input=0,
                                                                      vocab_size_per_layer_input=0))
    tiny = shrink_config(full).text_config
    assert tiny.num_kv_shared_layers == tiny.num_hidden_layers < full.text_config.num_hidden_layers
    assert set(tiny.layer_types) == set(full.text_config.layer_types)


def test_reformer_builds_tiny_and_is_refused_at_load_naming_its_lsh_attention() -> None:
    """Reformer's axial position dims must add up to the hidden size, and its LM head wants a decoder config: the
    tiny model builds, and packfree refuses it at load (LSH buckets and sorts the whole row)."""
    import transformers

    from packfree_plugin.gate import bypassed

    tiny = tiny_config_for("reformer")
    assert sum(tiny.axial_pos_embds_dim) == tiny.hidden_size <= 64 and tiny.is_decoder
    assert _runs(tiny, "ReformerModelWithLMHead").shape[:2] == (1, 5)
    with bypassed(), pytest.raises(ValueError, match="LSHSelfAttention"):
        transformers.ReformerModelWithLMHead._from_config(tiny, attn_implementation="packfree")


def test_a_block_size_that_counts_positions_is_kept() -> None:
    """Bark's ``block_size`` is its position table (no ``max_position_embeddings`` beside it), not a chunk of
    block-wise attention as in BigBird or MiniMax (shrunk to the window)."""
    tiny = tiny_config_for("bark").semantic_config
    assert tiny.block_size >= 64 and tiny.hidden_size <= 64
    assert shrink_config(AutoConfig.for_model("big_bird")).block_size == WINDOW
    assert _runs(tiny, "BarkSemanticModel").shape[:2] == (1, 5)  # a table of 4 positions could not


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "glm5_next_text"])
def test_a_sparse_indexer_keeps_fewer_keys_than_a_test_sample_has(model_type: str) -> None:
    """DSA's top-k (2048 by default) shrinks to the window, so the proof's samples (5+ tokens) are longer than it
    and the indexer really selects; GLM-5-Next's key pools still divide it."""
    tiny = shrink_config(AutoConfig.for_model(model_type))
    assert tiny.index_topk == WINDOW
    assert tiny.index_topk % getattr(tiny, "index_kpool", 1) == 0


def test_a_layer_kinds_own_head_dim_stays_distinct_from_the_global_one() -> None:
    """Gemma 4's full-attention layers override the head dim (512 vs 256): shrunk, still larger than the global
    one, so the tiny model keeps both attention shapes."""
    tiny = shrink_config(AutoConfig.for_model("gemma4_text"))
    head_dims = {kind: tiny.per_layer_config[tiny.layer_types.index(kind)].head_dim for kind in set(tiny.layer_types)}
    assert head_dims["sliding_attention"] < head_dims["full_attention"] <= 64
