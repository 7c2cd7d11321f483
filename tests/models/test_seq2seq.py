"""Encoder-decoder models under packfree. Packed rows are exact (``tests/models/test_positions.py``), so the gate
admits the BART family; unpacked use is exact: an encoder and a decoder of different lengths each get boundaries
from their own inputs (the decoder used to be checked against the encoder's), a decoder never takes the encoder's
padding, so ordinary seq2seq training and ``generate()`` equal stock."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import packfree_plugin
from tests.conftest import assert_close

SEQ2SEQ_TYPES = ["bart", "mbart", "marian", "pegasus", "plbart", "blenderbot"]


def _config(model_type: str):
    return AutoConfig.for_model(model_type, vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=1)


def _pair(model_type: str):
    packfree_plugin.register()
    config = _config(model_type)
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                              dtype=torch.float64).eval()
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="packfree", dtype=torch.float64).eval()
    model.load_state_dict(stock.state_dict())
    return model, stock


@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_the_gate_admits_seq2seq_proved_exact(model_type: str) -> None:
    """The load-time proof packs samples into the encoder and the decoder alike (decoder inputs = input ids)."""
    packfree_plugin.register()
    AutoModelForSeq2SeqLM.from_config(_config(model_type), attn_implementation="packfree")


@pytest.mark.parametrize("model_type", ["bart", "mbart"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_seq2seq_without_decoder_inputs_equals_stock(model_type: str, side: str) -> None:
    """The decoder inputs the model shifts from a padded ``input_ids`` are not padded for the decoder: stock masks
    them causally only, so the encoder's padding must not become the decoder's (it was, 0.0125 off)."""
    model, stock = _pair(model_type)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    if side == "left":
        mask[0, :3] = 0
    else:
        mask[0, 5:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        assert_close(model(input_ids=ids, attention_mask=mask).logits, stock(input_ids=ids, attention_mask=mask).logits,
                     atol=1e-10, rtol=0, what=f"{model_type} {side}-padded")


@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_unpacked_seq2seq_with_unequal_lengths_equals_stock(model_type: str) -> None:
    model, stock = _pair(model_type)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    decoder_ids = torch.randint(3, 128, (2, 5), generator=generator)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        theirs = stock(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        assert_close(ours, theirs, atol=1e-10, rtol=0, what=f"{model_type} forward")
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
        generated, expected = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert torch.equal(generated.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(generated.logits, expected.logits)):
        assert_close(a, b, atol=1e-10, rtol=0, what=f"{model_type} generate step {step}")


def test_packed_seq2seq_labels_follow_the_seq2seq_contract() -> None:
    """A seq2seq model's labels are its decoder targets, shifted into decoder inputs per sample: a label at a sample's
    first token is trained (the causal-LM rule of -100 there does not apply) and equals each sample alone."""
    model, stock = _pair("bart")
    samples = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, labels=ids)
        alone = [stock(input_ids=s[None], labels=s[None]) for s in samples]
    expected = torch.cat([out.logits for out in alone], dim=1)
    assert_close(packed.logits, expected, atol=1e-10, rtol=0, what="packed seq2seq logits with labels")
    mean = sum(out.loss * len(s) for out, s in zip(alone, samples)) / sum(len(s) for s in samples)
    assert_close(packed.loss, mean, atol=1e-10, rtol=0, what="packed seq2seq loss")
