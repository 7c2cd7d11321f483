"""``PackedDPOTrainer(padding_free=True)`` against TRL's padded ``DPOTrainer`` on stock attention, float64: the
loss, every logged reward / margin / accuracy / log-prob metric, and every gradient, step by step, with a separate
reference model of other weights (so step 1 already has non-zero rewards), on attention, Gated DeltaNet, Mamba2 and
MoE models; then a token budget (several packed rows), precomputed reference log-probs, and PEFT."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.trl_runs import (  # noqa: F401 (packings is a fixture)
    LM_HEAD_TOLERANCE, assert_runs_equal, common_config, models, packings, preference_rows, tolerance, train,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "grad_norm")


def dpo_pair(model_type: str, tmp_path, *, ref_seed: int | None = 7, rows: int = 8, trainer_kwargs=None,
             max_tokens_per_row: int | None = None, **config):
    """Train the same model packed and padded; returns both records."""
    from packfree_plugin.integrations.trl import PackedDPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    dataset = datasets.Dataset.from_list(preference_rows(rows))
    records = []
    for packed in (True, False):
        policy = models(model_type)[0 if packed else 1]
        reference = None if ref_seed is None else models(model_type, seed=ref_seed)[0 if packed else 1]
        if reference is not None:
            reference.eval()
        args = trl.DPOConfig(**common_config(tmp_path / str(packed), padding_free=packed, **config))
        cls = PackedDPOTrainer if packed else trl.DPOTrainer
        extra = {"max_tokens_per_row": max_tokens_per_row} if packed else {}
        trainer = cls(model=policy, ref_model=reference, args=args, train_dataset=dataset,
                      processing_class=tiny_tokenizer(), **extra, **(trainer_kwargs or {}))
        records.append(train(trainer))
    return records


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", pytest.param("mamba2", marks=pytest.mark.slow),
                                        pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_dpo_packed_equals_padded(tmp_path, packings, model_type: str) -> None:
    dense = {"router_aux_loss_coef": 0.0} if model_type == "qwen3_next" else {}  # its dense config still declares router logits
    packed, padded = dpo_pair(model_type, tmp_path, gradient_checkpointing=model_type == "qwen3_next", **dense)
    assert len(packings) == 4 and all(rows.packed_tokens < rows.padded_tokens for rows in packings)  # policy + reference, 2 steps
    assert padded.logs[0]["rewards/margins"] != 0.0  # the reference differs from the policy: a real comparison
    assert_runs_equal(packed, padded, rtol=tolerance(model_type), keys=METRICS, scale_key="logps/chosen")


def test_dpo_token_budget_and_other_losses(tmp_path, packings) -> None:
    """Rows of at most 40 tokens (several per batch, chosen and rejected of a pair in different rows), with the
    per-sequence-normalised IPO loss beside the sigmoid one."""
    packed, padded = dpo_pair("llama", tmp_path, max_tokens_per_row=40, loss_type=["sigmoid", "ipo"],
                              loss_weights=[1.0, 0.5])
    assert packings and all(rows.rows > 1 and rows.row_len <= 40 for rows in packings)
    assert_runs_equal(packed, padded, rtol=LM_HEAD_TOLERANCE, keys=METRICS, scale_key="logps/chosen")


def test_dpo_precomputed_reference(tmp_path, packings) -> None:
    packed, padded = dpo_pair("llama", tmp_path, precompute_ref_log_probs=True)
    assert len(packings) == 2 + 2  # the precomputation's 2 batches, then the policy's 2 steps
    assert_runs_equal(packed, padded, rtol=LM_HEAD_TOLERANCE, keys=METRICS, scale_key="logps/chosen")


def test_dpo_peft_adapter_off_as_reference(tmp_path) -> None:
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    packed, padded = dpo_pair("llama", tmp_path, ref_seed=None, trainer_kwargs={"peft_config": lora})
    assert packed.logs[1]["rewards/margins"] != 0.0  # the adapter moved after step 1
    assert_runs_equal(packed, padded, rtol=LM_HEAD_TOLERANCE, keys=METRICS, scale_key="logps/chosen")


def test_dpo_refuses_reference_on_other_attention(tmp_path) -> None:
    from packfree_plugin.integrations.trl import PackedDPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    policy, stock = models("llama")
    args = trl.DPOConfig(**common_config(tmp_path, padding_free=True))
    dataset = datasets.Dataset.from_list(preference_rows(4))
    with pytest.raises(ValueError, match="reference model.*attn_implementation='packfree'.*'sdpa'"):
        PackedDPOTrainer(model=policy, ref_model=stock, args=args, train_dataset=dataset,
                         processing_class=tiny_tokenizer())
    with pytest.raises(ValueError, match="policy.*attn_implementation='packfree'"):
        PackedDPOTrainer(model=stock, ref_model=policy, args=args, train_dataset=dataset,
                         processing_class=tiny_tokenizer())


def test_dpo_packs_when_trl_name_patched_to_packed_class(tmp_path, monkeypatch, packings) -> None:
    """Code that patches ``trl.DPOTrainer = PackedDPOTrainer`` (as a harness or a framework does) must still see
    ``DPOConfig(padding_free=True)``: reading the config through ``trl.DPOTrainer``'s signature found only
    ``*args`` there, so padding-free was silently off and every batch ran padded."""
    from packfree_plugin.integrations.trl import PackedDPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    monkeypatch.setattr(trl, "DPOTrainer", PackedDPOTrainer)
    policy, reference = models("llama")[0], models("llama", seed=7)[0]
    dataset = datasets.Dataset.from_list(preference_rows(4))
    args = trl.DPOConfig(**common_config(tmp_path, padding_free=True, max_steps=1))
    trainer = trl.DPOTrainer(policy, reference, args, train_dataset=dataset, processing_class=tiny_tokenizer())
    assert trainer.padding_free
    trainer.train()
    assert packings, "the scoring forwards ran padded"


def test_dpo_packs_reference_prepared_under_mixed_precision(tmp_path, packings) -> None:
    """Under ``bf16=True`` TRL has accelerate prepare the reference at set-up, which wraps its fused-LM-head forward
    in a mixed-precision one: the reference must still be packed (it was refused as having no fused LM head, so
    every TRL DPO test with a reference failed under the default bf16), and score as padded does."""
    from packfree_plugin.integrations.trl import PackedDPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    dataset = datasets.Dataset.from_list(preference_rows(4))
    losses = []
    for packed in (True, False):
        pair = models("llama", dtype=torch.float32), models("llama", seed=7, dtype=torch.float32)
        policy, reference = (model[0 if packed else 1] for model in pair)
        args = trl.DPOConfig(**common_config(tmp_path / str(packed), padding_free=packed, max_steps=1, bf16=True))
        cls = PackedDPOTrainer if packed else trl.DPOTrainer
        trainer = cls(model=policy, ref_model=reference.eval(), args=args, train_dataset=dataset,
                      processing_class=tiny_tokenizer())
        losses.append(train(trainer).losses)
    assert len(packings) == 2  # the policy's and the reference's scoring forward of the one step
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=1e-3)


def test_dpo_moe_router_loss_on_rows_with_padding_tails(tmp_path, packings) -> None:
    """Qwen3-MoE with its load-balancing loss on, rows of at most 40 tokens ending in padding tails: the router loss
    must leave the tails out as TRL's padded batch leaves its padding out (with the tails' mask dropped from the
    scoring call, step 0's loss moved from 0.741706 to 0.741694)."""
    packed, padded = dpo_pair("qwen3_moe", tmp_path, max_tokens_per_row=40, max_steps=1)
    assert packings and all(rows.attention_mask is not None and rows.rows > 1 for rows in packings)
    assert_runs_equal(packed, padded, rtol=LM_HEAD_TOLERANCE, keys=METRICS, scale_key="logps/chosen")
