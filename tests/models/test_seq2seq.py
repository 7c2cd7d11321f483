"""Encoder-decoder models under packfree, against each sample run alone on stock ``sdpa`` (``eager`` where a class has
no sdpa) in float64.

- Packed seq2seq (the BART family and t5/mt5/umt5): encoder rows and decoder rows packed with boundaries of their own
  (``position_ids`` or ``cu_seq_lens`` for the encoder, ``decoder_position_ids`` for the decoder), samples of unequal
  source and target lengths, both sides padded: every sample's logits, per-token losses and the gradients equal that
  sample alone, from labels only (packfree shifts each sample's labels) and from the collator's decoder inputs; also
  with gradient checkpointing, rows filled out of example order, and decoder rows as long as the encoder rows but
  split elsewhere. T5 builds its relative bias for the longest sample, not the row.
- Cross-attention that leaks (planted) is caught by the same comparison.
- Unpacked use: an encoder and a decoder of different lengths, padded batches and ``generate()`` equal stock.
- LongT5's local attention cannot be cut into samples: refused at load with its reason.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import packfree_plugin
from packfree_plugin import Boundaries
from packfree_plugin.packing import Seq2SeqPackedCollator
from tests.conftest import assert_close

BART_TYPES = ["bart", "mbart", "marian", "pegasus", "plbart", "blenderbot", "blenderbot-small", "bigbird_pegasus",
              "mvp"]
T5_TYPES = ["t5", "mt5", "umt5"]
SEQ2SEQ_TYPES = BART_TYPES + T5_TYPES
PAIRS = [(5, 3), (4, 7), (7, 5), (1, 4)]
"""(source, target) lengths: with budgets of 10 tokens the collator packs two rows, encoder rows of 9 and 8 tokens,
decoder rows of 10 and 9 (both sides padded, no target as long as its source)."""
BUDGET = 10
ATOL = 1e-10


def _config(model_type: str, **overrides):
    if model_type in (*T5_TYPES, "longt5"):
        return AutoConfig.for_model(model_type, vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_layers=2,
                                    num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                    relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                                    decoder_start_token_id=0, **overrides)
    extra = {"attention_type": "original_full"} if model_type == "bigbird_pegasus" else {}
    return AutoConfig.for_model(model_type, vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, decoder_start_token_id=1, **extra, **overrides)


def _pair(model_type: str, **overrides):
    """``(packfree model, stock model)``, float64, same weights; stock on sdpa, else eager."""
    packfree_plugin.register()
    config = _config(model_type, **overrides)
    torch.manual_seed(0)
    try:
        stock = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                  dtype=torch.float64)
    except ValueError:  # no sdpa path
        stock = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                                  dtype=torch.float64)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="packfree", dtype=torch.float64)
    model.load_state_dict(stock.state_dict())
    return model.eval(), stock.eval()


def _examples(seed: int = 1) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 120, (source,), generator=generator).tolist(),
             "labels": torch.randint(3, 120, (target,), generator=generator).tolist()} for source, target in PAIRS]


def _per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` x ``[...]`` -> ``[...]`` cross-entropy per token (0 where the label is -100)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                           ignore_index=-100).view(labels.shape)


def _decoder_samples(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every decoder sample, in packing order."""
    positions, kept = batch["decoder_position_ids"], batch["decoder_attention_mask"]
    starts = [(row, col) for row in range(positions.shape[0]) for col in range(positions.shape[1])
              if kept[row, col] and positions[row, col] == 0]
    ends = [*starts[1:], None]
    spans = []
    for (row, col), end in zip(starts, ends):
        stop = end[1] if end is not None and end[0] == row else int(kept[row].sum())
        spans.append((row, col, stop - col))
    return spans


