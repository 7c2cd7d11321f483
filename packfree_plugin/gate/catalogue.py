"""The one table of tiny configs, one :class:`Tiny` entry per model type, in three kinds of values:

- ``scalable``: settings under the caller's width, depth and vocabulary (:func:`packfree_plugin.cli.tiny.tiny_config`
  sets those); the demo and the representative families (plain attention, Gated DeltaNet, Mamba2, short conv);
- ``sized``: a whole tiny config (hidden <= 64, vocabulary 128, every layer kind of the model) for each hybrid /
  recurrent model type packfree covers; the model tests run each of them, ``packfree verify`` / ``doctor`` use them
  for a bare model type (:func:`catalogue_config`);
- ``published``: values the type's published checkpoints set and its default config lacks or gets wrong, so that
  stock cannot build a model from the default; given at full size, before
  :func:`packfree_plugin.gate.shrink.shrink_config` shrinks it.

A model type without an entry gets its default config shrunk. Imports neither torch nor transformers at load."""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Any

__all__ = ["CATALOGUE", "Tiny", "catalogue_config", "published_values", "scalable_values", "sized_types"]


@dataclass(frozen=True)
class Tiny:
    """What packfree knows about building a tiny model of one model type (see the module doc for the three kinds)."""

    scalable: dict[str, Any] | None = None
    sized: dict[str, Any] | None = None
    published: dict[str, Any] | None = None


