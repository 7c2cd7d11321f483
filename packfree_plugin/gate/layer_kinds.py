"""Which layers a small copy of a config keeps: as few as cover every per-layer setting (each value of each
per-layer list, each membership of a layer-index list, each entry of a layer-keyed dict), in every stack section,
with every per-layer setting rewritten to the layers kept."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config_keys import LAYER_KEYS, SECTION

__all__ = ["cut_depth", "keep_layer_kinds"]

_MAX_LAYERS = 6


def cut_depth(values: dict[str, Any], repeats: int) -> None:
    """Cut every layer stack of one config dict in place (:data:`packfree_plugin.gate.config_keys.LAYER_KEYS`:
    decoder, encoder, ...) to the layers :func:`keep_layer_kinds` keeps; stacks of one depth are cut once (an
    encoder and a decoder of the same count share their per-layer lists)."""
    kept: dict[int, int] = {}  # layer count -> kept count
    for name in LAYER_KEYS:
        count = values.get(name)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            if count not in kept:
                kept[count] = keep_layer_kinds(values, count, repeats)
            values[name] = kept[count]


def keep_layer_kinds(values: dict[str, Any], count: int, repeats: int = 1) -> int:
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
                if SECTION.fullmatch(name) and name not in LAYER_KEYS and name != "num_kv_shared_layers"
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
