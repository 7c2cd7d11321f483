"""``PackedRewardTrainer`` against TRL's padded ``RewardTrainer`` on stock attention, float64: a
sequence-classification head scores each packed sample's last token, and the loss, the logged reward / accuracy /
margin metrics and every gradient equal padded, on attention, Gated DeltaNet and MoE models, in one row or
under a token budget."""

from __future__ import annotations

import pytest

from tests.integrations.trl_runs import (  # noqa: F401 (packings is a fixture)
    assert_runs_equal, common_config, models, packings, preference_rows, train,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin", "grad_norm", "num_tokens")


@pytest.mark.parametrize(("model_type", "budget"), [("llama", None), ("qwen3_next", 30),
                                                    pytest.param("qwen3_moe", None, marks=pytest.mark.slow)])
def test_reward_packed_equals_padded(tmp_path, packings, model_type: str, budget: int | None) -> None:
    from transformers import AutoModelForSequenceClassification

    from packfree_plugin.integrations.trl import PackedRewardTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    dataset = datasets.Dataset.from_list(preference_rows(8, empty_prompt=False))
    records = []
    for packed in (True, False):
        model = models(model_type, head=AutoModelForSequenceClassification)[0 if packed else 1]
        args = trl.RewardConfig(**common_config(tmp_path / str(packed), center_rewards_coefficient=0.01))
        extra = {"max_tokens_per_row": budget} if packed else {}
        cls = PackedRewardTrainer if packed else trl.RewardTrainer
        records.append(train(cls(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer(),
                                 **extra)))
    assert len(packings) == 2  # one packed forward per step
    if budget:  # rows of at most `budget` tokens (which may hold more padding than the padded batch did)
        assert all(rows.rows > 1 and rows.row_len <= budget for rows in packings)
    else:
        assert all(rows.rows == 1 and rows.packed_tokens < rows.padded_tokens for rows in packings)
    packed, padded = records
    tolerance = 2e-6 if model_type == "qwen3_next" else 1e-9  # stock GDN computes in float32 inside
    assert padded.logs[0]["accuracy"] not in (0.0, 1.0) or padded.logs[1]["accuracy"] not in (0.0, 1.0)
    assert_runs_equal(packed, padded, rtol=tolerance, keys=METRICS)


def test_reward_refuses_a_model_on_other_attention(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    from packfree_plugin.integrations.trl import PackedRewardTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    stock = models("llama", head=AutoModelForSequenceClassification)[1]
    with pytest.raises(ValueError, match="reward model.*attn_implementation='packfree'"):
        PackedRewardTrainer(model=stock, args=trl.RewardConfig(**common_config(tmp_path)), processing_class=tiny_tokenizer(),
                            train_dataset=datasets.Dataset.from_list(preference_rows(4, empty_prompt=False)))


def test_reward_with_margin_column_equals_padded(tmp_path, packings) -> None:
    """A dataset with TRL's optional ``margin`` column: TRL hands it to the model beside the rows, and packfree's
    attention refused it (TRL's own test_train_with_margin); packed must train as padded does, margin and all."""
    from transformers import AutoModelForSequenceClassification

    from packfree_plugin.integrations.trl import PackedRewardTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    rows = [dict(row, margin=0.25 * index) for index, row in enumerate(preference_rows(8, empty_prompt=False))]
    dataset = datasets.Dataset.from_list(rows)
    records = []
    for packed in (True, False):
        model = models("llama", head=AutoModelForSequenceClassification)[0 if packed else 1]
        cls = PackedRewardTrainer if packed else trl.RewardTrainer
        records.append(train(cls(model=model, args=trl.RewardConfig(**common_config(tmp_path / str(packed))),
                                 train_dataset=dataset, processing_class=tiny_tokenizer())))
    assert len(packings) == 2
    assert_runs_equal(*records, rtol=1e-9, keys=METRICS)


def test_reward_refuses_a_head_that_pools_once_per_packed_row() -> None:
    """A head that pools the packed row's last token (one score for all its samples, as a stock head does, and as
    packfree's head did when PEFT wrapped ``score`` in a LoRA layer: TRL's test_train_moe_with_peft_config) must
    raise: the scores' scatter back to the padded rows would broadcast that one score to every sample."""
    import torch
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    from packfree_plugin.integrations.trl import _PackedHeadCall

    def pooled_once_per_row(input_ids: torch.Tensor, **_: object) -> SequenceClassifierOutputWithPast:
        return SequenceClassifierOutputWithPast(logits=input_ids[:, -1:].to(torch.float64))  # [R, 1]

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    call = _PackedHeadCall(pooled_once_per_row, max_tokens_per_row=None, pad_token_id=0)
    with pytest.raises(ValueError, match="returned 1 scores for the 3 packed samples"):
        call(input_ids=torch.arange(1, 13).view(3, 4) * mask, attention_mask=mask)


def test_reward_moe_router_loss_on_rows_with_padding_tails(tmp_path, packings) -> None:
    """Qwen3-MoE (``output_router_logits`` on) under a 30-token budget, whose rows end in padding tails: equal to TRL's
    padded reward trainer. transformers' sequence-classification head returns no router loss and TRL's reward trainer
    adds none (5.25, 1.16: dropping the tails' mask from the scoring call leaves this test green, while it moves the
    DPO test's), so what this holds is the experts' scores and gradients on rows with tails."""
    from transformers import AutoModelForSequenceClassification

    from packfree_plugin.integrations.trl import PackedRewardTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    dataset = datasets.Dataset.from_list(preference_rows(8, empty_prompt=False))
    records = []
    for packed in (True, False):
        model = models("qwen3_moe", head=AutoModelForSequenceClassification)[0 if packed else 1]
        args = trl.RewardConfig(**common_config(tmp_path / str(packed), max_steps=1))
        cls = PackedRewardTrainer if packed else trl.RewardTrainer
        extra = {"max_tokens_per_row": 30} if packed else {}
        records.append(train(cls(model=model, args=args, train_dataset=dataset, processing_class=tiny_tokenizer(),
                                 **extra)))
    assert packings and all(rows.attention_mask is not None and rows.rows > 1 for rows in packings)
    assert_runs_equal(*records, rtol=1e-9, keys=METRICS)