_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_BASE = dict(hidden_size=64, vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_SCALABLE_GDN = dict(_ATTN, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                     linear_value_head_dim=16, intermediate_size=96, layer_types=["linear_attention", "full_attention"])

CATALOGUE: dict[str, Tiny] = {
    # ---------------------------------------------------------------- plain attention
    "llama": Tiny(scalable=dict(_ATTN, intermediate_size=96)),
# ---------------------------------------------------------------- Gated DeltaNet
    "qwen3_next": Tiny(
        scalable=dict(_SCALABLE_GDN, num_experts=0, mlp_only_layers=[0, 1]),
        sized=dict(**_BASE, **_ATTN, **_GDN, **_MOE, num_hidden_layers=2, intermediate_size=64,
                   layer_types=["linear_attention", "full_attention"])),
    "qwen3_5_text": Tiny(
        scalable=_SCALABLE_GDN,
        sized=dict(**_BASE, **_ATTN, **_GDN, num_hidden_layers=2, intermediate_size=64,
                   layer_types=["linear_attention", "full_attention"])),
    "qwen3_5_moe_text": Tiny(
        sized=dict(**_BASE, **_ATTN, **_GDN, **_MOE, num_hidden_layers=2,
                   layer_types=["linear_attention", "full_attention"])),
    "qwen4_exp_text": Tiny(
        sized=dict(**_BASE, **_ATTN, **_GDN, **_MOE, num_hidden_layers=3,
                   layer_types=["linear_attention", "linear_attention", "indexed_attention"], hc_count=2, hc_lowrank=8,
                   ple_layer_ids=[2], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3,
                   heads_per_ngram=2, ngram_vocab_size_base=512, make_ngram_vocab_size_divisible_by=8,
                   split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                   indexer_budget=4, indexer_compress_ratio=2)),
    "olmo_hybrid": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=2, **_GDN, num_hidden_layers=2,
                   intermediate_size=64, layer_types=["linear_attention", "full_attention"])),
    "lara_mini": Tiny(
        sized=dict(**_BASE, **_ATTN, **_GDN, **_MOE, num_hidden_layers=3, sliding_window=4,
                   layer_types=["linear_attention", "sliding_attention", "full_attention"])),
    # ---------------------------------------------------------------- KDA
    "kimi_linear": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                   intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   linear_head_dim=16, linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse"])),
    "bailing_hybrid": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                   intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
                   num_expert_group=1, topk_group=1, first_k_dense_replace=1, head_dim=16,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   linear_head_dim=16, linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                   mlp_layer_types=["dense", "sparse"], num_nextn_predict_layers=0)),
    "glm5_next_text": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                   intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, index_topk=4,
                   index_head_dim=16, index_n_heads=2, linear_head_dim=16, linear_num_heads=4, hc_mult=2,
                   index_kpool=2, layer_types=["linear_attention", "indexed_attention"],
                   mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])),
    # ---------------------------------------------------------------- Mamba2 / SSD
    "mamba2": Tiny(
        scalable=dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=8, expand=2),
        sized=dict(**_BASE, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                   chunk_size=8, expand=2)),
    "bamba": Tiny(
        sized=dict(**_BASE, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
                   intermediate_size=64, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                   mamba_d_state=16, mamba_chunk_size=8)),
    "falcon_h1": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=8,
                   mamba_d_head=8, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8)),
    "granitemoehybrid": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                   intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                   shared_intermediate_size=32, layer_types=["mamba", "attention"], mamba_n_heads=8,
                   mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=8)),
    "nemotron_h": Tiny(
        sized=dict(**_BASE, **_ATTN, layers_block_type=["mamba", "moe", "attention", "mlp"],
                   intermediate_size=64, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                   chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   moe_shared_expert_intermediate_size=32)),
    "zamba2": Tiny(
        sized=dict(**_BASE, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=16,
                   n_mamba_heads=4, mamba_headdim=32, chunk_size=8, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=64, attention_head_dim=32)),
    # ---------------------------------------------------------------- Mamba1
    "mamba": Tiny(
        sized=dict(**_BASE, num_hidden_layers=2, state_size=8, time_step_rank=8, intermediate_size=128)),
    "falcon_mamba": Tiny(
        sized=dict(**_BASE, num_hidden_layers=2, state_size=8, time_step_rank=8, intermediate_size=128)),
    "jamba": Tiny(
        sized=dict(**_BASE, **{k: v for k, v in _ATTN.items() if k != "head_dim"}, num_hidden_layers=2,
                   intermediate_size=64, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                   expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                   mamba_dt_rank=8, use_mamba_kernels=False)),
    "zamba": Tiny(
        sized=dict(**_BASE, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                   attention_hidden_size=128, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=4, attention_head_dim=32, n_mamba_heads=2,
                   attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8,
                   use_mamba_kernels=False)),
    # ---------------------------------------------------------------- short / causal conv
    "lfm2": Tiny(
        scalable=dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      layer_types=["conv", "full_attention"]),
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
                   layer_types=["conv", "full_attention"])),
    "lfm2_moe": Tiny(
        sized=dict(**_BASE, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                   intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                   num_dense_layers=1, layer_types=["conv", "full_attention", "conv"])),
    "lfm3": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=3, intermediate_size=64, sliding_window=4,
                   layer_types=["conv", "full_attention", "sliding_attention"])),
    "inkling_text": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                   swa_head_dim=16, sliding_window_size=4, d_rel=4, rel_extent=16,
                   layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
                   intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1)),
    "inkling2_text": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, swa_num_attention_heads=4,
                   swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, d_rel=4, rel_extent=16,
                   layer_types=["hybrid_sliding", "hybrid"], moe_intermediate_size=32, n_routed_experts=4,
                   num_experts_per_tok=2, n_layers_per_attn_res_block=1, unpadded_vocab_size=128)),
    "inkling2_loop_text": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=3, swa_num_attention_heads=4,
                   swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=4, d_rel=4,
                   rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                   moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_layers_per_attn_res_block=1, unpadded_vocab_size=128, loop_layer_index_start=1,
                   loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4)),
    "zaya": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, moe_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=1, layer_types=["hybrid", "hybrid_sliding"], sliding_window=4,
                   router_hidden_size=16)),
    # ---------------------------------------------------------------- other
    "minimax": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, intermediate_size=64, num_local_experts=4,
                   num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], block_size=4)),
    "rwkv": Tiny(
        sized=dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                   intermediate_size=128, context_length=64, bos_token_id=1, eos_token_id=2)),
    "recurrent_gemma": Tiny(
        sized=dict(**_BASE, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=16, lru_width=64, attention_window_size=8,
                   block_types=["recurrent", "attention", "recurrent"])),
    "xlstm": Tiny(
        sized=dict(vocab_size=128, hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_blocks=2, num_heads=4,
                   chunk_size=4, mode="inference", autocast_kernel_dtype="float32",
                   inference_state_dtype="float32", pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "deepseek_v4": Tiny(
        sized=dict(**_BASE, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                   q_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   qk_rope_head_dim=8, hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=2,
                   index_head_dim=16, index_topk=4, sliding_window=4, num_nextn_predict_layers=0,
                   compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                   layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                   "sliding_attention"],
                   mlp_layer_types=["hash_moe", "moe", "moe"])),
    "minimax_m3_vl_text": Tiny(
        sized=dict(**_BASE, **_ATTN, num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                   num_experts_per_tok=2, dense_intermediate_size=64, shared_intermediate_size=32,
                   rotary_dim=8, index_n_heads=2, index_head_dim=16, index_block_size=2,
                   index_topk_blocks=2, index_local_blocks=1, mlp_layer_types=["dense", "sparse"],
                   layer_types=["full_attention", "minimax_m3_sparse"])),
    # ---------------------------------------------------------------- published values (stock's default cannot build)
    "dbrx": Tiny(published=dict(attn_config=dict(clip_qkv=8, kv_n_heads=8, rope_theta=500000))),  # no default theta
    "dots1": Tiny(published=dict(n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=2,
                                 first_k_dense_replace=1)),
    "emu3": Tiny(published=dict(vocabulary_map={"<image>": 120, "<|extra_200|>": 121, "<|visual token 000000|>": 122,
                                                "<|visual token 000001|>": 123})),  # BPE ids of VQ codes, tiny top ids
    "esm": Tiny(published=dict(vocab_size=33, pad_token_id=1, mask_token_id=32, position_embedding_type="rotary",
                               token_dropout=True, emb_layer_norm_before=False)),  # facebook/esm2_t6_8M_UR50D
    "reformer": Tiny(published=dict(is_decoder=True)),  # its causal-LM head asserts it (reformer-crime-and-punishment)
    "gemma4_assistant": Tiny(published=dict(text_config=dict(hidden_size_per_layer_input=0,
                                                             vocab_size_per_layer_input=0))),
    "cohere_compass_text": Tiny(published=dict(
        layer_types=["sliding_attention"] * 3 + ["full_attention"], num_hidden_layers=4,  # NoPE full layers
        rope_parameters=dict(  # mrope_section: stock's default, fitted to the tiny heads like any other
            sliding_attention=dict(rope_type="default", rope_theta=50000.0, mrope_section=[24, 20, 20]),
            full_attention=None))),
}
"""Model type -> :class:`Tiny`. A ``sized`` entry has every layer kind of the model at least once."""


