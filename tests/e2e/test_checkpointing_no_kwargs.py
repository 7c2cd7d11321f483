"""Gradient checkpointing where the decoder layers receive no ``**kwargs`` (as a layer whose signature has none, or a
wrapper that drops them): their mixers find the boundaries only on the per-thread stack, and backward's recomputation
of each layer runs outside the model's forward, so it must run on the boundaries the checkpoint function carried from
the first call. One model type per mixer family packfree runs, reentrant and not, in train mode: the packed row's
loss and every gradient equal each sample alone on stock (float64).

Families left out for their cost (each over 20 s for one checkpointed pair on the shared 2-core machine, where the
others take 1-5 s): ``cca`` (Zaya), ``ple`` (Qwen4-Exp), ``inkling2_conv`` (Inkling2)."""

from __future__ import annotations

import inspect
from functools import cache

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from packfree_plugin.cli.tiny import load_model
from tests.conftest import assert_close
from tests.helpers import gradients, samples_of

FAMILIES = {
    # model type: the mixer family (classes.CLASSES) its decoder layers run
    "qwen3_next": "gated_delta",
    "kimi_linear": "kimi_delta",
    "mamba2": "mamba2",
    "bamba": "mamba2 beside attention",
    "mamba": "mamba",
    "jamba": "mamba beside attention",
    "lfm2": "short_conv",
    "inkling_text": "inkling_conv",
    "minimax": "lightning",
    "rwkv": "rwkv_time_mix, rwkv_channel_mix",
    "recurrent_gemma": "rg_lru",
    "xlstm": "mlstm",
}
LENGTHS = [5, 3, 7]
TOLERANCE = 1e-6
"""Relative to the largest gradient: several stock mixers scan in float32 inside a float64 model (about 1e-7 here);
a recomputation on other boundaries than the first call's moves gradients by 1e-2 or more."""


def _without_kwargs(layer: torch.nn.Module) -> None:
    """Give ``layer`` an instance forward that passes on only its forward's named parameters, dropping what its
    ``**kwargs`` would receive (``packfree_boundaries`` among them)."""
    parameters = inspect.signature(type(layer).forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    forward = layer.forward

    def stripped(*args: object, **kwargs: object) -> object:
        return forward(*args, **{name: value for name, value in kwargs.items() if name in named})

    layer.forward = stripped


def _packed_batch() -> dict[str, torch.Tensor]:
    """``input_ids``, ``position_ids`` and ``labels`` ``[1, T]`` of the samples of :data:`LENGTHS` in one row."""
    ids = torch.tensor([sum(samples_of(LENGTHS), [])])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}


@cache
def _alone(model_type: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """Stock (eager, in train mode) on each sample alone: its weights, the packed row's loss (the mean of every
    predicted token's cross entropy over all samples) and its gradients."""
    stock = load_model(model_type, "eager").train()
    predicted = sum(n - 1 for n in LENGTHS)
    total = torch.zeros((), dtype=torch.float64)
    for sample in samples_of(LENGTHS):
        tokens = torch.tensor([sample])
        logits = stock(input_ids=tokens, use_cache=False).logits[0, :-1].double()
        loss = torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="sum") / predicted
        loss.backward()
        total += loss.detach()
    return stock.state_dict(), total, gradients(stock)


def _checkpointed(model_type: str, reentrant: bool) -> torch.nn.Module:
    """The packfree model (train mode) checkpointing every decoder layer, each receiving no kwargs."""
    model = load_model(model_type, "packfree").train()
    model.load_state_dict(_alone(model_type)[0])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    for layer in layers:
        _without_kwargs(layer)
    return model


def _packed_loss(model: torch.nn.Module, **extra: object) -> torch.Tensor:
    """The packed row's causal-LM loss in float64 (transformers' own loss casts the logits to float32, and Mamba's
    and xLSTM's heads return float32 logits); ``extra`` goes to the call with the batch."""
    batch = _packed_batch()
    logits = model(**batch, **extra).logits[0, :-1].double()
    return torch.nn.functional.cross_entropy(logits, batch["labels"][0, 1:], ignore_index=-100)


def _compare(model: torch.nn.Module, model_type: str, **extra: object) -> None:
    loss = _packed_loss(model, **extra)
    loss.backward()
    _, expected_loss, expected = _alone(model_type)
    assert_close(loss.detach(), expected_loss, atol=TOLERANCE, rtol=0, what=f"{model_type} loss")
    mine = gradients(model)
    assert mine.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    for name, gradient in mine.items():
        assert_close(gradient, expected[name], atol=TOLERANCE * scale, rtol=0, what=f"{model_type} {name}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_recomputation_of_layers_without_kwargs_uses_the_first_call_s_boundaries(model_type: str,
                                                                                  reentrant: bool) -> None:
    _compare(_checkpointed(model_type, reentrant), model_type)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_boundaries_built_ahead_reach_the_recomputation_of_layers_without_kwargs(model_type: str,
                                                                                 reentrant: bool) -> None:
    """The caller builds the boundaries and passes ``packfree_boundaries``: no batch is read, so the entry wraps no
    checkpoint function, and each layer's pre-hook wraps its own at the first call; the recomputation then runs on
    the first call's boundaries, as each sample alone shows (mutant: the pre-hook looked for the checkpoint function
    under another name, and the recomputation ran the packed row unprotected)."""
    from packfree_plugin import Boundaries

    given = Boundaries.from_position_ids(_packed_batch()["position_ids"])
    _compare(_checkpointed(model_type, reentrant), model_type, packfree_boundaries=given)
