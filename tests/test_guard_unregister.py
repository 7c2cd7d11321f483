"""Unregistering and releasing restore everything packfree changed. In a fresh interpreter (autoload off), a tiny
model of every modeling module of the routing table (:func:`packfree_plugin.mixers.seam.routed_functions`) is loaded and
run on stock; then ``vars()`` of every transformers object packfree patches is pictured: each routed modeling module
and the kernel-function modules in it, the modules holding attention-class tables
(:func:`packfree_plugin.classes.stock_tables`), the attention and mask registries, ``PreTrainedModel``, the import
hooks, and every submodule of each model. Each model is prepared with ``packfree_plugin.apply`` and run on a packed
row, then released, and ``unregister()`` runs: every picture must equal the first, and each object packfree patches
must have been changed in between (else the test would prove nothing for it).

The interpreter is a child process: this test changes nothing in the suite's own (its registry, routes and
``sys.modules`` stay as other tests left them)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SIMPLE = (bool, int, float, str, bytes, tuple, frozenset, type(None))


def _picture(namespace: Any) -> dict[str, Any]:
    """``vars(namespace)`` (or the dict itself), each dict or list value copied one level (a registry's entries; a
    dict's stored values, not what a subclass's ``__getitem__`` makes of them, as ``ACT2FN``'s instances)."""
    items = namespace if isinstance(namespace, dict) else vars(namespace)
    return {name: dict(dict.items(value)) if isinstance(value, dict) else list(value) if isinstance(value, list)
            else value for name, value in items.items()}


def _same(a: Any, b: Any) -> bool:
    """Identity, element by element for the copied dicts and lists (equality for plain values)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (isinstance(a, _SIMPLE) and type(a) is type(b) and a == b)


def _differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two pictures: names added, removed or holding another value."""
    added = [f"{name} added" for name in after.keys() - before.keys()]
    removed = [f"{name} removed" for name in before.keys() - after.keys()]
    changed = [f"{name} changed" for name in before.keys() & after.keys() if not _same(before[name], after[name])]
    return sorted(added + removed + changed)


def _patched_objects() -> tuple[dict[str, Any], list[str]]:
    """Every transformers object packfree may change, by a readable name (the modeling modules imported here), and
    the names of those it must change once models are prepared: the registries, ``PreTrainedModel``, each routed
    module (itself or a kernel-function module in it) and each module whose attention-class table exists."""
    from torch import nn
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packfree_plugin.mixers.seam import routed_functions
    from packfree_plugin.classes import stock_tables

    objects: dict[str, Any] = {
        "AttentionInterface._global_mapping": AttentionInterface._global_mapping,
        "AttentionMaskInterface._global_mapping": AttentionMaskInterface._global_mapping,
        "ALL_ATTENTION_FUNCTIONS": ALL_ATTENTION_FUNCTIONS,
        "ALL_MASK_ATTENTION_FUNCTIONS": ALL_MASK_ATTENTION_FUNCTIONS,
        "PreTrainedModel": PreTrainedModel, "sys.meta_path": {"finders": sys.meta_path},
    }
    required = ["AttentionInterface._global_mapping", "AttentionMaskInterface._global_mapping", "PreTrainedModel"]
    for name in [*routed_functions(), *stock_tables()]:
        module = importlib.import_module(f"transformers.models.{name}")
        objects[name] = module
        table = stock_tables().get(name)
        if name in routed_functions() or getattr(module, table[0], None) is not None:
            required.append(name)
        for function in routed_functions().get(name, {}):
            if isinstance(getattr(module, function, None), nn.Module):  # a kernels layer: kernelize changes it
                objects[f"{name}.{function}"] = getattr(module, function)
    return objects, required


def _routed_model_types() -> list[str]:
    """For each routed modeling module, the tiny catalogue's model type that builds it (its folder, or its text
    model's)."""
    from packfree_plugin.mixers.seam import routed_functions
    from packfree_plugin.gate.catalogue import CATALOGUE

    folders = [name.split(".")[0] for name in routed_functions()]
    return [next(t for t in (folder, f"{folder}_text") if t in CATALOGUE) for folder in folders]


def _model_pictures(model: Any) -> dict[str, dict[str, Any]]:
    """The picture of every submodule of ``model``, by its path."""
    return {path: _picture(module) for path, module in model.named_modules()}


def run_in_child() -> None:
    """The child's work (see the module docstring); prints one JSON line: what was left behind, what packfree never
    changed."""
    import torch

    import packfree_plugin
    from packfree_plugin.cli.tiny import load_model
    from packfree_plugin.gate.audit import packed_row

    objects, required = _patched_objects()
    models = []
    for model_type in _routed_model_types():
        model = load_model(model_type, "eager")
        row = torch.randint(3, 100, (1, 9))
        with torch.no_grad():
            model(input_ids=row)  # what stock caches in its first forward is in the first picture
        models.append((model_type, model, row, _model_pictures(model)))
    stock_state = {name: _picture(value) for name, value in objects.items()}
    for _, model, row, _ in models:
        packfree_plugin.apply(model)
        with torch.no_grad():
            model(**packed_row([row[0, :4], row[0, 4:]]))
    prepared_state = {name: _picture(value) for name, value in objects.items()}
    left = []
    for model_type, model, _, before in models:
        packfree_plugin.release(model)
        after = _model_pictures(model)
        left += [f"released {model_type}: {path}: {difference}" for path in before
                 for difference in _differences(before[path], after.get(path, {}))]
    packfree_plugin.unregister()
    for name, value in objects.items():
        left += [f"{name}: {difference}" for difference in _differences(stock_state[name], _picture(value))]
    changed = [name for name in objects if _differences(stock_state[name], prepared_state[name])]
    untouched = [name for name in required if not any(other == name or other.startswith(f"{name}.")
                                                      for other in changed)]
    print(json.dumps({"left": left, "untouched": untouched}))


CHILD = "from tests.test_guard_unregister import run_in_child; run_in_child()"


def test_unregister_and_release_restore_everything_packfree_changed() -> None:
    environment = {**os.environ, "PACKFREE_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, env=environment,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["left"] == [], "packfree left behind:\n" + "\n".join(report["left"])
    assert report["untouched"] == [], f"packfree never changed these, so this proves nothing: {report['untouched']}"


@pytest.mark.parametrize(("before", "after", "expected"), [
    ({"a": 1, "f": len}, {"a": 1, "f": len}, []),
    ({"table": {"sdpa": len}}, {"table": {"sdpa": len, "packfree": len}}, ["table changed"]),
    ({"f": len}, {"f": len, "_packfree_original": len}, ["_packfree_original added"]),
    ({"f": len}, {"f": max}, ["f changed"]),
])
def test_pictures_tell_an_added_entry_or_attribute(before: dict, after: dict, expected: list[str]) -> None:
    """The comparison itself: an added registry entry or attribute and a replaced function count; equal plain
    values do not."""
    assert _differences(_picture(before), _picture(after)) == expected
