"""The model entry (packfree_plugin/forward/hook.py): ``model.forward(...)`` reaches packfree as ``model(...)`` does,
the signature callers read is stock's, and ``set_attn_implementation`` switches a loaded model both ways."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import packfree_plugin
from packfree_plugin.forward.context import boundaries_here
from packfree_plugin.gate.audit import packed_row
from packfree_plugin.forward.hook import has_entry
from tests.conftest import assert_close, tiny_config
from tests.helpers import fresh_pair, gradients, max_grad_diff, samples_of

LENGTHS = [6, 9, 4]
TOLERANCE = {"qwen3_next": 1e-6, "mamba2": 1e-6}
"""float64 tolerance of a packed sample against it alone: Qwen3-Next's gated norms and stock Mamba2's eager path
compute in float32 (1e-9 else)."""


def _alone(stock: torch.nn.Module, samples: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [stock(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in samples]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_forward_called_directly_keeps_samples_apart(model_type: str) -> None:
    """sentence-transformers calls ``model.forward(...)``, which module hooks never see: the packed row must still
    equal each sample alone, as ``model(...)`` does, and leave the stack as it found it."""
    model, stock = fresh_pair(model_type)
    samples = samples_of(LENGTHS)
    batch = packed_row([torch.tensor(s) for s in samples])
    with torch.no_grad():
        direct = model.forward(**batch).logits[0]  # default use_cache=True: the entry turns it off
        called = model(**batch).logits[0]
    assert torch.equal(direct, called)
    for piece, alone in zip(direct.split(LENGTHS), _alone(stock, samples)):
        assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-9), rtol=0,
                     what=f"{model_type} forward called directly")
    assert boundaries_here() is None


def test_the_signature_callers_read_is_stock_and_the_class_is_untouched() -> None:
    """Trainer's column filter and ``generate`` read ``inspect.signature(model.forward)``; the gate's stock twin of
    the same class must run the class's own forward."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree")
    stock = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    for mine, theirs in ((model, stock), (model.model, stock.model)):
        assert has_entry(mine) and not has_entry(theirs)
        assert inspect.signature(mine.forward) == inspect.signature(theirs.forward)
        assert "forward" not in theirs.__dict__
    head = AutoModelForSequenceClassification.from_config(tiny_config("llama"), attn_implementation="packfree")
    assert inspect.signature(head.forward) == inspect.signature(
        AutoModelForSequenceClassification.from_config(tiny_config("llama")).forward)


def test_an_attention_layer_called_alone_in_a_prepared_model_never_advises_apply() -> None:
    """The model is prepared: the error names what happened (a layer run outside its model's forward), not apply()."""
    model, _ = fresh_pair("llama")
    hidden = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(5)[None])
    with torch.no_grad(), pytest.raises(ValueError, match=r"outside its model's forward") as refused:
        model.model.layers[0].self_attn(hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert "apply" not in str(refused.value)


def test_a_model_set_to_packfree_behind_transformers_back_is_told_to_apply() -> None:
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    model.config._attn_implementation_internal = "packfree"  # not set_attn_implementation: nothing prepared it
    with torch.no_grad(), pytest.raises(ValueError, match=r"has not prepared.*packfree_plugin.apply\(model\)"):
        model(**packed_row([torch.tensor(s) for s in samples_of(LENGTHS)]))


# ------------------------------------------------------------------------------ set_attn_implementation
def _stock_pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two stock sdpa models with the same weights (eager for Mamba2, which has no sdpa path)."""
    _, stock = fresh_pair(model_type)
    _, twin = fresh_pair(model_type)
    twin.load_state_dict(stock.state_dict())
    return stock, twin


def _instance_forwards(model: torch.nn.Module) -> dict[str, str]:
    return {path: type(module.__dict__["forward"]).__name__ + getattr(module.__dict__["forward"], "func", "").__name__
            for path, module in model.named_modules() if "forward" in module.__dict__}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_switching_to_packfree_after_loading_gives_the_model_loading_with_it_builds(model_type: str) -> None:
    """transformers' own padding-free tests switch with ``set_attn_implementation("packfree")``: the model must be
    prepared as at load (entries, mixers' forwards, the gate), keep samples apart, and equal the loaded one."""
    loaded, _ = fresh_pair(model_type)
    switched, stock = _stock_pair(model_type)
    switched.load_state_dict(loaded.state_dict())
    stock.load_state_dict(loaded.state_dict())
    switched.set_attn_implementation("packfree")
    assert switched.config._attn_implementation == "packfree"
    assert _instance_forwards(switched) == _instance_forwards(loaded) != {}
    samples = samples_of(LENGTHS)
    batch = packed_row([torch.tensor(s) for s in samples])
    with torch.no_grad():
        packed = switched(**batch).logits[0]
        assert torch.equal(packed, loaded(**batch).logits[0])
    for piece, alone in zip(packed.split(LENGTHS), _alone(stock, samples)):
        assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-9), rtol=0,
                     what=f"{model_type} switched to packfree")


