"""How transformers configs spell their settings: the names under which each kind of setting appears (hidden
size, layer count, heads, experts, windows, ...), the name patterns of widths and of settings to keep, and what a
config dict's value is (a sub-config, a list of layer indices). Data and pure predicates, read by the shrinker
(:mod:`packfree_plugin.gate.shrink`), the cut copies (:mod:`packfree_plugin.gate.copies`) and the sweep."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["CHUNK_KEYS", "EXPERT_KEYS", "FFN_NAME", "HEAD_DIM_KEYS", "HEAD_KEYS", "HIDDEN_KEYS", "KEEP_DIMS",
           "KV_HEAD_KEYS", "LARGE_DIM", "LAYER_KEYS", "OFFSET", "PERIOD", "SECTION", "SPECIAL_IDS", "SSM_HEADS",
           "TOPK_KEYS", "TOP_K_KEYS", "WIDTH", "WINDOW_KEYS", "is_index_list", "is_sub_config", "is_width"]

HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "embedding_size",
               "word_embed_proj_dim", "hidden_dim", "emb_dim")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "depth")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
             "n_heads", "num_decoder_attention_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
                "num_kv_heads_per_layer", "kv_n_heads")
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels", "d_kv", "attention_head_size", "d_head")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
               "n_experts", "num_moe_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "num_selected_experts",
              "moe_k", "router_top_k")
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "local_attention",
               "attention_window", "window_size", "swa_window_size", "local_attention_window_len")
CHUNK_KEYS = ("chunk_size", "mamba_chunk_size", "block_size")
"""Chunks of chunked scans / block-wise attention: shrunk like windows, so samples span several chunks. (A
``block_size`` in a config without ``max_position_embeddings`` is its position table, as in Bark: kept.)"""
TOPK_KEYS = ("index_topk",)
"""Keys a sparse-attention indexer keeps per query: shrunk like windows, so that a sample has more keys than that
(and its key pools, ``index_kpool``, to 2 keys, which divides it)."""
SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
             ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
SPECIAL_IDS = re.compile(r"(_token_id|_token_index|_id)$")
PERIOD = re.compile(r"(period|interval|_pattern|every_n|_step$)")
OFFSET = re.compile(r"(offset|first_k_dense_replace|num_dense_layers|first_dense)")
FFN_NAME = re.compile(r"(intermediate|ffn|d_ff$|n_inner$|mlp_dim|ff_dim|hidden_dim_ff)")
LARGE_DIM = re.compile(r"(_dim$|_size$|_rank$|_channels$|_width$)")
SECTION = re.compile(r"n(um)?_(?!hidden_)\w+_layers")
WIDTH = re.compile(r"(size|dim)")
KEEP_DIMS = re.compile(r"(vocab|position|max_|window|chunk|block|patch|image|kernel|buckets|bucket|conv|"
                       r"seq_len|length|context|num_)")


def is_width(name: str) -> bool:
    """Whether a config setting named ``name`` is a width (hidden, head, feed-forward, projection rank)."""
    return (name in HIDDEN_KEYS or name in HEAD_DIM_KEYS or bool(FFN_NAME.search(name))
            or ((bool(LARGE_DIM.search(name)) or bool(WIDTH.search(name))) and not KEEP_DIMS.search(name)))


def is_sub_config(value: Any) -> bool:
    """Whether a value of a config dict is a nested config dict."""
    return isinstance(value, dict) and ("model_type" in value or any(k in value for k in HIDDEN_KEYS))


def is_index_list(value: Any) -> bool:
    """Whether ``value`` is a list of layer indices (``mlp_only_layers``): non-negative ints, strictly increasing."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
            and all(a < b for a, b in zip(value, value[1:])))
