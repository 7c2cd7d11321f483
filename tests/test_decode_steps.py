"""Decode steps do no boundary work: one new token per row from a cache carries no packing signal, so ``generate()``
reads, builds and checks boundaries for its prompt only, and its tokens equal stock's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from packfree_plugin.forward import hook, reading
from packfree_plugin.boundaries import Boundaries
from tests.helpers import shared_pair

MODELS = ("llama", "qwen3_next", "mamba2")
"""Attention, a Gated DeltaNet hybrid, Mamba2: each kind of cache a decode step continues."""


def _prompts() -> dict[str, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, left-padded as generate() expects."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 128, (2, 7), generator=generator)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    input_ids[1, :3], attention_mask[1, :3] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _counting(calls: Counter[str], name: str, function: Callable) -> Callable:
    def counted(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)

    return counted


def _generate(model: torch.nn.Module, new_tokens: int, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, Counter]:
    """Greedy ``generate`` of ``new_tokens`` tokens, and the boundary work done on the way: batches read, cache
    contents inspected, boundaries built."""
    calls: Counter[str] = Counter()
    with monkeypatch.context() as patch:
        patch.setattr(hook, "_read_batch", _counting(calls, "batch read", hook._read_batch))
        patch.setattr(reading, "cache_holds_tokens",
                      _counting(calls, "cache inspected", reading.cache_holds_tokens))
        patch.setattr(Boundaries, "__init__", _counting(calls, "boundaries built", Boundaries.__init__))
        out = model.generate(**_prompts(), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out, calls


@pytest.mark.parametrize("model_type", MODELS)
def test_decode_steps_do_no_boundary_work_and_generate_equals_stock(model_type: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Six new tokens cost the boundary work of one (the prompt's forward, which does some: the count can see it),
    and the generated tokens are stock's."""
    model, stock = shared_pair(model_type)
    _, prompt_only = _generate(model, 1, monkeypatch)
    tokens, with_decoding = _generate(model, 6, monkeypatch)
    assert prompt_only["batch read"] > 0 and prompt_only["boundaries built"] > 0
    assert with_decoding == prompt_only, f"decode steps did boundary work: {dict(with_decoding - prompt_only)}"
    expected = stock.generate(**_prompts(), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, expected), f"generated {tokens.tolist()}, stock {expected.tolist()}"


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_generate_under_inference_mode_equals_stock(model_type: str) -> None:
    """Under ``torch.inference_mode`` (tensors without a version counter, on which packfree keeps the batch's host
    copy and its derived forms) the prompt's forward reads its batch and generate() gives stock's tokens."""
    model, stock = shared_pair(model_type)
    with torch.inference_mode():
        tokens = model.generate(**_prompts(), max_new_tokens=4, do_sample=False, pad_token_id=0)
        expected = stock.generate(**_prompts(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, expected), f"generated {tokens.tolist()}, stock {expected.tolist()}"
