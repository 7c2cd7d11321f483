"""Tiny causal LMs under packfree against stock transformers (eager) running each sample alone, in float64.

Covers: GQA/RoPE (Llama), sliding window (Mistral), q/k-norm (Qwen3), softcap + per-layer windows +
custom scaling (Gemma2), sinks + sliding + MoE (gpt-oss), absolute positions (GPT-2).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening, DynamicCache

import packfree_plugin
from packfree_plugin.attention import masks
from tests.conftest import TINY_CAUSAL_LM, assert_close, build_pair, reference_tolerance

MODEL_TYPES = list(TINY_CAUSAL_LM)
sample_lengths = st.lists(st.integers(1, 13), min_size=1, max_size=4)
# float64 logits of O(1): a leak moves them by 1e-2 or more. Tolerance depends on the stock reference.


@cache
def pair(model_type: str):
    return build_pair(model_type)


def random_samples(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 7 * len(lengths) + sum(lengths))
    return [torch.randint(3, 128, (n,), generator=generator) for n in lengths]


def alone_logits(stock, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [stock(input_ids=s[None], use_cache=False).logits[0] for s in samples]


def _returned_cache(out) -> object:
    """The cache a forward returned (``cache`` in transformers 5.24, ``past_key_values`` before)."""
    return out.get("cache", out.get("past_key_values"))


def packed_batch(samples: list[torch.Tensor], source: str) -> dict:
    """One flattened row as a collator would send it; ``source`` picks which boundary fields it carries."""
    features = [{"input_ids": s.tolist()} for s in samples]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    batch.pop("labels")
    if source == "position_ids":  # what TRL's padding-free path sends
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if source == "seq_idx":
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "seq_idx": batch["seq_idx"]}
    return dict(batch)  # "collator": cu_seq_lens_q/k, max_length_q/k, seq_idx, position_ids


@pytest.mark.parametrize("source", ["collator", "position_ids", "seq_idx"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
@given(lengths=sample_lengths)
def test_packed_logits_equal_each_sample_alone(model_type: str, source: str, lengths: list[int]) -> None:
    model, stock = pair(model_type)
    samples = random_samples(lengths)
    with torch.no_grad():
        out = model(**packed_batch(samples, source))  # default use_cache, as a new user calls it
    if len(lengths) > 1:
        assert _returned_cache(out) is None, "a packed forward must not return a cache"
    for index, (piece, expected) in enumerate(zip(out.logits[0].split(lengths), alone_logits(stock, samples))):
        assert_close(piece, expected, atol=reference_tolerance(model_type), rtol=0,
                     what=f"{model_type}/{source} sample {index}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@given(rows=st.lists(sample_lengths, min_size=2, max_size=3), tail=st.integers(0, 3))
def test_several_packed_rows_with_padding(model_type: str, rows: list[list[int]], tail: int) -> None:
    """B > 1: each row packs several samples and is right-padded to a common length."""
    model, stock = pair(model_type)
    seq_len = max(sum(r) for r in rows) + tail
    ids, positions, mask, samples = [], [], [], []
    for row_index, lengths in enumerate(rows):
        row_samples = random_samples(lengths, seed=row_index)
        samples.append(row_samples)
        pad = seq_len - sum(lengths)
        ids.append(torch.cat([*row_samples, torch.zeros(pad, dtype=torch.long)]))
        positions.append(torch.cat([*(torch.arange(n) for n in lengths), torch.arange(pad)]))
        mask.append(torch.cat([torch.ones(sum(lengths)), torch.zeros(pad)]).long())
    with torch.no_grad():
        logits = model(input_ids=torch.stack(ids), position_ids=torch.stack(positions),
                       attention_mask=torch.stack(mask)).logits
    for row_index, (lengths, row_samples) in enumerate(zip(rows, samples)):
        pieces = logits[row_index, : sum(lengths)].split(lengths)
        for piece, expected in zip(pieces, alone_logits(stock, row_samples)):
            assert_close(piece, expected, atol=reference_tolerance(model_type), rtol=0,
                         what=f"{model_type} row {row_index}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@settings(max_examples=4)
@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4), target=st.integers(0, 3))
def test_one_samples_loss_has_no_gradient_on_other_samples(model_type: str, lengths: list[int], target: int) -> None:
    model, stock = pair(model_type)
    target %= len(lengths)
    samples = random_samples(lengths)
    batch = packed_batch(samples, "position_ids")
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits[0]
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    logits[owner == target].square().sum().backward()
    assert torch.count_nonzero(embeds.grad[0, owner != target]) == 0, "gradient crossed a sample boundary"
    # ... and the target's own gradient is the one it gets when run alone
    alone = stock.get_input_embeddings()(samples[target][None]).detach().requires_grad_()
    stock(inputs_embeds=alone, use_cache=False).logits.square().sum().backward()
    assert_close(embeds.grad[0, owner == target], alone.grad[0], atol=reference_tolerance(model_type), rtol=1e-6,
                 what="own gradient")


def test_isolation_holds_in_training_mode_with_attention_dropout() -> None:
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_config

    config = tiny_config("llama")
    config.attention_dropout = 0.5
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.float64).train()
    lengths = [6, 4, 7]
    batch = packed_batch(random_samples(lengths), "position_ids")
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits[0]
    logits[6:10].sum().backward()
    assert torch.count_nonzero(embeds.grad[0, :6]) == 0 and torch.count_nonzero(embeds.grad[0, 10:]) == 0
    eval_logits = model.eval()(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits
    assert not torch.allclose(logits, eval_logits[0]), "dropout was not applied in training mode"


def padded_reference_pair(model_type: str):
    """Stock gemma2 eager turns padding into NaN in float64 (float64-min mask, float32 softmax): use float32."""
    if model_type == "gemma2":
        return build_pair(model_type, dtype=torch.float32), 1e-4
    return pair(model_type), 0.0


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_loss_and_gradients_equal_the_padded_batch(model_type: str) -> None:
    (model, stock), float32_tolerance = padded_reference_pair(model_type)
    lengths = [5, 11, 2, 8]
    samples = random_samples(lengths, seed=3)
    features = [{"input_ids": s.tolist()} for s in samples]
    packed = DataCollatorWithFlattening()(features)  # labels: -100 on each sample's first token
    longest = max(lengths)
    padded = {
        "input_ids": torch.stack([torch.cat([s, s.new_zeros(longest - len(s))]) for s in samples]),
        "attention_mask": torch.stack([torch.arange(longest) < len(s) for s in samples]).long(),
    }
    padded["labels"] = padded["input_ids"].masked_fill(padded["attention_mask"] == 0, -100)
    model.zero_grad()
    stock.zero_grad()
    packed_loss = model(**packed).loss
    packed_loss.backward()
    padded_loss = stock(**padded, use_cache=False).loss
    padded_loss.backward()
    # transformers computes the loss in float32 whatever the model dtype: compare at float32 precision
    tolerance = max(reference_tolerance(model_type), 1e-6, float32_tolerance)
    assert_close(packed_loss, padded_loss, atol=tolerance, rtol=0, what="loss")
    stock_grads = dict(stock.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            assert stock_grads[name].grad is None or torch.count_nonzero(stock_grads[name].grad) == 0, name
            continue
        assert_close(parameter.grad, stock_grads[name].grad, atol=tolerance, rtol=1e-5, what=name)
    model.zero_grad()
    stock.zero_grad()


def test_explicit_cache_with_a_packed_batch_is_refused() -> None:
    model, _ = pair("llama")
    batch = packed_batch(random_samples([3, 4]), "position_ids")
    with pytest.raises(ValueError, match="cache"):
        model(**batch, cache=DynamicCache(config=model.config))


def test_filled_cache_with_position_ids_restarting_is_refused() -> None:
    """A chunk whose ids restart at 0 after a filled cache would continue one cached sequence with several
    samples: refused, whichever source says the row is packed."""
    model, _ = pair("llama")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([random_samples([5])[0].tolist()]), past_key_values=cache, use_cache=True)
        chunk = torch.tensor([random_samples([6], seed=3)[0].tolist()])
        with pytest.raises(ValueError, match="position_ids restarting at 0"):
            model(input_ids=chunk, position_ids=torch.tensor([[5, 6, 7, 0, 1, 2]]), past_key_values=cache)
        model(input_ids=chunk, position_ids=torch.arange(5, 11)[None], past_key_values=cache)  # continuing: fine


def test_use_cache_passed_positionally_is_turned_off_for_a_packed_row() -> None:
    model, _ = pair("llama")
    samples = random_samples([3, 4])
    batch = packed_batch(samples, "position_ids")
    with torch.no_grad():
        # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, cache (past_key_values), inputs_embeds,
        #                          labels, use_cache, ...)
        out = model(batch["input_ids"], None, batch["position_ids"], None, None, None, True)
    assert _returned_cache(out) is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gpt2"])
def test_right_padded_batch_with_running_position_ids_equals_stock(model_type: str) -> None:
    """An ordinary padded batch that also passes ``position_ids = arange(T)``: each row's real tokens equal
    stock on the same padded batch (the padding is split off, not refused)."""
    model, stock = pair(model_type)
    samples = random_samples([4, 7])
    ids = torch.stack([torch.cat([s, s.new_zeros(7 - len(s))]) for s in samples])
    mask = (torch.arange(7) < torch.tensor([[4], [7]])).long()
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        mine = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        theirs = stock(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert_close(mine[0, :4], theirs[0, :4], atol=1e-9, rtol=0, what="row 0")
    assert_close(mine[1], theirs[1], atol=1e-9, rtol=0, what="row 1")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_a_prepared_mask_with_a_packed_row_is_refused(model_type: str) -> None:
    """A 4-D mask (even a correct block-diagonal one) beside packed ids used to drop the boundaries, so the
    hybrids' mixers ran unprotected: refused now, for any mask that is not the 2-D padding mask."""
    from packfree_plugin.cli.tiny import load_model

    model = load_model(model_type, "packfree", dtype=torch.float64, seed=0) if model_type != "llama" else pair("llama")[0]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    block = positions.new_zeros(7, 7, dtype=torch.bool)
    block[:3, :3] = block[3:, 3:] = True
    four_d = (block & torch.ones(7, 7, dtype=torch.bool).tril())[None, None]
    with torch.no_grad():
        for mask in (four_d, torch.ones(1, 7, 7, dtype=torch.bool)):
            with pytest.raises(ValueError, match="attention_mask was passed with a packed batch"):
                model(input_ids=torch.randint(3, 128, (1, 7)), attention_mask=mask, position_ids=positions)