def catalogue_config(model_type: str, **overrides: Any):
    """A fresh tiny config for ``model_type`` (never shared: loading sets its attention implementation).

    ``num_hidden_layers`` in ``overrides`` tiles the entry's per-layer lists (``layer_types``, ...) to that depth.
    """
    from transformers import AutoConfig

    entry = deepcopy(CATALOGUE[model_type].sized or {})
    if not entry:
        raise KeyError(f"{model_type!r} has no sized tiny config; sized_types() lists those that do")
    layers = overrides.get("num_hidden_layers")
    if layers is not None and layers != entry.get("num_hidden_layers"):
        if "num_hidden_layers" not in entry:
            raise ValueError(f"the {model_type} catalogue entry fixes its layer pattern; "
                             "num_hidden_layers cannot change")
        count = entry["num_hidden_layers"]
        for key, value in entry.items():
            if isinstance(value, list) and len(value) == count:
                entry[key] = [value[i % count] for i in range(layers)]
    return AutoConfig.for_model(model_type, **{**entry, **overrides})


def sized_types() -> list[str]:
    """The model types with a whole tiny config (``sized``), in table order."""
    return [model_type for model_type, entry in CATALOGUE.items() if entry.sized is not None]


def scalable_values(model_type: str) -> dict[str, Any] | None:
    """A copy of ``model_type``'s settings under the caller's width, depth and vocabulary, or None."""
    entry = CATALOGUE.get(model_type)
    return None if entry is None or entry.scalable is None else deepcopy(entry.scalable)


def published_values(model_type: str) -> dict[str, Any]:
    """A copy of the full-size values ``model_type``'s default config needs before shrinking (empty when none)."""
    entry = CATALOGUE.get(model_type)
    return deepcopy(entry.published or {}) if entry is not None else {}
