"""Models whose own code indexes the attention mask it is handed. A sweep over the installed transformers' modeling
files (every subscript of a mask built by ``create_*_mask``, or of a value of a mapping of such masks) finds them;
running each confirms it:

- Gemma 4 text and Gemma-4-unified text: before their KV-shared layers they cut every mask to the last
  ``logits_to_keep`` queries, ``mask[:, :, slice(-logits_to_keep, None), :]`` (``slice(0, None)``, all of them, in
  training). They crashed on packfree's boundaries (``TypeError: 'Boundaries' object is not subscriptable``).
- VisualBERT with ``bypass_transformer``: ``mask[:, :, text_length, :text_length]`` for its text-only encoder; the
  gate refuses VisualBERT at load (its self-attention mixes packed samples), so the mask never reaches it.

An index that keeps every token gives the boundaries back (exact, nothing cut); an unpacked batch of these models
gets stock's own mask tensors (so ``generate()``'s ``logits_to_keep=1`` cut is stock's); a real cut of a packed row
is refused with the reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import transformers

import packfree_plugin
from packfree_plugin import Boundaries
from packfree_plugin.classes import classes_with
from tests.conftest import assert_close

SAMPLES = (4, 3, 2)


def _gemma4(model_type: str, implementation: str) -> torch.nn.Module:
    """Four layers, the last two reusing earlier layers' keys and values (what makes the model cut its masks)."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2,
        num_global_key_value_heads=2, head_dim=16, global_head_dim=16, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128, num_hidden_layers=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, pad_token_id=0)
    packfree_plugin.register()
    torch.manual_seed(0)
    cls = {"gemma4_text": transformers.Gemma4ForCausalLM, "gemma4_unified_text": transformers.Gemma4UnifiedForCausalLM}
    return cls[model_type]._from_config(config, attn_implementation=implementation, dtype=torch.float64).eval()


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_kv_shared_layers_slice_their_masks_exactly(model_type: str) -> None:
    model, stock = _gemma4(model_type, "packfree"), _gemma4(model_type, "sdpa")
    stock.load_state_dict(model.state_dict())
    tokens = torch.randint(3, 128, (1, sum(SAMPLES)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in SAMPLES])[None]
    with torch.no_grad():
        packed = model(input_ids=tokens, position_ids=positions).logits[0]
        alone = torch.cat([stock(input_ids=piece[None]).logits[0] for piece in tokens[0].split(SAMPLES)])
        assert_close(packed, alone, atol=1e-12, rtol=0, what=f"{model_type} packed")
        for keep in (1, 3):  # generate()'s prefill cut, unpacked: stock's masks
            assert_close(model(input_ids=tokens, logits_to_keep=keep).logits,
                         stock(input_ids=tokens, logits_to_keep=keep).logits, atol=1e-12, rtol=0,
                         what=f"{model_type} unpacked logits_to_keep={keep}")
        module = type(model).__module__.rsplit(".", 2)[-2]
        if module_cuts_its_masks(module):  # transformers 5.24: a real cut of a packed row, refused
            with pytest.raises(ValueError, match="cuts packfree's attention mask"):
                model(input_ids=tokens, position_ids=positions, logits_to_keep=1)
        else:  # releases whose Gemma 4 cuts nothing: the packed row's last logits are its last sample's
            assert_close(model(input_ids=tokens, position_ids=positions, logits_to_keep=1).logits[0], alone[-1:],
                         atol=1e-12, rtol=0, what=f"{model_type} packed logits_to_keep=1")


def test_an_index_that_keeps_every_token_gives_the_boundaries_back() -> None:
    boundaries = Boundaries.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    assert boundaries[:, :, slice(0, None), :] is boundaries
    assert boundaries[..., :] is boundaries
    with pytest.raises(ValueError, match="cuts packfree's attention mask"):
        boundaries[:, :, slice(-1, None), :]


