"""Shrink any transformers config to a tiny random model that keeps every distinct layer kind.

:func:`shrink_config` takes a config (a user's real one, or a model type's default) and returns a fresh
config of the same class with hidden size <= 64, a small vocabulary and as few layers as cover every
distinct per-layer setting: the layers kept are chosen so that each value of each per-layer list
(``layer_types``, ``mlp_layer_types``, ``layers_block_type``, ...) and each membership of a layer-index list
(``attn_layer_indices``, ``mlp_only_layers``, ...) appears at least once. Periodic patterns
(``sliding_window_pattern``, ``global_attn_every_n_layers``, ...) are shortened to period 2; windows,
attention chunks, the chunks / blocks of chunked scans and a sparse indexer's top-k to 4 tokens, so that short
test samples still cross them. Stack sections (``n_input_layers`` / ``n_recurrent_layers`` / ``n_output_layers``)
keep every layer kind each and still add up; a layer's override dict (``per_layer_config``) shrinks with the global
values; a width equal to a hidden size of the config (an adapter's input) becomes the tiny hidden size. Sub-configs
(``text_config``, ``vision_config``, ``encoder``/``decoder``) are shrunk the same way. A config cut in depth after
creation (``config.num_hidden_layers = 2``, its ``layer_types`` still at the old depth) has its per-layer lists cut
to the layers its model builds first (:func:`_trim_to_depth`), as stock reads them, so that its copies validate.

The tiny copy keeps the ratios the config's validation and the model's construction need: key/value heads at
most the tiny query heads and dividing them, a width that is 2-4 times the hidden size (Zamba's attention input)
that multiple of the tiny one, and settings the config class derives from others (Zamba2's attention width and
``hybrid_layer_ids``) derived again. :func:`proof_configs` lists what the gate proves on, best first: the tiny copy,
the tiny copy with each layer kind twice (weights tied across layers of a kind), then :func:`cut_config`: the
user's config cut in depth and with every width divided by one power of two (:func:`cut_factors`).

:func:`tiny_config_for` gives the tiny config of a bare model type: its hand-written ``sized`` entry of
:data:`~packfree_plugin.gate.catalogue.CATALOGUE` where there is one, else the type's default config (with the entry's
``published`` values where stock cannot build the default) shrunk.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["TINY_VOCAB", "WINDOW", "cut_config", "cut_factors", "proof_configs", "shrink_config", "tiny_config_for"]

TINY_VOCAB = 128
"""Vocabulary of a shrunk config; ids 0-2 are pad/bos/eos, the top 16 ids are kept for other special tokens."""
WINDOW = 4
"""Sliding window / attention chunk of a shrunk config, in tokens."""
_HIDDEN = 64
_HEADS = 4
_HEAD_DIM = 16
_FFN = 64
_MAX_LAYERS = 6

_MLA = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)
_CHUNK_KEYS = ("chunk_size", "mamba_chunk_size", "block_size")
"""Chunks of chunked scans / block-wise attention: shrunk like windows, so samples span several chunks. (A
``block_size`` in a config without ``max_position_embeddings`` is its position table, as in Bark: kept.)"""
_TOPK_KEYS = ("index_topk",)
"""Keys a sparse-attention indexer keeps per query: shrunk like windows, so that a sample has more keys than that
(and its key pools, ``index_kpool``, to 2 keys, which divides it)."""
_STATE = 16
_HASH_BUCKETS = 1024
_SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
              ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim", "embedding_size",
                "word_embed_proj_dim", "hidden_dim", "emb_dim")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers", "depth")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
              "n_heads", "num_decoder_attention_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv",
                 "num_kv_heads_per_layer", "kv_n_heads")
_HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels", "d_kv", "attention_head_size", "d_head")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                "n_experts", "num_moe_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "num_selected_experts",
               "moe_k", "router_top_k")
_WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "local_attention",
                "attention_window", "window_size", "swa_window_size", "local_attention_window_len")
_SPECIAL_IDS = re.compile(r"(_token_id|_token_index|_id)$")
_PERIOD = re.compile(r"(period|interval|_pattern|every_n|_step$)")
_OFFSET = re.compile(r"(offset|first_k_dense_replace|num_dense_layers|first_dense)")
_FFN_NAME = re.compile(r"(intermediate|ffn|d_ff$|n_inner$|mlp_dim|ff_dim|hidden_dim_ff)")
_LARGE_DIM = re.compile(r"(_dim$|_size$|_rank$|_channels$|_width$)")
_SECTION = re.compile(r"n(um)?_(?!hidden_)\w+_layers")
_WIDTH = re.compile(r"(size|dim)")
_KEEP_DIMS = re.compile(r"(vocab|position|max_|window|chunk|block|patch|image|kernel|buckets|bucket|conv|"
                        r"seq_len|length|context|num_)")


def _shrink_layers(values: dict[str, Any], count: int, repeats: int = 1) -> int:
    """Keep as few of ``count`` layers as cover every per-layer setting ``repeats`` times (where the config has
    it that often); rewrite each per-layer list, layer-index list and layer-keyed dict of ``values`` accordingly;
    return how many layers are kept."""
    index_lists = {name: value for name, value in values.items()
                   if "layer" in name and isinstance(value, (list, tuple)) and value
                   and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in value)
                   and list(value) == sorted(set(value))}
    per_layer = {name: value for name, value in values.items()
                 if isinstance(value, (list, tuple)) and len(value) == count and count > 1
                 and name not in index_lists and name != "architectures"}
    keyed = {name: value for name, value in values.items()
             if "layer" in name and isinstance(value, dict) and value
             and all(str(k).isdigit() and int(k) < count for k in value)}
    shared = values.get("num_kv_shared_layers")  # the last layers reuse an earlier layer's keys and values
    first_shared = count - shared if isinstance(shared, int) and 0 < shared <= count else count  # all: assistants
    sections = {name: value for name, value in values.items()  # consecutive stack sections (input / loop / output)
                if _SECTION.fullmatch(name) and name not in _LAYER_KEYS and name != "num_kv_shared_layers"
                and isinstance(value, int) and not isinstance(value, bool)}
    if len(sections) < 2 or sum(sections.values()) != count:
        sections = {}
    section_of = [name for name, size in sections.items() for _ in range(size)]
    seen: Counter[tuple[str, str]] = Counter()
    kept: list[int] = []
    for layer in range(count):
        features = {(name, repr(value[layer]) + ("/shared" if layer >= first_shared else ""))
                    for name, value in per_layer.items()}
        features |= {(name, repr(layer in value)) for name, value in index_lists.items()}
        features |= {(name, repr(value.get(str(layer), value.get(f"{layer:02d}", value.get(layer)))))
                     for name, value in keyed.items()}
        if sections:  # every layer kind in every section
            features = {(f"{name}@{section_of[layer]}", value) for name, value in features | {("section", "")}}
        if any(seen[feature] < repeats for feature in features) or not kept:
            kept.append(layer)
            seen.update(features)
    extra = [layer for layer in range(count) if layer not in kept]
    kept = sorted(kept + extra[:max(0, min(2, count) - len(kept))])[:_MAX_LAYERS * repeats]
    for name, value in per_layer.items():
        values[name] = type(value)(value[i] for i in kept)
    if first_shared < count:
        values["num_kv_shared_layers"] = sum(layer >= first_shared for layer in kept)
    for name in sections:
        values[name] = sum(section_of[layer] == name for layer in kept)
    for name, value in index_lists.items():
        values[name] = type(value)(kept.index(i) for i in value if i in kept)
    for name, value in keyed.items():
        values[name] = {str(kept.index(int(k))).zfill(len(str(k))) if isinstance(k, str) else kept.index(int(k)): v
                        for k, v in value.items() if int(k) in kept}
    return len(kept)


def _is_sub_config(value: Any) -> bool:
    """Whether a value of a config dict is a nested config dict."""
    return isinstance(value, dict) and ("model_type" in value or any(k in value for k in _HIDDEN_KEYS))


def _hidden_sizes(values: dict[str, Any]) -> set[int]:
    """The hidden sizes of a config dict and of its sub-configs, before shrinking."""
    sizes = {v for k, v in values.items() if k in _HIDDEN_KEYS and isinstance(v, int) and v > _HIDDEN}
    return sizes.union(*(_hidden_sizes(v) for v in values.values() if _is_sub_config(v)))


def _shrink_values(values: dict[str, Any], hidden_sizes: set[int], repeats: int = 1) -> None:
    """Shrink one config's ``to_dict()`` in place (sub-config dicts recursively); ``hidden_sizes``: those of the
    whole config, before shrinking (a width equal to one, such as an adapter's input, becomes the tiny hidden)."""
    for value in values.values():
        if _is_sub_config(value):
            _shrink_values(value, hidden_sizes, repeats)
    shrunk: dict[int, int] = {}  # layer count -> kept count (encoder and decoder stacks may share a count)
    for name in _LAYER_KEYS:
        count = values.get(name)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            if count not in shrunk:
                shrunk[count] = _shrink_layers(values, count, repeats)
            values[name] = shrunk[count]
    heads = next((values[k] for k in _HEAD_KEYS if isinstance(values.get(k), int)), None)
    for name in _HEAD_DIM_KEYS[:1] + ("num_key_value_heads",):  # a None default some models cannot build from
        if name in values and values[name] is None and heads is not None:
            values[name] = _HIDDEN // _HEADS if name == "head_dim" else _HEADS
    if any(isinstance(values.get(k), int) for k in _EXPERT_KEYS):  # experts but a None top-k default
        values.update({k: 2 for k in _TOP_K_KEYS if k in values and values[k] is None})
    _shrink_scalars(values, heads, hidden_sizes, latent=False)
    for name, value in values.items():  # per-layer overrides ({"02": {"num_attention_heads": 64, ...}, ...})
        if "layer" in name and isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            for override in value.values():
                _shrink_scalars(override, heads, hidden_sizes, latent=True)
    if isinstance(values.get("rotary_dim"), int) and values["rotary_dim"] > _HEAD_DIM:
        values["rotary_dim"] = _HEAD_DIM
    for heads, dim, expand in _SSM_HEADS:  # Mamba2 heads: heads * head_dim == hidden * expand
        if all(isinstance(values.get(k), int) for k in (heads, dim, expand, "hidden_size")):
            values[heads] = values["hidden_size"] * values[expand] // values[dim]
    if all(isinstance(values.get(k), int) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        values["mamba_d_ssm"] = values["mamba_n_heads"] * values["mamba_d_head"]  # Falcon-H1's SSM width
    if all(isinstance(values.get(k), int) for k in ("index_num_heads", "num_attention_heads", "num_key_value_heads")):
        # Kolibri-1.1's indexer scores keys with the leading query heads of key head 0: at most those
        per_key_head = max(1, values["num_attention_heads"] // values["num_key_value_heads"])
        values["index_num_heads"] = min(values["index_num_heads"], per_key_head)
    for name in _WINDOW_KEYS:  # per-layer windows (e.g. longformer's attention_window)
        value = values.get(name)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            values[name] = [min(v, WINDOW) for v in value]
    _fit_mrope_sections(values)
    if "vocab_size" in values:
        _remap_special_ids(values, min(int(values["vocab_size"] or TINY_VOCAB), TINY_VOCAB))


def _shrink_scalars(values: dict[str, Any], heads: int | None, hidden_sizes: set[int], *, latent: bool) -> None:
    """Shrink the sizes of one config dict in place, or one layer's override dict (``latent``: an MLA dimension it
    overrides takes the tiny MLA value, so per-layer head dims still add up; a head dim of its own becomes twice the
    tiny one, so it still differs from the global one); ``heads``: the config's attention heads (None without
    attention), unless ``values`` sets its own."""
    heads = next((values[k] for k in _HEAD_KEYS if isinstance(values.get(k), int)), heads)
    hidden = next((values[k] for k in _HIDDEN_KEYS if isinstance(values.get(k), int)), None)
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
            values[name] = _split(_HIDDEN, value)  # parts of the hidden size (Reformer's axial position dims)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if (name in _HIDDEN_KEYS or name == "pooler_hidden_size") and value > _HIDDEN:
            values[name] = _HIDDEN
        elif name in _HEAD_KEYS and value > _HEADS:
            values[name] = _HEADS
        elif name in _KV_HEAD_KEYS and value > 1:
            values[name] = _kv_heads(value, heads)
        elif name in _HEAD_DIM_KEYS and value > _HEAD_DIM * (2 if latent else 1):
            values[name] = _HEAD_DIM * (2 if latent else 1)  # a layer's own head dim stays its own
        elif name == "num_codebooks" and value > 1:  # one token stream, as a text-only row (MusicGen)
            values[name] = 1
        elif name in _EXPERT_KEYS and value > 4:
            values[name] = 4
        elif name in _TOP_K_KEYS and value > 2:
            values[name] = 2
        elif name in ("n_shared_experts", "num_shared_experts") and value > 1:
            values[name] = 1
        elif name in ("n_group", "num_expert_group", "topk_group", "n_groups_routed"):
            values[name] = 1
        elif name == "index_kpool" and value > 2:
            values[name] = 2
        elif name == "block_size" and "max_position_embeddings" not in values:
            continue  # nanoGPT-style: the number of positions
        elif (name in _WINDOW_KEYS or name in _CHUNK_KEYS or name in _TOPK_KEYS) and value > WINDOW:
            values[name] = WINDOW
        elif name.endswith(("d_state", "state_size")) and value > _STATE:
            values[name] = _STATE
        elif name == "vocab_size" and value > TINY_VOCAB:
            values[name] = TINY_VOCAB
        elif "hash" in name and "vocab" in name and value > _HASH_BUCKETS:  # a hash embedding's table (BLT)
            values[name] = _HASH_BUCKETS
        elif _PERIOD.search(name) and value > 2 and "head" not in name:
            values[name] = 2
        elif _OFFSET.search(name) and value > 1:
            values[name] = 1
        elif _FFN_NAME.search(name) and value > _FFN:
            values[name] = _FFN
        elif value in hidden_sizes and _WIDTH.search(name) and not _KEEP_DIMS.search(name):
            values[name] = _HIDDEN
        elif (isinstance(hidden, int) and hidden > _HIDDEN and value % hidden == 0 and 1 < value // hidden <= 4
              and _WIDTH.search(name) and not _KEEP_DIMS.search(name)):
            values[name] = value // hidden * _HIDDEN  # a multiple of the hidden size (Zamba's attention input)
        elif _LARGE_DIM.search(name) and not _KEEP_DIMS.search(name) and value > _HIDDEN:
            values[name] = _HEAD_DIM * 2


def _kv_heads(kv_heads: int, heads: int | None) -> int:
    """The tiny key/value head count for ``kv_heads`` of ``heads`` query heads (None: not known): never more than the
    tiny query heads and dividing them; as many as they are when the config has one key/value head per query head."""
    tiny_heads = min(heads, _HEADS) if heads is not None else _HEADS
    if heads is not None and kv_heads >= heads:
        return tiny_heads
    return max((d for d in range(1, tiny_heads) if tiny_heads % d == 0 and d <= kv_heads), default=1)


def _split(total: int, parts: list[int]) -> list[int]:
    """``parts`` scaled to add up to ``total``, each at least 1."""
    scaled = [max(1, part * total // sum(parts)) for part in parts]
    scaled[-1] += total - sum(scaled)
    return scaled


def _fit_mrope_sections(values: dict[str, Any]) -> None:
    """Multimodal RoPE's (t, h, w) ``mrope_section`` must add up to half the rotary width, which shrinking the
    heads changed (Qwen2/2.5-VL, GLM-4V; per layer type in Cohere-Compass): scale it, keeping each section at least 1."""
    rope = values.get("rope_parameters") or values.get("rope_scaling")
    if not isinstance(rope, dict):
        return
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    head_dim = values.get("head_dim")
    if head_dim is None and isinstance(heads, int) and isinstance(hidden, int):
        head_dim = hidden // heads
    if not isinstance(head_dim, int):
        return
    per_layer_type = [r for r in rope.values() if isinstance(r, dict)]
    for parameters in per_layer_type or [rope]:
        sections = parameters.get("mrope_section")
        if not isinstance(sections, list) or not sum(sections):
            continue
        factor = parameters.get("partial_rotary_factor", values.get("partial_rotary_factor") or 1.0)
        half = int(head_dim * factor) // 2
        if sum(sections) != half:
            parameters["mrope_section"] = _split(half, sections)


def _remap_special_ids(values: dict[str, Any], vocab: int) -> None:
    """Move every special token id that no longer fits the vocabulary: pad/bos/eos to 0/1/2, others to the
    top ids (``vocab - 1``, ``vocab - 2``, ...), the same old id always to the same new one."""
    fixed = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}
    moved: dict[int, int] = {}
    top: list[int] = []

    def new_id(name: str, old: int) -> int:
        if old not in moved:
            if name in fixed and fixed[name] not in moved.values():
                moved[old] = fixed[name]
            else:
                top.append(vocab - 1 - len(top))
                moved[old] = top[-1]
        return moved[old]

    for name, value in list(values.items()):
        if not _SPECIAL_IDS.search(name) or name.endswith("layer_id"):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            values[name] = new_id(name, value)
        elif isinstance(value, list) and all(isinstance(v, int) for v in value) and any(v >= vocab for v in value):
            values[name] = [new_id(name, v) if v >= vocab else v for v in value]


def _serialized(config) -> dict[str, Any]:
    """``config.to_dict()`` without what a copy must not carry (name, checkpoint format, quantization)."""
    values = config.to_dict()
    if any(isinstance(values.get(name), int) and values[name] != getattr(config, name) for name in _LAYER_KEYS):
        # a serialized form with more layers than the model builds (Dory interleaves "mlp" blocks): shrink the
        # model's own per-layer values, which the constructor takes as they are
        values.update({name: getattr(config, name) for name, value in values.items()
                       if isinstance(value, (int, list)) and not isinstance(value, bool)
                       and getattr(config, name, value) != value})
    for name in ("_name_or_path", "architectures", "transformers_version", "auto_map", "torch_dtype", "dtype",
                 "quantization_config"):
        values.pop(name, None)
    _trim_to_depth(values)
    return values


def _is_index_list(value: Any) -> bool:
    """Whether ``value`` is a list of layer indices (``mlp_only_layers``): non-negative ints, strictly increasing."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
            and all(a < b for a, b in zip(value, value[1:])))


def _old_depth(values: dict[str, Any], depth: int) -> int | None:
    """The depth a config dict's per-layer lists were written for, when they are longer than the ``depth`` its model
    builds (a config cut in depth after creation), else None: the length of ``layer_types``, else the most common
    length (the largest of a tie) of the lists named for layers."""
    lengths = [len(value) for name, value in values.items()
               if "layer" in name and isinstance(value, (list, tuple)) and len(value) > depth
               and not _is_index_list(value)]
    layer_types = values.get("layer_types")
    if isinstance(layer_types, (list, tuple)) and len(layer_types) in lengths:
        return len(layer_types)
    counts = Counter(lengths)
    return max(counts, key=lambda length: (counts[length], length)) if counts else None


def _trim_to_depth(values: dict[str, Any]) -> None:
    """Cut the per-layer settings of a config dict (and of its sub-config dicts) in place to the depth its model builds.

    A config cut in depth after creation (``config.num_hidden_layers = 2`` on a 32-layer config) keeps its per-layer
    lists at the old depth: stock builds its layers from their first entries, but a config rebuilt from those values
    fails validation (``num_hidden_layers`` must equal the number of ``layer_types``). Every list of the old depth
    (:func:`_old_depth`) keeps its first entries; index lists and layer-keyed dicts named for layers lose the layers
    past the depth."""
    for value in values.values():
        if _is_sub_config(value):
            _trim_to_depth(value)
    depth = next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)
                  and not isinstance(values[k], bool) and values[k] > 0), None)
    old = _old_depth(values, depth) if depth is not None else None
    if old is None:
        return
    for name, value in list(values.items()):
        if name == "architectures" or _SPECIAL_IDS.search(name):
            continue
        if isinstance(value, (list, tuple)) and len(value) == old:
            values[name] = type(value)(value[:depth])
        elif "layer" in name and _is_index_list(value) and value[-1] < old:
            values[name] = type(value)(i for i in value if i < depth)
        elif ("layer" in name and isinstance(value, dict) and value
              and all(str(k).isdigit() and int(k) < old for k in value)):
            values[name] = {k: v for k, v in value.items() if int(k) < depth}


def shrink_config(config, *, repeats: int = 1):
    """A fresh tiny config of ``config``'s class that keeps each of its distinct layer kinds (see the module doc),
    each ``repeats`` times where the config has it that often (layers that share weights across positions need
    a second one: Zamba ties every shared block to the first)."""
    values = _serialized(config)
    _shrink_values(values, _hidden_sizes(values), repeats)
    values.pop("model_type", None)
    return _runs_on_tokens(type(config)(**_without_derived(values, config)))


def _runs_on_tokens(config):
    """``config`` (a copy), set so that its model runs on a row of token ids alone, as the proof gives it: X-MOD with
    no default language needs ``lang_ids`` on every call, so the copy takes its first language (every language
    adapter is the same kind of layer)."""
    languages = getattr(config, "languages", None)
    if getattr(config, "default_language", False) is None and languages:
        config.default_language = languages[0]
    return config


def _is_width(name: str) -> bool:
    """Whether a config setting named ``name`` is a width (hidden, head, feed-forward, projection rank)."""
    return (name in _HIDDEN_KEYS or name in _HEAD_DIM_KEYS or bool(_FFN_NAME.search(name))
            or ((bool(_LARGE_DIM.search(name)) or bool(_WIDTH.search(name))) and not _KEEP_DIMS.search(name)))


def _widths(values: dict[str, Any]) -> list[int]:
    """Every width of a config dict and of its sub-configs."""
    own = [v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0 and _is_width(k)]
    return own + [w for v in values.values() if _is_sub_config(v) for w in _widths(v)]


def _cut_values(values: dict[str, Any], factor: int) -> None:
    """Cut one config dict in place: every width divided by ``factor`` (ratios between widths, head counts and
    per-layer lists kept), each layer kind kept twice, a tiny vocabulary, windows and chunks of :data:`WINDOW`."""
    for value in values.values():
        if _is_sub_config(value):
            _cut_values(value, factor)
    shrunk: dict[int, int] = {}
    for name in _LAYER_KEYS:
        count = values.get(name)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            if count not in shrunk:
                shrunk[count] = _shrink_layers(values, count, repeats=2)
            values[name] = shrunk[count]
    for name, value in list(values.items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if _is_width(name) and value % factor == 0:
            values[name] = value // factor
        elif (name in _WINDOW_KEYS or name in _CHUNK_KEYS or name in _TOPK_KEYS) and value > WINDOW:
            values[name] = WINDOW
        elif name == "vocab_size" and value > TINY_VOCAB:
            values[name] = TINY_VOCAB
    _fit_mrope_sections(values)
    if "vocab_size" in values:
        _remap_special_ids(values, min(int(values["vocab_size"] or TINY_VOCAB), TINY_VOCAB))


def cut_factors(config) -> list[int]:
    """The width factors of :func:`cut_config` for ``config``, largest first: the powers of two from the largest
    that divides every width (the hidden size staying at least 64) down to 1 (widths as they are)."""
    values = _serialized(config)
    widths = _widths(values)
    hidden = next((values[k] for k in _HIDDEN_KEYS if isinstance(values.get(k), int)), None)
    factor = 1
    while widths and all(w % (factor * 2) == 0 for w in widths) and (hidden or 0) // (factor * 2) >= _HIDDEN:
        factor *= 2
    return [factor >> shift for shift in range(factor.bit_length())]


def cut_config(config, factor: int):
    """A copy of ``config`` cut in depth (each layer kind twice) and in width (every width divided by ``factor``):
    for configs whose tiny copy (:func:`shrink_config`) cannot be built."""
    values = _serialized(config)
    _cut_values(values, factor)
    values.pop("model_type", None)
    return _runs_on_tokens(type(config)(**_without_derived(values, config)))


def proof_configs(config) -> list[tuple[str, Callable[[], Any]]]:
    """``(description, make_config)`` of the configs to prove ``config``'s model on, best first: its tiny copy,
    the tiny copy with each layer kind twice, then :func:`cut_config` at each of :func:`cut_factors`."""
    return [("a tiny copy", lambda: shrink_config(config)),
            ("a tiny copy with each layer kind twice", lambda: shrink_config(config, repeats=2)),
            *[(f"a copy cut in depth and in width by {factor}", lambda factor=factor: cut_config(config, factor))
              for factor in cut_factors(config)]]


def _without_derived(values: dict[str, Any], config) -> dict[str, Any]:
    """``values`` (a shrunk ``config.to_dict()``) less the settings ``config``'s class derives from the others
    (Zamba2's ``attention_hidden_size = 2 * hidden_size``, ...): the tiny config derives them again from the tiny
    values, so that they keep their ratios; sub-config dicts likewise. Dicts of settings (per-layer overrides)
    are kept as shrunk."""
    import dataclasses

    from transformers import PreTrainedConfig

    for name, value in values.items():
        sub = getattr(config, name, None) if isinstance(value, dict) and _has_setting(config, name) else None
        if isinstance(sub, PreTrainedConfig):
            # a sub-config dict keeps its model_type, which is no dataclass field but names the class to build
            # (Exaone-4.5 and MusicFlamingo read it in __post_init__)
            kept = {"model_type": value["model_type"]} if "model_type" in value else {}
            values[name] = {**_without_derived(value, sub), **kept}
    if not dataclasses.is_dataclass(config):
        return values
    fields = {field.name for field in dataclasses.fields(config)}
    given = {name: value for name, value in values.items() if name in fields}
    try:
        derived = type(config)(**given)
    except Exception:  # noqa: BLE001 - the class needs its other settings to build: keep them all
        return values
    return {**given, **{name: value for name, value in values.items()  # per-layer override dicts stay as shrunk
                        if name not in fields and (isinstance(value, dict) or not _has_setting(derived, name))}}


def _has_setting(config, name: str) -> bool:
    """Whether ``config`` has a setting ``name`` (one that raises when read, as a per-layer one read globally, counts
    as absent)."""
    try:
        getattr(config, name)
    except Exception:  # noqa: BLE001
        return False
    return True


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