def test_switching_runs_the_load_time_proof_and_a_refused_model_stays_as_it_was(monkeypatch) -> None:
    """The gate runs on a switch as at load; a model it refuses raises with its reason and keeps its implementation,
    its forwards and its outputs."""
    from packfree_plugin.loading import prepare

    stock, twin = _stock_pair("llama")
    reason = "LlamaForCausalLM (planted refusal): its layer mixes samples"

    def refuse(model, **_):
        raise ValueError(reason)

    monkeypatch.setattr(prepare, "admit", refuse)
    with pytest.raises(ValueError, match="planted refusal"):
        stock.set_attn_implementation("packfree")
    assert stock.config._attn_implementation == "sdpa" and not has_entry(stock)
    assert _instance_forwards(stock) == {}
    batch = packed_row([torch.tensor(s) for s in samples_of(LENGTHS)])
    with torch.no_grad():
        assert torch.equal(stock(**batch).logits, twin(**batch).logits)


def test_a_model_transformers_cannot_switch_is_told_to_load_with_packfree() -> None:
    """GPT-Neo picks its attention class when it is built, so transformers only warns and leaves it as it is: packfree
    says so instead of running on as if it had switched."""
    from packfree_plugin.cli.tiny import tiny_config as any_tiny_config

    model = AutoModelForCausalLM.from_config(any_tiny_config("gpt_neo"), attn_implementation="eager")
    with pytest.raises(ValueError, match="cannot switch its attention implementation after loading"):
        model.set_attn_implementation("packfree")
    assert model.config._attn_implementation == "eager" and not has_entry(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_switching_back_runs_exactly_as_stock(model_type: str) -> None:
    """``set_attn_implementation("sdpa")`` on a packfree model leaves nothing of packfree on it (no entry, hook,
    instance forward or cached attribute, checkpoint functions restored) and it computes what stock computes, bit for
    bit, forward and backward, packed position_ids included (stock's own handling of them); switching again packs."""
    model, _ = fresh_pair(model_type)
    stock, _ = _stock_pair(model_type)
    stock.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable()
    stock.gradient_checkpointing_enable()
    model.train()
    stock.train()
    samples = samples_of(LENGTHS)
    batch = packed_row([torch.tensor(s) for s in samples])
    model(**batch, labels=batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100)).loss.backward()
    model.zero_grad()
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    for path, module in model.named_modules():
        left = [name for name in module.__dict__ if name.startswith("_packfree_") or name == "forward"]
        assert not left, f"{path} keeps {left}"
        twin = stock.get_submodule(path)
        assert (len(module._forward_hooks), len(module._forward_pre_hooks)) == (
            len(twin._forward_hooks), len(twin._forward_pre_hooks)), f"{path} keeps hooks stock has not"
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        assert not hasattr(checkpoint, "_packfree_carries_boundaries"), f"{path} keeps packfree's checkpoint carry"
    for index, inputs in enumerate([batch, {"input_ids": batch["input_ids"]}]):
        mine = model(**inputs, labels=inputs["input_ids"])
        theirs = stock(**inputs, labels=inputs["input_ids"])
        assert torch.equal(mine.logits, theirs.logits), f"{model_type} after switching back, input {index}"
        mine.loss.backward()
        theirs.loss.backward()
        assert max_grad_diff(gradients(model), gradients(stock)) == 0.0
        model.zero_grad()
        stock.zero_grad()
    model.set_attn_implementation("packfree")
    model.eval()
    with torch.no_grad():
        packed = model(**batch).logits[0]
    _, reference = fresh_pair(model_type)
    reference.load_state_dict(stock.state_dict())
    for piece, alone in zip(packed.split(LENGTHS), _alone(reference, samples)):
        assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-9), rtol=0,
                     what=f"{model_type} switched back to packfree")


def test_apply_still_switches_and_prepares() -> None:
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert packfree_plugin.apply(model) is model and has_entry(model) and has_entry(model.model)


def test_introspection_and_an_empty_batch_read_as_stock() -> None:
    """sentence-transformers reads the forward's return type with ``typing.get_type_hints``; an empty batch fails as
    stock's does (its own RuntimeError), not with a packfree error about boundaries."""
    import typing

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree")
    stock = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert typing.get_type_hints(model.forward) == typing.get_type_hints(stock.forward)
    empty = {"input_ids": torch.zeros(0, 5, dtype=torch.long), "attention_mask": torch.zeros(0, 5, dtype=torch.long)}
    outcomes = []
    for each in (model, stock):
        try:
            outcomes.append(tuple(each(**empty).logits.shape))
        except RuntimeError:
            outcomes.append("RuntimeError")
    assert outcomes[0] == outcomes[1], outcomes


class _CountingStack(list):
    """The per-thread boundary stack, counting what is pushed on it."""

    pushes = 0

    def append(self, entry: object) -> None:
        self.pushes += 1
        super().append(entry)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2", "lfm2"])
def test_a_packed_forward_pushes_its_boundaries_once(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One boundary object per forward, put in effect once: the decoder layers, the backbone inside the head model
    and the native mixer calls that run on it push nothing, and the stack is empty again afterwards."""
    from packfree_plugin.forward import context

    model, _ = fresh_pair(model_type)
    batch = packed_row([torch.tensor(s) for s in samples_of(LENGTHS)])
    stack = _CountingStack()
    monkeypatch.setattr(context._STACK, "items", stack)
    model(**batch).logits.sum().backward()
    assert (stack.pushes, list(stack)) == (1, [])
