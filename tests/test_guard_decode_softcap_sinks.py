"""Decode steps keep the attention's logit softcap and its sinks: every model type whose attention passes a softcap
or sinks to the attention function generates with packfree what stock eager generates, token for token, with the
same logits at every step. Each model is made so that the feature bites in the decode steps (scores beyond the cap;
sinks that take a share of the attention), and the test asserts that it does, so it cannot pass because the feature
changed nothing.

Left out: the types that never decode (VideoPrism's video encoder, OpenAI's privacy filter, a bidirectional token
classifier) and HY-V4-VL, whose text attention is HY-V4's, covered here."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from packfree_plugin.cli.tiny import load_model, tiny_config
from tests.conftest import assert_close
from tests.helpers import samples_of

SOFTCAP = ["gemma2", "vaultgemma", "t5gemma"]
"""Attention that passes ``softcap`` (``attn_logit_softcapping``) to the attention function."""
SINKS = ["gpt_oss", "flint", "granite_swa", "granitemoe_swa", "hy_v4", "mimo_v2_flash", "deepseek_v4", "inkling2_text",
         "inkling2_loop_text"]
"""Attention that passes ``s_aux`` or ``sinks`` to the attention function."""
SOFTCAP_AT = 0.5
"""The cap the softcap models get (their q and k projections scaled up so that decode-step scores exceed it)."""
TOLERANCE = 2e-5
"""Stock eager runs its softmax in float32 for float64 inputs (about 1e-6 on these logits)."""


@dataclass
class DecodeScores:
    """What stock's eager attention saw on decode steps (one query per row): the largest ``|q . k| * scaling`` and
    the largest share of the attention a sink took."""

    largest_score: float = 0.0
    largest_sink_share: float = 0.0
    calls: list[int] = field(default_factory=list)

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None, sinks: torch.Tensor | None) -> None:
        """``query [B, H, 1, D]``, ``key [B, Hkv, S, D]``, ``mask`` additive ``[B, 1, 1, S']`` or None; ``sinks
        [H]`` or ``[B, H, 1, 1]``."""
        if query.shape[2] != 1:
            return
        self.calls.append(1)
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = (query @ key.transpose(2, 3)).double() * scale
        self.largest_score = max(self.largest_score, float(scores.abs().max()))
        if sinks is not None:
            if mask is not None:
                scores = scores + mask[..., : scores.shape[-1]].double()
            sinks = sinks.double().reshape(1, -1, 1, 1) if sinks.ndim == 1 else sinks.double()
            share = torch.exp(sinks - torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), sinks))
            self.largest_sink_share = max(self.largest_sink_share, float(share.max()))


@pytest.fixture
def decode_scores(monkeypatch: pytest.MonkeyPatch) -> Callable[[torch.nn.Module], DecodeScores]:
    """Record what the eager attention functions of a stock model's modeling modules see on decode steps."""

    def watch(model: torch.nn.Module) -> DecodeScores:
        seen = DecodeScores()
        modules = {sys.modules[type(m).__module__] for m in model.modules()}
        for module in modules:
            eager = getattr(module, "eager_attention_forward", None)
            if eager is None:
                continue

            def recording(layer, query, key, value, attention_mask, *args, _eager=eager, **kwargs):
                sinks = kwargs.get("s_aux", kwargs.get("sinks", getattr(layer, "sinks", None)))
                seen.record(layer, query, key, attention_mask, kwargs.get("scaling"),
                            sinks if isinstance(sinks, torch.Tensor) else None)
                return _eager(layer, query, key, value, attention_mask, *args, **kwargs)

            monkeypatch.setattr(module, "eager_attention_forward", recording)
        return seen

    return watch


def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree, stock eager)``, float64, same weights; softcap models get :data:`SOFTCAP_AT` and q and k
    projections scaled by 8, sink models sinks spread over ``[-1, 2]``."""
    if model_type == "t5gemma":
        def build(implementation: str) -> torch.nn.Module:
            torch.manual_seed(0)
            return AutoModelForSeq2SeqLM.from_config(tiny_config("t5gemma"), attn_implementation=implementation,
                                                      dtype=torch.float64).eval()
    else:
        def build(implementation: str) -> torch.nn.Module:
            return load_model(model_type, implementation)
    model, stock = build("packfree"), build("eager")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator, dtype=parameter.dtype) * 3 - 1)
            elif model_type in SOFTCAP and name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8)
    stock.load_state_dict(model.state_dict())
    if model_type in SOFTCAP:
        for each in (model, stock):
            for module in each.modules():
                if getattr(module, "attn_logit_softcapping", None) is not None:
                    module.attn_logit_softcapping = SOFTCAP_AT
    return model, stock


def _generated(model: torch.nn.Module, model_type: str) -> object:
    """Greedy ``generate()`` of 4 tokens for two prompts of 6 tokens, with every step's logits. (No padding: stock
    eager turns a padded row into NaN in float64, its float64-min mask meeting a float32 softmax.)"""
    input_ids = torch.tensor(samples_of([6, 6], seed=2))
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    if model_type == "t5gemma":
        options["decoder_start_token_id"] = 1
    return model.generate(input_ids=input_ids, **options)


def _assert_generate_equals_stock(model_type: str, model: torch.nn.Module, stock: torch.nn.Module) -> None:
    mine, theirs = _generated(model, model_type), _generated(stock, model_type)
    assert torch.equal(mine.sequences, theirs.sequences), f"{model_type}: {mine.sequences} != {theirs.sequences}"
    for step, (a, b) in enumerate(zip(mine.logits, theirs.logits, strict=True)):
        assert_close(a, b, atol=TOLERANCE, rtol=0, what=f"{model_type} decode step {step}")


@pytest.mark.parametrize("model_type", SOFTCAP)
def test_decode_steps_keep_the_softcap(model_type: str, decode_scores: Callable) -> None:
    model, stock = _pair(model_type)
    seen = decode_scores(stock)
    _assert_generate_equals_stock(model_type, model, stock)
    assert seen.calls, f"{model_type}: stock's eager attention saw no decode step"
    assert seen.largest_score > 2 * SOFTCAP_AT, f"{model_type}: decode scores {seen.largest_score} stay under the cap"


@pytest.mark.parametrize("model_type", SINKS)
def test_decode_steps_keep_the_sinks(model_type: str, decode_scores: Callable) -> None:
    model, stock = _pair(model_type)
    seen = decode_scores(stock)
    _assert_generate_equals_stock(model_type, model, stock)
    assert seen.calls, f"{model_type}: stock's eager attention saw no decode step"
    assert seen.largest_sink_share > 0.1, f"{model_type}: the sinks took {seen.largest_sink_share} of the attention"


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_a_decode_step_in_training_drops_attention_weights_as_stock(model_type: str) -> None:
    """A decode step taken in training mode (a rollout from a model left in train()) with attention dropout, softcap
    or sinks: packfree's eager step drops the weights stock's eager drops, from the same random state (mutant: the
    step's options lost the dropout, and nothing was dropped)."""
    from transformers import DynamicCache

    model, stock = _pair(model_type)
    steps = []
    for each in (model, stock):
        for module in each.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.5
        cache = DynamicCache(config=each.config)
        with torch.no_grad():
            each(input_ids=torch.tensor(samples_of([6], seed=2)), cache=cache, use_cache=True)
            each.train()
            for seed in (3, 3, 4):  # the same state twice, then another: the step's dropout follows the state
                torch.manual_seed(seed)
                steps.append(each(input_ids=torch.tensor([[11]]), cache=cache, use_cache=False).logits)
        each.eval()
    ours, theirs = steps[:3], steps[3:]
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a, b, atol=TOLERANCE, rtol=0, what=f"{model_type} training decode step {step}")
    assert (theirs[2] - theirs[0]).abs().max() > 1e-3, f"{model_type}: stock's dropout changed nothing"
