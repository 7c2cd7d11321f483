"""A config as the dict the gate edits, and back: read out without what a copy must not carry and cut to the depth
its model builds (:func:`serialized`), special ids moved into a smaller vocabulary and multimodal RoPE sections
fitted to a smaller head (:func:`refit`), and built again with the settings its class derives left to it
(:func:`without_derived`, :func:`runs_on_tokens`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config_keys import LAYER_KEYS, SPECIAL_IDS, is_index_list, is_sub_config

__all__ = ["fit_mrope_sections", "rebuilt", "refit", "remap_special_ids", "runs_on_tokens", "serialized", "split_total",
           "without_derived"]

def serialized(config) -> dict[str, Any]:
    """``config.to_dict()`` without what a copy must not carry (name, checkpoint format, quantization)."""
    values = config.to_dict()
    if any(isinstance(values.get(name), int) and values[name] != getattr(config, name) for name in LAYER_KEYS):
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


def _old_depth(values: dict[str, Any], depth: int) -> int | None:
    """The depth a config dict's per-layer lists were written for, when they are longer than the ``depth`` its model
    builds (a config cut in depth after creation), else None: the length of ``layer_types``, else the most common
    length (the largest of a tie) of the lists named for layers."""
    lengths = [len(value) for name, value in values.items()
               if "layer" in name and isinstance(value, (list, tuple)) and len(value) > depth
               and not is_index_list(value)]
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
        if is_sub_config(value):
            _trim_to_depth(value)
    depth = next((values[k] for k in LAYER_KEYS if isinstance(values.get(k), int)
                  and not isinstance(values[k], bool) and values[k] > 0), None)
    old = _old_depth(values, depth) if depth is not None else None
    if old is None:
        return
    for name, value in list(values.items()):
        if name == "architectures" or SPECIAL_IDS.search(name):
            continue
        if isinstance(value, (list, tuple)) and len(value) == old:
            values[name] = type(value)(value[:depth])
        elif "layer" in name and is_index_list(value) and value[-1] < old:
            values[name] = type(value)(i for i in value if i < depth)
        elif ("layer" in name and isinstance(value, dict) and value
              and all(str(k).isdigit() and int(k) < old for k in value)):
            values[name] = {k: v for k, v in value.items() if int(k) < depth}


def rebuilt(config, values: dict[str, Any]):
    """A fresh config of ``config``'s class from ``values`` (its edited ``to_dict()``, ``model_type`` dropped), the
    settings the class derives derived again (:func:`without_derived`), set to run on token ids alone
    (:func:`runs_on_tokens`)."""
    values.pop("model_type", None)
    return runs_on_tokens(type(config)(**without_derived(values, config)))


def without_derived(values: dict[str, Any], config) -> dict[str, Any]:
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
            values[name] = {**without_derived(value, sub), **kept}
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


def runs_on_tokens(config):
    """``config`` (a copy), set so that its model runs on a row of token ids alone, as the proof gives it: X-MOD with
    no default language needs ``lang_ids`` on every call, so the copy takes its first language (every language
    adapter is the same kind of layer)."""
    languages = getattr(config, "languages", None)
    if getattr(config, "default_language", False) is None and languages:
        config.default_language = languages[0]
    return config


def remap_special_ids(values: dict[str, Any], vocab: int) -> None:
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
        if not SPECIAL_IDS.search(name) or name.endswith("layer_id"):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            values[name] = new_id(name, value)
        elif isinstance(value, list) and all(isinstance(v, int) for v in value) and any(v >= vocab for v in value):
            values[name] = [new_id(name, v) if v >= vocab else v for v in value]


def refit(values: dict[str, Any], vocabulary: int) -> None:
    """After shrinking one config dict in place: its multimodal RoPE sections fitted to its new head width, its
    special ids moved inside a vocabulary of at most ``vocabulary`` ids."""
    fit_mrope_sections(values)
    if "vocab_size" in values:
        remap_special_ids(values, min(int(values["vocab_size"] or vocabulary), vocabulary))


def fit_mrope_sections(values: dict[str, Any]) -> None:
    """Multimodal RoPE's (t, h, w) ``mrope_section`` must add up to half the rotary width, which shrinking the
    heads changed (Qwen2/2.5-VL, GLM-4V; per layer type in Cohere-Compass): scale it, keeping each section at
    least 1."""
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
            parameters["mrope_section"] = split_total(half, sections)


def split_total(total: int, parts: list[int]) -> list[int]:
    """``parts`` scaled to add up to ``total``, each at least 1."""
    scaled = [max(1, part * total // sum(parts)) for part in parts]
    scaled[-1] += total - sum(scaled)
    return scaled
