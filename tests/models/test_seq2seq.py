"""Encoder-decoder models under packfree. Packed rows whose decoder inputs the model shifts from ``input_ids``
are exact (``tests/models/test_positions.py``), so the gate admits BART, mBART and PLBart; the others need
``decoder_input_ids``, which the load-time proof does not pass, so the gate refuses them. Loaded anyway with
the documented opt-out, unpacked use is exact: an encoder and a decoder of different lengths each get
boundaries from their own inputs (the decoder used to be checked against the encoder's), so ordinary seq2seq
training and ``generate()`` equal stock."""

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


SHIFTING_TYPES = ["bart", "mbart", "plbart"]
"""Types whose model shifts ``input_ids`` into decoder inputs when none are given (the proof's packed row)."""


@pytest.mark.parametrize("model_type", sorted(set(SEQ2SEQ_TYPES) - set(SHIFTING_TYPES)))
def test_the_gate_refuses_seq2seq_it_cannot_prove(model_type: str) -> None:
    packfree_plugin.register()
    with pytest.raises(ValueError, match=f"model type '{model_type}'"):
        AutoModelForSeq2SeqLM.from_config(_config(model_type), attn_implementation="packfree")


@pytest.mark.parametrize("model_type", SHIFTING_TYPES)
def test_the_gate_admits_seq2seq_proved_exact(model_type: str) -> None:
    packfree_plugin.register()
    AutoModelForSeq2SeqLM.from_config(_config(model_type), attn_implementation="packfree")


@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_unpacked_seq2seq_with_unequal_lengths_equals_stock(model_type: str, monkeypatch) -> None:
    monkeypatch.setenv("PACKFREE_TRUST_UNVERIFIED", "1")
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
