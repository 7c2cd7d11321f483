"""TRL's own packing (``SFTConfig(packing=True)``) with each strategy, with and without ``padding_free``, on an
attention model (Llama) and a hybrid (Qwen3-Next: Gated DeltaNet + attention), loaded with packfree: the loss and
every gradient of one collated batch equal stock's on each piece the packed dataset holds, run alone, in float64.

What a piece is comes from TRL's packed dataset itself, not from the batch: ``bfd`` and ``bfd_split`` record each
row's ``seq_lengths`` (a sample cut to ``max_length``, or under ``bfd_split`` each piece of a longer sample); a
``wrapped`` row is one piece, cut from the stream of samples wherever ``max_length`` falls, so the samples inside it
attend to each other by TRL's design and the piece is what one sample means there (docs/integrations.md).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.integrations.trl_runs import TOLERANCE, models, text

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

MAX_LENGTH = 24
LENGTHS = (5, 30, 9, 14, 3, 40, 11, 7)  # characters = tokens (+ EOS): some longer than MAX_LENGTH
ROWS = 3  # packed rows per collated batch


def sft_trainer(model, strategy: str, padding_free: bool, tmp_path):
    from packfree_plugin.cli.tiny import tiny_tokenizer

    rng = random.Random(0)
    dataset = datasets.Dataset.from_dict({"text": [text(rng, n) for n in LENGTHS]})
    dense = {"router_aux_loss_coef": 0.0} if model.config.model_type == "qwen3_next" else {}
    args = trl.SFTConfig(output_dir=str(tmp_path), packing=True, packing_strategy=strategy, padding_free=padding_free,
                         max_length=MAX_LENGTH, per_device_train_batch_size=ROWS, bf16=False, use_cpu=True,
                         report_to="none", **dense)
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer())


def pieces(rows: list[dict], strategy: str) -> list[list[int]]:
    """The token ids of every piece the packed rows hold, as TRL's packed dataset records them."""
    found = []
    for row in rows:
        ids = list(row["input_ids"])
        lengths = list(row["seq_lengths"]) if strategy != "wrapped" else [len(ids)]
        assert sum(lengths) == len(ids)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        found += [ids[start:start + length] for start, length in zip(starts, lengths)]
    return found


def alone(stock, pieces_: list[list[int]]) -> torch.Tensor:
    """Stock's token-mean cross-entropy over every piece run alone (each token predicting the next in its piece)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for piece in pieces_:
        if len(piece) < 2:
            continue
        logits = stock(input_ids=torch.tensor([piece])).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.double(), torch.tensor(piece[1:]), reduction="sum")
        count += len(piece) - 1
    return total / count


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_trl_packing_equals_each_piece_alone(model_type: str, strategy: str, padding_free: bool, tmp_path) -> None:
    packed_model, stock = models(model_type)
    trainer = sft_trainer(packed_model, strategy, padding_free, tmp_path)
    rows = [trainer.train_dataset[i] for i in range(ROWS)]
    batch = trainer.data_collator(rows)
    expected_pieces = pieces(rows, strategy)
    if strategy == "bfd":
        assert max(map(len, expected_pieces)) <= MAX_LENGTH  # samples cut to max_length, the rest dropped
    if strategy != "wrapped":  # TRL turns padding-free on for bfd and bfd_split whatever the flag says
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    elif not padding_free:
        assert batch["input_ids"].shape[0] == ROWS
    assert len(expected_pieces) > ROWS or strategy == "wrapped"  # several samples share a row
    labels = batch.pop("labels")
    logits = packed_model(**batch).logits  # the loss in float64 here: transformers' own casts logits to float32
    targets = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum") / int((targets != -100).sum())
    loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in packed_model.named_parameters() if p.grad is not None}
    # stock on each piece alone: its Gated DeltaNet computes in float32 inside, so to its rounding, measured against
    # the model's largest gradient (a tiny tensor's own float32 error is far above 1e-6 of itself: dt_bias 2e-3)
    reference = alone(stock, expected_pieces)
    reference.backward()
    rtol = TOLERANCE.get(model_type, 1e-10)
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=rtol)
    stock_grads = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    largest = max(float(g.abs().max()) for g in stock_grads.values())
    for name, gradient in packed_grads.items():
        assert float((gradient - stock_grads[name]).abs().max()) <= rtol * largest, name
