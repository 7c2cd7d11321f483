"""An int8-quantized base (torchao's weight-only int8, which runs on the CPU) with LoRA adapters: a packed row
gives each sample what the same quantized model gives it alone."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from packfree_plugin.gate.audit import packed_row
from tests.conftest import assert_close
from tests.helpers import fresh_pair, samples_of


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_int8_base_with_lora_packs_exactly(model_type: str) -> None:
    model, stock = fresh_pair(model_type, dtype=torch.float32)
    for twin in (model, stock):
        quantize_(twin, Int8WeightOnlyConfig())
    assert "Int8" in type(model.get_input_embeddings().weight).__name__ or any(
        "Int8" in type(module.weight).__name__ for module in model.modules() if isinstance(module, torch.nn.Linear)
    ), "torchao left every weight in floating point: the test would not see a quantized base"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    model, stock = get_peft_model(model, lora), get_peft_model(stock, copy.deepcopy(lora))
    stock.load_state_dict(model.state_dict())
    lengths = [5, 7, 4]
    samples = samples_of(lengths)
    with torch.no_grad():
        packed = model(**packed_row([torch.tensor(s) for s in samples])).logits[0]
        for index, (piece, sample) in enumerate(zip(packed.split(lengths), samples)):
            alone = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
            assert_close(piece, alone, atol=1e-5, rtol=0, what=f"{model_type} int8 + LoRA sample {index}")