def _check_packed(model, stock, batch: dict[str, torch.Tensor], examples: list[dict[str, list[int]]],
                  what: str) -> None:
    """The packed ``batch``'s logits, per-token losses, mean loss and parameter gradients (of the summed loss) against
    each example alone on ``stock``; raises AssertionError on any difference over ``ATOL``."""
    packed = model(**batch)
    losses = _per_token_loss(packed.logits, batch["labels"])
    losses.sum().backward()
    spans = _decoder_samples(batch)
    by_target = {tuple(example["labels"]): example for example in examples}
    targets = [tuple(batch["labels"][row, start:start + length].tolist()) for row, start, length in spans]
    assert sorted(targets) == sorted(by_target), f"{what}: the decoder rows do not hold the examples' targets"
    total, tokens = 0.0, 0
    for (row, start, length), target in zip(spans, targets):
        example = by_target[target]
        labels = torch.tensor([example["labels"]])
        alone = stock(input_ids=torch.tensor([example["input_ids"]]), labels=labels)
        alone_losses = _per_token_loss(alone.logits, labels)
        alone_losses.sum().backward()
        assert_close(packed.logits[row, start:start + length], alone.logits[0], atol=ATOL, rtol=0,
                     what=f"{what} logits")
        assert_close(losses[row, start:start + length], alone_losses[0], atol=ATOL, rtol=0, what=f"{what} losses")
        total, tokens = total + alone.loss * length, tokens + length
    assert_close(packed.loss, total / tokens, atol=ATOL, rtol=0, what=f"{what} mean loss")
    stock_grads = dict(stock.named_parameters())
    for name, parameter in model.named_parameters():
        expected = stock_grads[name].grad
        if parameter.grad is None or expected is None:
            assert parameter.grad is None and (expected is None or not expected.any()), f"{what}: gradient of {name}"
            continue
        assert_close(parameter.grad, expected, atol=ATOL, rtol=0, what=f"{what} gradient of {name}")


@pytest.mark.parametrize("decoder_inputs", ["from labels", "from the collator"])
@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_packed_seq2seq_equals_each_sample_alone(model_type: str, decoder_inputs: str) -> None:
    """From labels, packfree shifts each sample's labels; from the collator, its ``model`` does, or where the model has
    no ``prepare_decoder_input_ids_from_labels`` the examples bring their decoder inputs (its module's shift)."""
    model, stock = _pair(model_type)
    examples = _examples()
    collator = Seq2SeqPackedCollator(BUDGET, BUDGET, model=stock if decoder_inputs == "from the collator" else None)
    if decoder_inputs == "from the collator" and not hasattr(stock, "prepare_decoder_input_ids_from_labels"):
        shift = sys.modules[type(stock).__module__].shift_tokens_right
        for example in examples:
            example["decoder_input_ids"] = shift(torch.tensor([example["labels"]]), stock.config.pad_token_id,
                                                 stock.config.decoder_start_token_id)[0].tolist()
    batch = collator(examples)
    assert batch["input_ids"].shape[0] == 2 and ("decoder_input_ids" in batch) == (decoder_inputs != "from labels")
    _check_packed(model, stock, batch, examples, f"{model_type} packed ({decoder_inputs})")


@pytest.mark.parametrize("model_type", ["bart", "t5", "mvp"])
@pytest.mark.parametrize("budget", [7, 40])
def test_seq2seq_batches_in_the_contract_equal_each_sample_alone(model_type: str, budget: int) -> None:
    """Rows that the collator fills in another order than the examples' (7 tokens: rows [0, 3], [1], [2]), and one row
    holding all four (40 tokens, no padding on either side)."""
    model, stock = _pair(model_type)
    examples = _examples(seed=4)
    _check_packed(model, stock, Seq2SeqPackedCollator(budget, budget)(examples), examples,
                  f"{model_type} packed (budget {budget})")


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_decoder_rows_as_long_as_encoder_rows_keep_their_own_samples(model_type: str) -> None:
    """Encoder and decoder rows of 8 tokens split 3 + 5 and 5 + 3: the decoder must not take the encoder's samples."""
    model, stock = _pair(model_type)
    generator = torch.Generator().manual_seed(6)
    examples = [{"input_ids": torch.randint(3, 120, (source,), generator=generator).tolist(),
                 "labels": torch.randint(3, 120, (target,), generator=generator).tolist()}
                for source, target in [(3, 5), (5, 3)]]
    batch = Seq2SeqPackedCollator(8, 8)(examples)
    assert batch["input_ids"].shape == batch["labels"].shape == (1, 8)
    _check_packed(model, stock, batch, examples, f"{model_type} packed (rows of equal length)")


@pytest.mark.parametrize(("model_type", "reentrant"), [("bart", False), ("mvp", False), ("t5", False), ("t5", True),
                                                      ("umt5", False)])
def test_packed_seq2seq_with_gradient_checkpointing(model_type: str, reentrant: bool) -> None:
    """Training mode (no dropout) with gradient checkpointing: backward's recomputation keeps both sides' boundaries
    (T5's relative bias is recomputed for the same longest sample)."""
    model, stock = _pair(model_type, **({"dropout_rate": 0.0} if model_type in T5_TYPES else {"dropout": 0.0}))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    examples = _examples(seed=5)
    _check_packed(model.train(), stock, Seq2SeqPackedCollator(BUDGET, BUDGET)(examples), examples,
                  f"{model_type} packed with gradient checkpointing")


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_packed_seq2seq_encoder_boundaries_from_cu_seq_lens(model_type: str) -> None:
    """The encoder's samples given as ``cu_seq_lens_q/k`` (padding spans as segments of their own) and no encoder
    ``position_ids``."""
    model, stock = _pair(model_type)
    examples = _examples(seed=3)
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(examples)
    offsets = Boundaries.from_position_ids(batch.pop("position_ids"), attention_mask=batch["attention_mask"]).offsets
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(offsets, dtype=torch.int32)
    _check_packed(model, stock, batch, examples, f"{model_type} packed (cu_seq_lens)")