# ------------------------------------------------------------------------------------------------ the sweep
HANDLED = {"gemma4": "Gemma4TextConfig", "gemma4_unified": "Gemma4UnifiedTextConfig"}
"""Modeling module -> the config class whose ``slices_mask`` quirk (:data:`packfree_plugin.classes.CLASSES`) covers
its cut."""
REFUSED_AT_LOAD = {"longformer": "LongformerSelfAttention", "visual_bert": "VisualBertSelfAttention"}
"""Modules whose cut the gate never lets a packfree mask reach: it refuses these models at load for their attention."""


def _is_cut(index: ast.expr) -> bool:
    """A tensor-style index: several axes, a slice or an Ellipsis (not a mapping's key or a list position)."""
    parts = index.elts if isinstance(index, ast.Tuple) else [index]
    return len(parts) > 1 or any(isinstance(part, ast.Slice) or (isinstance(part, ast.Constant) and part.value is ...)
                                 for part in parts)


def _builds_mask(value: ast.expr) -> bool:
    """Whether ``value`` calls one of transformers' mask builders (``create_causal_mask``, ...; a model's own
    ``self.create_mask`` is not the mask interface)."""
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id.startswith("create_")
               and "mask" in call.func.id for call in ast.walk(value))


def mask_cuts(source: str) -> list[str]:
    """``function:line index`` of every tensor-style index of a mask built by transformers' mask builders (or of a
    value of a mapping of them, ``causal_mask_mapping``) in modeling ``source``, after it was built."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef):
            continue
        masks: dict[str, int] = {}
        mappings = {"causal_mask_mapping": function.lineno} if "causal_mask_mapping" in \
            [argument.arg for argument in function.args.args] else {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and _builds_mask(node.value):
                table = mappings if isinstance(node.value, (ast.Dict, ast.DictComp)) else masks
                table[node.targets[0].id] = node.end_lineno
        for node in ast.walk(function):
            if isinstance(node, ast.Subscript) and _is_cut(node.slice):
                base, table = node.value, masks
                if isinstance(base, ast.Subscript):  # mapping[layer_type][...]
                    base, table = base.value, mappings
                if isinstance(base, ast.Name) and node.lineno > table.get(base.id, node.lineno):
                    found.append(f"{function.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.DictComp) and isinstance(node.generators[0].target, ast.Tuple):
                source_call, target = node.generators[0].iter, node.generators[0].target.elts[-1]
                if isinstance(source_call, ast.Call) and isinstance(source_call.func, ast.Attribute) and \
                        getattr(source_call.func.value, "id", None) in mappings and isinstance(target, ast.Name):
                    found += [f"{function.name}:{sub.lineno} {ast.unparse(sub)}" for sub in ast.walk(node.value)
                              if isinstance(sub, ast.Subscript) and getattr(sub.value, "id", None) == target.id
                              and _is_cut(sub.slice)]
    return found


def module_cuts_its_masks(module: str) -> bool:
    """Whether the installed transformers' ``models/<module>/modeling_<module>.py`` cuts a mask it built."""
    path = Path(transformers.__file__).parent / "models" / module / f"modeling_{module}.py"
    return bool(mask_cuts(path.read_text()))


def test_every_model_that_cuts_its_mask_is_handled_or_refused_at_load() -> None:
    """The sweep over the installed transformers: a model that cuts its masks and is neither handled nor refused at
    load fails here (a new release adding one would crash on packfree's boundaries, or cut them wrongly)."""
    models = Path(transformers.__file__).parent / "models"
    builds = re.compile(r"\bcreate_\w*mask\w*\(")
    indexes = re.compile(r"\b(\w*mask\w*|v)(\[[^\[\]]*\])?\[[^\[\]]*(:|\.\.\.)")  # only these files need parsing
    found = {}
    for path in sorted(models.glob("*/modeling_*.py")):
        source = path.read_text()
        if builds.search(source) and indexes.search(source) and (cuts := mask_cuts(source)):
            found[path.parent.name] = cuts
    assert set(REFUSED_AT_LOAD) <= set(found), found  # the sweep finds the known cases (in every release)
    unknown = {module: cuts for module, cuts in found.items() if module not in {**HANDLED, **REFUSED_AT_LOAD}}
    assert not unknown, f"models that cut the mask they build, neither handled nor refused at load: {unknown}"
    assert set(HANDLED.values()) == classes_with("slices_mask")
