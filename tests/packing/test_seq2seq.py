"""Seq2SeqPackedCollator: the layout of its rows (packfree's seq2seq input contract), its budgets and refusals, and a
``Seq2SeqTrainer`` step on its batches whose loss equals the mean per-token loss of the samples run alone on stock."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, Seq2SeqTrainer, Seq2SeqTrainingArguments

import packfree_plugin
from packfree_plugin.packing import Seq2SeqPackedCollator, pack_pairs
from tests.conftest import assert_close

EXAMPLES = [{"input_ids": [11, 12, 13], "labels": [21, 22]},
            {"input_ids": [14, 15], "labels": [23, 24, 25, 26]},
            {"input_ids": [16, 17, 18, 19], "labels": [27]}]


def test_rows_hold_the_same_examples_on_both_sides_in_order() -> None:
    batch = Seq2SeqPackedCollator(max_source_tokens=6, max_target_tokens=6, pad_token_id=0)(EXAMPLES)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15], [16, 17, 18, 19, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["labels"].tolist() == [[21, 22, 23, 24, 25, 26], [27, -100, -100, -100, -100, -100]]
    assert batch["decoder_attention_mask"].tolist() == [[1] * 6, [1, 0, 0, 0, 0, 0]]
    assert batch["decoder_position_ids"].tolist() == [[0, 1, 0, 1, 2, 3], [0, 0, 0, 0, 0, 0]]
    assert "decoder_input_ids" not in batch  # packfree shifts each sample's labels itself


def test_an_example_goes_to_the_first_row_where_both_sides_fit() -> None:
    """Example 1 fits row 0's source budget but not its target budget; example 2 fits both, after it."""
    rows = pack_pairs([2, 2, 1], [4, 3, 1], max_source_tokens=5, max_target_tokens=5)
    assert rows == [[0, 2], [1]]


def test_budgets_and_examples_are_checked() -> None:
    with pytest.raises(ValueError, match="over the budgets"):
        Seq2SeqPackedCollator(3, 3)(EXAMPLES)
    with pytest.raises(ValueError, match="max_target_tokens must be a positive int"):
        pack_pairs([1], [1], max_source_tokens=4, max_target_tokens=0)
    with pytest.raises(ValueError, match="empty source or target"):
        Seq2SeqPackedCollator(8, 8)([{"input_ids": [5], "labels": []}])
    with pytest.raises(ValueError, match="lacks input_ids or labels"):
        Seq2SeqPackedCollator(8, 8)([{"input_ids": [5, 6]}])
    with pytest.raises(ValueError, match="decoder_input_ids and labels differ"):
        Seq2SeqPackedCollator(8, 8)([{"input_ids": [5], "labels": [6, 7], "decoder_input_ids": [1]}])


def test_pad_to_multiple_of_rounds_both_sides() -> None:
    batch = Seq2SeqPackedCollator(6, 6, pad_to_multiple_of=4)(EXAMPLES)
    assert batch["input_ids"].shape == (2, 8) and batch["labels"].shape == (2, 8)
    assert batch["attention_mask"][:, 5:].sum() == 0 and (batch["labels"][:, 6:] == -100).all()


def _bart(implementation: str, seed: int = 0):
    config = AutoConfig.for_model("bart", vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                  decoder_ffn_dim=16, max_position_embeddings=32, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    torch.manual_seed(seed)
    return AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation=implementation)


def test_the_model_shifts_each_samples_labels_into_decoder_inputs() -> None:
    """With a ``model``, the decoder inputs are each sample's ``prepare_decoder_input_ids_from_labels``, padded."""
    model = _bart("sdpa")
    batch = Seq2SeqPackedCollator(6, 6, model=model, pad_token_id=0)(EXAMPLES)
    start = model.config.decoder_start_token_id
    assert batch["decoder_input_ids"].tolist() == [[start, 21, start, 23, 24, 25], [start, 0, 0, 0, 0, 0]]


def test_seq2seq_trainer_step_on_packed_batches(tmp_path) -> None:
    """One ``Seq2SeqTrainer`` step on a packfree BART fed by the collator: its training loss is the mean per-token loss
    of the examples, each run alone on stock sdpa."""
    packfree_plugin.register()
    model, stock = _bart("packfree"), _bart("sdpa")
    stock.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, 60, (source,), generator=generator).tolist(),
                 "labels": torch.randint(3, 60, (target,), generator=generator).tolist()}
                for source, target in [(5, 3), (2, 6), (7, 2), (3, 4)]]
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                    learning_rate=0.0, report_to=[], use_cpu=True, save_strategy="no",
                                    logging_strategy="no", dataloader_num_workers=0)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=examples,
                             data_collator=Seq2SeqPackedCollator(max_source_tokens=10, max_target_tokens=10))
    loss = trainer.train().training_loss
    with torch.no_grad():
        alone = [stock(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])) for e in examples]
    tokens = [len(e["labels"]) for e in examples]
    expected = sum(out.loss.item() * n for out, n in zip(alone, tokens)) / sum(tokens)
    assert_close(torch.tensor(loss), torch.tensor(expected), atol=1e-5, rtol=0, what="Seq2SeqTrainer loss")