def test_labels_must_not_cross_samples() -> None:
    """Labels copied from input_ids would train each sample's first token from the previous sample: refused;
    the collator's labels (-100 at every sample start) train exactly."""
    model, _ = pair("llama")
    samples = random_samples([4, 5, 3])
    features = [{"input_ids": s.tolist()} for s in samples]
    batch = DataCollatorWithFlattening()(features)
    with torch.no_grad():
        model(**batch)
        with pytest.raises(ValueError, match=r"labels at the first token of a packed sample \(row 0, token 4\)"):
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["input_ids"])


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_cu_seq_lens_without_position_ids_number_positions_per_sample(model_type: str) -> None:
    """Only the collator's cu_seq_lens: the model would count positions 0..T-1 across the row (GPT-2's learned
    positions were 0.60 off); packfree passes each sample's own positions."""
    model, stock = pair(model_type)
    samples = random_samples([5, 3, 6])
    batch = packed_batch(samples, "collator")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"],
                       cu_seq_lens_k=batch["cu_seq_lens_k"], max_length_q=batch["max_length_q"],
                       max_length_k=batch["max_length_k"]).logits[0]
    for index, (piece, expected) in enumerate(zip(logits.split([5, 3, 6]), alone_logits(stock, samples))):
        assert_close(piece, expected, atol=reference_tolerance(model_type), rtol=0, what=f"{model_type} sample {index}")