@pytest.mark.parametrize("model_type", T5_TYPES)
def test_t5_builds_the_relative_bias_of_the_longest_sample_not_of_the_row(model_type: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed row's self-attention bias is ``[1, H, L, L]`` for the longest sample (O(L^2), not O(T^2))."""
    model, _ = _pair(model_type)
    layer = type(next(m for m in model.modules() if getattr(m, "has_relative_attention_bias", False)))
    sizes = []
    own = layer.compute_bias

    def recording(self, query_length, key_length, *args, **kwargs):
        sizes.append((query_length, key_length))
        return own(self, query_length, key_length, *args, **kwargs)

    monkeypatch.setattr(layer, "compute_bias", recording)
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(_examples())
    with torch.no_grad():
        model(**batch)
    longest_source, longest_target = max(s for s, _ in PAIRS), max(t for _, t in PAIRS)
    assert set(sizes) == {(longest_source, longest_source), (longest_target, longest_target)}


def _leak_cross_attention(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """Plant a leak: every decoder token reads its whole encoder row (the other sample's tokens too)."""
    from packfree_plugin.quirks import dense_masks
    from packfree_plugin.attention import interface

    if model_type == "mvp":  # adds the dense cross mask to its scores itself
        monkeypatch.setattr(dense_masks, "dense_cross_mask", lambda pairing, dtype: torch.zeros(
            pairing.decoder.batch_size, 1, pairing.decoder.seq_len, pairing.encoder.seq_len, dtype=dtype))
        return

    def whole_row(query, key, value, pairing, options, *, training=False):
        return F.scaled_dot_product_attention(query, key, value, scale=options.scale).transpose(1, 2)

    monkeypatch.setattr(interface, "cross_segment_attention", whole_row)


@pytest.mark.parametrize("model_type", ["bart", "t5", "mvp"])
def test_a_leaking_cross_attention_is_caught(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above fails when cross-attention reads another sample's encoder tokens."""
    model, stock = _pair(model_type)
    examples = _examples()
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(examples)
    _leak_cross_attention(monkeypatch, model_type)
    with pytest.raises(AssertionError):
        _check_packed(model, stock, batch, examples, f"{model_type} with a planted leak")


def test_decoder_rows_must_pair_with_encoder_rows() -> None:
    """Row 0 packs two encoder samples; decoder_position_ids that make it one decoder sample are refused."""
    model, _ = _pair("bart")
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(_examples())
    batch["decoder_position_ids"] = torch.arange(batch["labels"].shape[1]).expand_as(batch["labels"])
    batch["decoder_attention_mask"] = torch.ones_like(batch["labels"])
    with pytest.raises(ValueError, match="row 0 packs 2 encoder samples but 1 decoder samples"), torch.no_grad():
        model(**batch)


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_packed_encoder_with_decoder_rows_of_another_length_needs_their_boundaries(model_type: str) -> None:
    model, _ = _pair(model_type)
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(_examples())
    del batch["decoder_position_ids"]
    with pytest.raises(ValueError, match="without decoder_position_ids"), torch.no_grad():
        model(**batch)


def test_decoder_position_ids_need_decoder_inputs() -> None:
    model, _ = _pair("bart")
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(_examples())
    del batch["labels"]
    with pytest.raises(ValueError, match="decoder_position_ids without decoder inputs or labels"), torch.no_grad():
        model(**batch)


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_packed_base_model_equals_each_sample_alone(model_type: str) -> None:
    """The base model (``BartModel``, ``T5Model``) called on its own with both sides' boundaries: each decoder sample's
    hidden states equal the sample alone."""
    from transformers import AutoModel

    packfree_plugin.register()
    config = _config(model_type)
    torch.manual_seed(0)
    stock = AutoModel.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float64).eval()
    model = AutoModel.from_config(config, attn_implementation="packfree", dtype=torch.float64).eval()
    model.load_state_dict(stock.state_dict())
    examples = _examples(seed=7)
    for example in examples:
        example["decoder_input_ids"] = [config.decoder_start_token_id, *example["labels"][:-1]]
    batch = Seq2SeqPackedCollator(BUDGET, BUDGET)(examples)
    del batch["labels"]
    with torch.no_grad():
        packed = model(**batch).last_hidden_state
        for example in examples:
            alone = stock(input_ids=torch.tensor([example["input_ids"]]),
                          decoder_input_ids=torch.tensor([example["decoder_input_ids"]])).last_hidden_state[0]
            rows = batch["decoder_input_ids"]
            row, start = next((r, c) for r in range(rows.shape[0]) for c in range(rows.shape[1])
                              if rows[r, c:c + len(alone)].tolist() == example["decoder_input_ids"])
            assert_close(packed[row, start:start + len(alone)], alone, atol=ATOL, rtol=0,
                         what=f"{model_type} base model")


def test_longt5_is_refused_with_its_reason() -> None:
    """LongT5's encoder attends over fixed blocks of the whole row (local / transient-global attention)."""
    packfree_plugin.register()
    with pytest.raises(ValueError, match="LongT5LocalAttention on a packed row"):
        AutoModelForSeq2SeqLM.from_config(_config("longt5"), attn_implementation="packfree")


def test_whisper_is_refused_at_load_with_its_reason_and_its_decoder_alone_loads() -> None:
    """Whisper's encoder reads audio windows, not a token row: the whole model is refused at load with that reason
    (before: the proof's internal AttributeError); its decoder alone (WhisperForCausalLM) loads."""
    from packfree_plugin.gate.shrink import tiny_config_for
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    packfree_plugin.register()
    config = tiny_config_for("whisper")
    with pytest.raises(ValueError, match="WhisperEncoder .Whisper's encoder reads fixed 30-second log-mel windows"):
        WhisperForConditionalGeneration._from_config(config, attn_implementation="packfree")
    WhisperForCausalLM._from_config(config, attn_implementation="packfree")


@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_the_gate_admits_seq2seq_proved_exact(model_type: str) -> None:
    """The load-time proof packs samples into the encoder and the decoder alike (decoder inputs = input ids)."""
    packfree_plugin.register()
    AutoModelForSeq2SeqLM.from_config(_config(model_type), attn_implementation="packfree")


@pytest.mark.parametrize("model_type", ["bart", "mbart", "t5"])
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
    inputs = {"labels": ids} if model_type in T5_TYPES else {}  # T5 makes no decoder inputs from input_ids
    with torch.no_grad():
        assert_close(model(input_ids=ids, attention_mask=mask, **inputs).logits,
                     stock(input_ids=ids, attention_mask=mask, **inputs).logits,
                     atol=ATOL, rtol=0, what=f"{model_type} {side}-padded")


@pytest.mark.parametrize("model_type", SEQ2SEQ_TYPES)
def test_unpacked_seq2seq_with_unequal_lengths_equals_stock(model_type: str) -> None:
    """A padded encoder batch of 9 tokens, padded decoder rows of 5 (``decoder_attention_mask``), and ``generate()``."""
    model, stock = _pair(model_type)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    decoder_ids = torch.randint(3, 128, (2, 5), generator=generator)
    decoder_mask = torch.ones(2, 5, dtype=torch.long)
    decoder_mask[1, 4:] = 0
    with torch.no_grad():
        for decoder_inputs in ({}, {"decoder_attention_mask": decoder_mask}):
            ours = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, **decoder_inputs).logits
            theirs = stock(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, **decoder_inputs).logits
            kept = decoder_inputs.get("decoder_attention_mask", torch.ones(2, 5)).bool()
            assert_close(ours[kept], theirs[kept], atol=ATOL, rtol=0,
                         what=f"{model_type} forward {list(decoder_inputs)}")
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
        generated, expected = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert torch.equal(generated.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(generated.logits, expected.logits)):
        assert_close(a, b, atol=ATOL, rtol=0, what=f"{model_type} generate step {step}")


def test_packed_seq2seq_labels_follow_the_seq2seq_contract() -> None:
    """Without decoder_position_ids, a packed row's decoder holds the encoder's layout: a seq2seq model's labels are its
    decoder targets, shifted into decoder inputs per sample; a label at a sample's first token is trained (the causal-LM
    rule of -100 there does not apply) and equals each sample alone."""
    model, stock = _pair("bart")
    samples = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, labels=ids)
        alone = [stock(input_ids=s[None], labels=s[None]) for s in samples]
    expected = torch.cat([out.logits for out in alone], dim=1)
    assert_close(packed.logits, expected, atol=ATOL, rtol=0, what="packed seq2seq logits with labels")
    mean = sum(out.loss * len(s) for out, s in zip(alone, samples)) / sum(len(s) for s in samples)
    assert_close(packed.loss, mean, atol=ATOL, rtol=0, what="packed seq2seq loss")
