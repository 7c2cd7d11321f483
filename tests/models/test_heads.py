"""Sequence-classification / reward heads on packed rows: one pooled output per sample, equal (logits, loss and
gradients) to stock transformers running each sample alone, in float64; unpacked calls untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, DataCollatorWithFlattening

from packfree_plugin.gate.shrink import tiny_config_for
from tests.conftest import assert_close

# decoders pool their last non-padding token through `score`; encoders pool [CLS] (BERT's pooler, ALBERT's
# linear pooler over the encoder output, DistilBERT / ELECTRA reading the sequence output)
HEAD_TYPES = ["llama", "qwen2", "gpt2", "gpt_neox", "bert", "albert", "distilbert", "electra"]
PAD = 0


def _config(model_type: str):
    config = tiny_config_for(model_type)
    config.num_labels = 3
    config.pad_token_id = PAD
    config.get_text_config().pad_token_id = PAD
    return config


def build(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(packfree head, stock head) with the same float64 weights, eval mode (dropout off)."""
    config = _config(model_type)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="packfree").double().eval()
    stock_config = _config(model_type)
    try:
        stock = AutoModelForSequenceClassification.from_config(stock_config, attn_implementation="sdpa")
    except ValueError:
        stock = AutoModelForSequenceClassification.from_config(stock_config, attn_implementation="eager")
    stock.load_state_dict(model.state_dict())
    return model, stock.double().eval()


def samples_for(lengths: list[int], *, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=generator) for n in lengths]


def flattened(samples: list[torch.Tensor], *, collator: bool) -> dict:
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=collator, return_seq_idx=collator)(
        [{"input_ids": s.tolist()} for s in samples])
    batch.pop("labels")
    return dict(batch)


@pytest.mark.parametrize("collator", [False, True], ids=["position_ids", "collator"])
@pytest.mark.parametrize("model_type", HEAD_TYPES)
def test_packed_head_pools_each_sample(model_type: str, collator: bool) -> None:
    model, stock = build(model_type)
    samples = samples_for([7, 3, 11, 5])
    labels = torch.tensor([0, 2, 1, 2])
    out = model(**flattened(samples, collator=collator), labels=labels)
    assert out.logits.shape == (4, 3)
    alone = torch.cat([stock(input_ids=s[None]).logits for s in samples])
    assert_close(out.logits, alone, atol=1e-10, rtol=1e-8, what=f"{model_type} pooled logits")
    assert_close(out.loss, torch.nn.functional.cross_entropy(alone, labels), atol=1e-10, rtol=1e-8,
                 what=f"{model_type} loss")


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_packed_head_gradients_equal_alone(model_type: str) -> None:
    model, stock = build(model_type)
    samples = samples_for([6, 9, 4], seed=1)
    labels = torch.tensor([1, 0, 2])
    model(**flattened(samples, collator=False), labels=labels).loss.backward()
    total = sum(torch.nn.functional.cross_entropy(stock(input_ids=s[None]).logits, labels[i:i + 1])
                for i, s in enumerate(samples)) / len(samples)
    total.backward()
    stock_grads = dict(stock.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            assert stock_grads[name].grad is None or not stock_grads[name].grad.any(), name
            continue
        assert_close(parameter.grad, stock_grads[name].grad, atol=1e-9, rtol=1e-7, what=f"{model_type} grad {name}")


def test_decoder_head_pools_the_last_token_that_is_not_padding() -> None:
    """A sample ending in pad_token_id (pad = eos, as many tokenizers set it) is pooled where stock pools it alone:
    at its rightmost other token; a sample of padding only at its first token."""
    model, stock = build("llama")
    samples = [torch.tensor([5, 6, 7, PAD, PAD]), torch.tensor([8, 9]), torch.tensor([PAD, PAD, PAD])]
    out = model(**flattened(samples, collator=False))
    alone = torch.cat([stock(input_ids=s[None]).logits for s in samples])
    assert_close(out.logits, alone, atol=1e-10, rtol=1e-8, what="pooled at the last non-padding token")


def test_two_packed_rows_give_samples_row_major() -> None:
    model, stock = build("qwen2")
    rows = [samples_for([4, 6], seed=2), samples_for([3, 3, 4], seed=3)]
    input_ids = torch.stack([torch.cat(row) for row in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in rows])
    out = model(input_ids=input_ids, position_ids=position_ids)
    alone = torch.cat([stock(input_ids=s[None]).logits for row in rows for s in row])
    assert_close(out.logits, alone, atol=1e-10, rtol=1e-8, what="5 samples over 2 rows")


@pytest.mark.parametrize("model_type", ["llama", "bert", "albert"])
def test_unpacked_batches_are_stock(model_type: str) -> None:
    """One sample per row, right-padded with a mask: the head's own forward, one output per row."""
    model, stock = build(model_type)
    samples = samples_for([5, 8], seed=4)
    input_ids = torch.full((2, 8), PAD)
    attention_mask = torch.zeros(2, 8, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, :len(sample)] = sample
        attention_mask[row, :len(sample)] = 1
    got = model(input_ids=input_ids, attention_mask=attention_mask).logits
    expected = stock(input_ids=input_ids, attention_mask=attention_mask).logits
    assert got.shape == (2, 3)
    assert_close(got, expected, atol=1e-10, rtol=1e-8, what=f"{model_type} padded batch")


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_one_label_per_row_is_refused_on_a_packed_row(model_type: str) -> None:
    model, _ = build(model_type)
    with pytest.raises(ValueError, match=r"one output per packed sample: the batch holds 3 samples"):
        model(**flattened(samples_for([3, 4, 5]), collator=False), labels=torch.tensor([1]))


def test_tuple_outputs_hold_the_pooled_logits() -> None:
    model, stock = build("llama")
    samples = samples_for([4, 5], seed=5)
    logits = model(**flattened(samples, collator=False), return_dict=False)[0]
    assert_close(logits, torch.cat([stock(input_ids=s[None]).logits for s in samples]), atol=1e-10, rtol=1e-8,
                 what="return_dict=False")


def test_the_gate_admits_pooled_heads_on_proof() -> None:
    """A head class the sweep has not recorded is proved on a tiny copy at load, and now passes."""
    config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, vocab_size=64)
    AutoModelForSequenceClassification.from_config(config, attn_implementation="packfree")