def test_three_plane_position_ids_on_a_model_without_mrope_are_refused_clearly() -> None:
    model, _ = pair("llama")
    positions = torch.tensor([[0, 1, 2, 0, 1]]).expand(3, 1, 5)
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[R, B, T\] ids are for multimodal RoPE"):
        model(input_ids=torch.randint(3, 128, (1, 5)), position_ids=positions)


def test_no_dense_mask_is_built_for_a_packed_batch(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a dense attention mask was requested for a packed batch")

    monkeypatch.setattr(masks, "sdpa_mask", refuse)
    model, _ = pair("mistral")
    with torch.no_grad():
        model(**packed_batch(random_samples([40, 30, 50]), "position_ids"))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_unpacked_generate_with_cache_matches_stock(model_type: str) -> None:
    """Ordinary left-padded generation with a KV cache: packfree == stock (sdpa, or eager where sdpa can't)."""
    (model, stock), float32_tolerance = padded_reference_pair(model_type)
    prompts = random_samples([4, 9, 6], seed=5)
    longest = max(len(p) for p in prompts)
    input_ids = torch.stack([torch.cat([p.new_zeros(longest - len(p)), p]) for p in prompts])
    attention_mask = torch.stack([torch.arange(longest) >= longest - len(p) for p in prompts]).long()
    kwargs = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    mine = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    theirs = stock.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(mine.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(mine.logits, theirs.logits)):
        assert_close(a, b, atol=max(reference_tolerance(model_type), float32_tolerance), rtol=0,
                     what=f"{model_type} generate step {step}")


def test_model_switched_to_packfree_after_loading_is_prepared() -> None:
    """``set_attn_implementation("packfree")`` prepares the model as loading with it does (tests/test_model_entry.py
    holds the rest): its packed row is exact with the default ``use_cache=True``."""
    _, stock = build_pair("llama", reference="sdpa")
    model = build_pair("llama", reference="sdpa")[1]
    model.set_attn_implementation("packfree")
    lengths = [5, 3, 8]
    samples = random_samples(lengths)
    with torch.no_grad():
        logits = model(**packed_batch(samples, "position_ids")).logits[0]
    for piece, expected in zip(logits.split(lengths), alone_logits(stock, samples)):
        assert_close(piece, expected, atol=1e-9, rtol=0, what="model switched after loading")


def test_attention_with_a_mask_of_its_own_in_a_packed_forward_is_refused(monkeypatch) -> None:
    """A layer whose model builds its mask outside the mask interface gets a dense tensor while the forward is
    packed: packfree cannot keep it inside each sample, so it raises instead of attending across samples."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model, _ = pair("llama")
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "packfree", sdpa_mask)
    with torch.no_grad(), pytest.raises(ValueError, match="attends with a mask of its own"):
        model(**packed_batch(random_samples([3, 4]), "position_ids"))
