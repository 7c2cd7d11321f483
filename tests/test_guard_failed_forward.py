"""A forward that raises after it entered leaves nothing behind: the per-thread stack (``forward/context.py``) is empty
again, and the next forward, even one whose batch the failed forward's boundaries would fit (the same shape with
other samples, or no packing signal at all), equals each sample alone on stock. Raised from a user's forward hook on
a decoder layer, and from inside the attention or mixer layer, in inference and in training, and in ``generate()``'s
prefill and decode steps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from packfree_plugin.mixers import seam
from packfree_plugin.forward import context
from packfree_plugin.gate.audit import packed_row
from tests.conftest import assert_close
from tests.helpers import shared_pair, samples_of

TOLERANCE = {"llama": 1e-9, "mamba2": 1e-6}
"""float64 tolerance against stock (stock Mamba2's eager path computes in float32)."""
RAISING_AT = {
    # model type: (a decoder layer, a module inside the first layer's attention or mixer: in Mamba2's, inside the
    # native call that routes its kernels)
    "llama": ("model.layers.1", "model.layers.0.self_attn.o_proj"),
    "mamba2": ("backbone.layers.1", "backbone.layers.0.mixer.out_proj"),
}
FAILED, NEXT = [5, 3, 6], [4, 7, 3]
"""The samples of the forward that raises, and of the next one: the same row length, another layout."""


class Planted(RuntimeError):
    """What the user's hook raises."""


@pytest.fixture(autouse=True)
def stack_restored() -> Iterator[None]:
    """Whatever a failing check leaves on this thread's stack is cleared, so later tests start from an empty one."""
    yield
    context._STACK.items.clear()
    context._STACK.layers_pushed.clear()
    seam._CALL.__init__()


@contextmanager
def raising(model: torch.nn.Module, path: str, *, on_call: int) -> Iterator[None]:
    """A forward hook on ``model.get_submodule(path)`` that raises :class:`Planted` on its ``on_call``-th call only."""
    calls = []

    def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
        calls.append(1)
        if len(calls) == on_call:
            raise Planted(f"raised by a hook on {path}")

    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def assert_nothing_left() -> None:
    """No boundaries, decoder-layer entry or native mixer call is left on this thread."""
    left = (list(context._STACK.items), list(context._STACK.layers_pushed), seam.running_layer())
    assert left == ([], [], None), f"the failed forward left on the stack: {left}"


def assert_next_forwards_exact(model_type: str) -> None:
    """The same row length with other samples equals each sample alone on stock; the same row with no packing signal
    (one sample) equals stock on the row."""
    model, stock = shared_pair(model_type)
    samples = samples_of(NEXT, seed=7)
    batch = packed_row([torch.tensor(s) for s in samples])
    tolerance = TOLERANCE[model_type]
    with torch.no_grad():
        packed = model(**batch).logits[0]
        for index, (piece, sample) in enumerate(zip(packed.split(NEXT), samples, strict=True)):
            alone = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
            assert_close(piece, alone, atol=tolerance, rtol=0, what=f"{model_type} next packed row, sample {index}")
        row = batch["input_ids"]
        assert_close(model(input_ids=row).logits, stock(input_ids=row, use_cache=False).logits, atol=tolerance,
                     rtol=0, what=f"{model_type} next row without a packing signal")


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("where", ["decoder layer", "inside the layer"])
@pytest.mark.parametrize("model_type", list(RAISING_AT))
def test_a_packed_forward_that_raises_leaves_nothing_behind(model_type: str, where: str, training: bool) -> None:
    model, _ = shared_pair(model_type)
    batch = packed_row([torch.tensor(s) for s in samples_of(FAILED)])
    path = RAISING_AT[model_type][where == "inside the layer"]
    try:
        with raising(model, path, on_call=1), pytest.raises(Planted), torch.set_grad_enabled(training):
            model.train(training)(**batch, labels=batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100))
    finally:
        model.eval().zero_grad()
    assert_nothing_left()
    assert_next_forwards_exact(model_type)


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, left-padded as ``generate()`` expects (the rows of the failed forward)."""
    input_ids = torch.tensor(samples_of([7, 7], seed=3))
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3], attention_mask[1, :3] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("on_call", [1, 3], ids=["prefill", "decode step"])
@pytest.mark.parametrize("model_type", ["llama", "mamba2"])
def test_generate_that_raises_leaves_nothing_behind(model_type: str, on_call: int) -> None:
    """``generate()`` raising in its prefill (boundaries with the prompts' padding in effect) or in its last decode
    step (None in effect); then rows of the prompts' shape without a mask equal stock."""
    model, stock = shared_pair(model_type)
    options = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    with raising(model, RAISING_AT[model_type][0], on_call=on_call), pytest.raises(Planted):
        model.generate(**_prompts(), **options)
    assert_nothing_left()
    rows = _prompts()["input_ids"]
    with torch.no_grad():
        assert_close(model(input_ids=rows).logits, stock(input_ids=rows, use_cache=False).logits,
                     atol=TOLERANCE[model_type], rtol=0, what=f"{model_type} rows after the failed generate")
