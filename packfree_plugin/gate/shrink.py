"""Shrink any transformers config to a tiny random model that keeps every distinct layer kind.

:func:`shrink_config` takes a config (a user's real one, or a model type's default) and returns a fresh
config of the same class with hidden size <= 64, a small vocabulary and as few layers as cover every
distinct per-layer setting (:mod:`packfree_plugin.gate.layer_kinds`). Periodic patterns
(``sliding_window_pattern``, ``global_attn_every_n_layers``, ...) are shortened to period 2; windows,
attention chunks, the chunks / blocks of chunked scans and a sparse indexer's top-k to 4 tokens, so that short
test samples still cross them. A layer's override dict (``per_layer_config``) shrinks with the global values; a
width equal to a hidden size of the config (an adapter's input) becomes the tiny hidden size. Sub-configs
(``text_config``, ``vision_config``, ``encoder``/``decoder``) are shrunk the same way. A config cut in depth after
creation is first cut to the layers its model builds (:func:`packfree_plugin.gate.config_values.serialized`).

The tiny copy keeps the ratios the config's validation and the model's construction need: key/value heads at
most the tiny query heads and dividing them, a width that is 2-4 times the hidden size (Zamba's attention input)
that multiple of the tiny one, and settings the config class derives from others (Zamba2's attention width and
``hybrid_layer_ids``) derived again. The other copies the gate proves on are in :mod:`packfree_plugin.gate.copies`.

:func:`tiny_config_for` gives the tiny config of a bare model type: its hand-written ``sized`` entry of
:data:`~packfree_plugin.gate.catalogue.CATALOGUE` where there is one, else the type's default config (with the entry's
``published`` values where stock cannot build the default) shrunk.
"""

from __future__ import annotations

from typing import Any

from .config_keys import (CHUNK_KEYS, EXPERT_KEYS, FFN_NAME, HEAD_DIM_KEYS, HEAD_KEYS, HIDDEN_KEYS, KEEP_DIMS,
                          KV_HEAD_KEYS, LARGE_DIM, OFFSET, PERIOD, SSM_HEADS, TOP_K_KEYS, TOPK_KEYS, WIDTH,
                          WINDOW_KEYS, is_sub_config)
from .config_values import rebuilt, refit, serialized, split_total
from .layer_kinds import cut_depth

__all__ = ["TINY_HIDDEN", "TINY_VOCAB", "WINDOW", "shrink_config", "tiny_config_for"]

TINY_VOCAB = 128
"""Vocabulary of a shrunk config; ids 0-2 are pad/bos/eos, the top 16 ids are kept for other special tokens."""
WINDOW = 4
"""Sliding window / attention chunk of a shrunk config, in tokens."""
TINY_HIDDEN = 64
"""Hidden size of a shrunk config, and the smallest a cut copy keeps."""
_HEADS = 4
_HEAD_DIM = 16
_FFN = 64
_MLA = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)
_STATE = 16
_HASH_BUCKETS = 1024


def _hidden_sizes(values: dict[str, Any]) -> set[int]:
    """The hidden sizes of a config dict and of its sub-configs, before shrinking."""
    sizes = {v for k, v in values.items() if k in HIDDEN_KEYS and isinstance(v, int) and v > TINY_HIDDEN}
    return sizes.union(*(_hidden_sizes(v) for v in values.values() if is_sub_config(v)))


