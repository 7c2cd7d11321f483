"""PEFT LoRA on a packfree model: a packed row's loss and LoRA gradients equal the stock padded batch's."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tests.conftest import assert_close
from tests.helpers import fresh_pair, gradients, padded_batch, samples_of

peft = pytest.importorskip("peft")

FLOAT32_INSIDE = {"qwen3_next": 2e-5}
"""Gradient tolerance relative to each tensor's largest entry. Stock Qwen3-Next runs its gated delta rule in float32
inside a float64 model: 4.5e-6 of the largest entry off on peft 0.22 (torch 2.13 CPU). A leak across samples is
off by more than 1e-2."""


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_lora_packed_equals_padded(model_type: str) -> None:
    from peft import LoraConfig, get_peft_model

    model, stock = fresh_pair(model_type)
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    lora = get_peft_model(model, LoraConfig(**config))
    lora_stock = get_peft_model(stock, LoraConfig(**config))
    lora_stock.load_state_dict(lora.state_dict())
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    samples = samples_of([6, 11, 3, 9])
    packed = DataCollatorWithFlattening()([{"input_ids": s} for s in samples])
    packed_loss = lora(**packed).loss
    packed_loss.backward()
    padded_loss = lora_stock(**padded_batch(samples), use_cache=False).loss
    padded_loss.backward()
    assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-6, what="loss")
    mine, theirs = gradients(lora), gradients(lora_stock)
    assert mine.keys() == theirs.keys() and len(mine) == len(trainable)
    for name in mine:
        scale = FLOAT32_INSIDE.get(model_type, 1e-9) * float(theirs[name].abs().max())
        assert_close(mine[name], theirs[name], atol=scale, rtol=0, what=name)


@pytest.mark.parametrize("wrap", ["lora", "modules_to_save"])
def test_peft_wrapped_score_head_pools_each_sample(wrap: str) -> None:
    """PEFT wraps ``score`` (LoRA on it, or ``modules_to_save=["score"]``, as TRL's reward recipe does): each packed
    sample still gets its own last-token score, equal to stock's on the sample alone, gradients included."""
    from peft import LoraConfig, get_peft_model

    from tests.models.test_heads import build, flattened, samples_for

    model, stock = build("llama")
    target = dict(target_modules=["q_proj", "score"]) if wrap == "lora" else \
        dict(target_modules=["q_proj"], modules_to_save=["score"])
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, task_type="SEQ_CLS", **target)
    torch.manual_seed(1)
    lora, lora_stock = get_peft_model(model, LoraConfig(**config)), get_peft_model(stock, LoraConfig(**config))
    lora_stock.load_state_dict(lora.state_dict())
    samples = samples_for([7, 3, 11, 5])
    packed = lora(**flattened(samples, collator=True)).logits
    alone = torch.cat([lora_stock(input_ids=s[None]).logits for s in samples])
    assert packed.shape == alone.shape == (4, 3)
    assert_close(packed, alone, atol=1e-10, rtol=1e-8, what=f"{wrap} pooled logits")
    packed.square().sum().backward()
    alone.square().sum().backward()
    mine, theirs = gradients(lora), gradients(lora_stock)
    assert mine.keys() == theirs.keys() and any("score" in name for name in mine)
    for name in mine:
        assert_close(mine[name], theirs[name], atol=1e-9, rtol=1e-7, what=name)