def _shrink_values(values: dict[str, Any], hidden_sizes: set[int], repeats: int = 1) -> None:
    """Shrink one config's ``to_dict()`` in place (sub-config dicts recursively); ``hidden_sizes``: those of the
    whole config, before shrinking (a width equal to one, such as an adapter's input, becomes the tiny hidden)."""
    for value in values.values():
        if is_sub_config(value):
            _shrink_values(value, hidden_sizes, repeats)
    cut_depth(values, repeats)
    heads = next((values[k] for k in HEAD_KEYS if isinstance(values.get(k), int)), None)
    for name in HEAD_DIM_KEYS[:1] + ("num_key_value_heads",):  # a None default some models cannot build from
        if name in values and values[name] is None and heads is not None:
            values[name] = TINY_HIDDEN // _HEADS if name == "head_dim" else _HEADS
    if any(isinstance(values.get(k), int) for k in EXPERT_KEYS):  # experts but a None top-k default
        values.update({k: 2 for k in TOP_K_KEYS if k in values and values[k] is None})
    _shrink_scalars(values, heads, hidden_sizes, latent=False)
    for name, value in values.items():  # per-layer overrides ({"02": {"num_attention_heads": 64, ...}, ...})
        if "layer" in name and isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            for override in value.values():
                _shrink_scalars(override, heads, hidden_sizes, latent=True)
    if isinstance(values.get("rotary_dim"), int) and values["rotary_dim"] > _HEAD_DIM:
        values["rotary_dim"] = _HEAD_DIM
    for heads, dim, expand in SSM_HEADS:  # Mamba2 heads: heads * head_dim == hidden * expand
        if all(isinstance(values.get(k), int) for k in (heads, dim, expand, "hidden_size")):
            values[heads] = values["hidden_size"] * values[expand] // values[dim]
    if all(isinstance(values.get(k), int) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        values["mamba_d_ssm"] = values["mamba_n_heads"] * values["mamba_d_head"]  # Falcon-H1's SSM width
    if all(isinstance(values.get(k), int) for k in ("index_num_heads", "num_attention_heads", "num_key_value_heads")):
        # Kolibri-1.1's indexer scores keys with the leading query heads of key head 0: at most those
        per_key_head = max(1, values["num_attention_heads"] // values["num_key_value_heads"])
        values["index_num_heads"] = min(values["index_num_heads"], per_key_head)
    for name in WINDOW_KEYS:  # per-layer windows (e.g. longformer's attention_window)
        value = values.get(name)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            values[name] = [min(v, WINDOW) for v in value]
    refit(values, TINY_VOCAB)


def _shrink_scalars(values: dict[str, Any], heads: int | None, hidden_sizes: set[int], *, latent: bool) -> None:
    """Shrink the sizes of one config dict in place, or one layer's override dict (``latent``: an MLA dimension it
    overrides takes the tiny MLA value, so per-layer head dims still add up; a head dim of its own becomes twice the
    tiny one, so it still differs from the global one); ``heads``: the config's attention heads (None without
    attention), unless ``values`` sets its own."""
    heads = next((values[k] for k in HEAD_KEYS if isinstance(values.get(k), int)), heads)
    hidden = next((values[k] for k in HIDDEN_KEYS if isinstance(values.get(k), int)), None)
    rope = values.get("qk_rope_head_dim")
    if latent:
        values.update({k: v for k, v in _MLA.items() if isinstance(values.get(k), int) and values[k] > v})
    elif isinstance(rope, int) and rope > _MLA["qk_rope_head_dim"]:  # multi-head latent attention: small ranks
        if values.get("head_dim") == rope:  # DeepSeek-V2/V3: head_dim is the rotary part
            values["head_dim"] = _MLA["qk_rope_head_dim"]
        values.update({k: v for k, v in _MLA.items() if isinstance(values.get(k), int)})
        if "qk_head_dim" in values:
            values["qk_head_dim"] = _MLA["qk_rope_head_dim"] + _MLA["qk_nope_head_dim"]
    for name, value in list(values.items()):
        if "dim" in name and isinstance(value, list) and sum(value) in hidden_sizes and len(value) > 1:
            values[name] = split_total(TINY_HIDDEN, value)  # parts of the hidden size (Reformer's axial position dims)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if (name in HIDDEN_KEYS or name == "pooler_hidden_size") and value > TINY_HIDDEN:
            values[name] = TINY_HIDDEN
        elif name in HEAD_KEYS and value > _HEADS:
            values[name] = _HEADS
        elif name in KV_HEAD_KEYS and value > 1:
            values[name] = _kv_heads(value, heads)
        elif name in HEAD_DIM_KEYS and value > _HEAD_DIM * (2 if latent else 1):
            values[name] = _HEAD_DIM * (2 if latent else 1)  # a layer's own head dim stays its own
        elif name == "num_codebooks" and value > 1:  # one token stream, as a text-only row (MusicGen)
            values[name] = 1
        elif name in EXPERT_KEYS and value > 4:
            values[name] = 4
        elif name in TOP_K_KEYS and value > 2:
            values[name] = 2
        elif name in ("n_shared_experts", "num_shared_experts") and value > 1:
            values[name] = 1
        elif name in ("n_group", "num_expert_group", "topk_group", "n_groups_routed"):
            values[name] = 1
        elif name == "index_kpool" and value > 2:
            values[name] = 2
        elif name == "block_size" and "max_position_embeddings" not in values:
            continue  # nanoGPT-style: the number of positions
        elif (name in WINDOW_KEYS or name in CHUNK_KEYS or name in TOPK_KEYS) and value > WINDOW:
            values[name] = WINDOW
        elif name.endswith(("d_state", "state_size")) and value > _STATE:
            values[name] = _STATE
        elif name == "vocab_size" and value > TINY_VOCAB:
            values[name] = TINY_VOCAB
        elif "hash" in name and "vocab" in name and value > _HASH_BUCKETS:  # a hash embedding's table (BLT)
            values[name] = _HASH_BUCKETS
        elif PERIOD.search(name) and value > 2 and "head" not in name:
            values[name] = 2
        elif OFFSET.search(name) and value > 1:
            values[name] = 1
        elif FFN_NAME.search(name) and value > _FFN:
            values[name] = _FFN
        elif value in hidden_sizes and WIDTH.search(name) and not KEEP_DIMS.search(name):
            values[name] = TINY_HIDDEN
        elif (isinstance(hidden, int) and hidden > TINY_HIDDEN and value % hidden == 0 and 1 < value // hidden <= 4
              and WIDTH.search(name) and not KEEP_DIMS.search(name)):
            values[name] = value // hidden * TINY_HIDDEN  # a multiple of the hidden size (Zamba's attention input)
        elif LARGE_DIM.search(name) and not KEEP_DIMS.search(name) and value > TINY_HIDDEN:
            values[name] = _HEAD_DIM * 2


def _kv_heads(kv_heads: int, heads: int | None) -> int:
    """The tiny key/value head count for ``kv_heads`` of ``heads`` query heads (None: not known): never more than the
    tiny query heads and dividing them; as many as they are when the config has one key/value head per query head."""
    tiny_heads = min(heads, _HEADS) if heads is not None else _HEADS
    if heads is not None and kv_heads >= heads:
        return tiny_heads
    return max((d for d in range(1, tiny_heads) if tiny_heads % d == 0 and d <= kv_heads), default=1)


def shrink_config(config, *, repeats: int = 1):
    """A fresh tiny config of ``config``'s class that keeps each of its distinct layer kinds (see the module doc),
    each ``repeats`` times where the config has it that often (layers that share weights across positions need
    a second one: Zamba ties every shared block to the first)."""
    values = serialized(config)
    _shrink_values(values, _hidden_sizes(values), repeats)
    return rebuilt(config, values)


def tiny_config_for(model_type: str):
    """The tiny config of a bare model type: its catalogue entry, else its default config shrunk."""
    from transformers import AutoConfig

    from .catalogue import catalogue_config, published_values, sized_types

    sized = sized_types()
    if model_type in sized:
        return catalogue_config(model_type)
    config = shrink_config(AutoConfig.for_model(model_type, **published_values(model_type)))
    for name, sub in vars(config).items():  # a composite type's text model that has a sized entry uses it
        if isinstance(getattr(sub, "model_type", None), str) and sub.model_type in sized:
            setattr(config, name, catalogue_config(sub.model_type))
    return config
