"""``PackedGRPOTrainer`` against TRL's padded ``GRPOTrainer``: generation stays TRL's (transformers on the CPU, the
same samples in both runs), and the policy's, the old policy's and the reference's per-token log-probs of
prompt + completion run on packed rows. The loss, KL, clip ratios, entropy and rewards equal padded, and so do the
gradients; the models are loaded from a directory, so TRL loads the reference model separately, with its own
packfree proof. Before the first update the policy/old-policy ratio is exactly 1 and the KL exactly 0."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.trl_runs import (  # noqa: F401 (packings is a fixture)
    LM_HEAD_TOLERANCE, STOCK, assert_runs_equal, common_config, models, packings, text, tolerance, train,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

METRICS = ("kl", "entropy", "reward", "reward_std", "clip_ratio/region_mean", "completions/mean_length",
           "grad_norm")
PROMPTS = ["ab", "cdefghijk", "lmn opq", "r", "stuvw xyz 0123", "45"]


def saved_model(model_type: str, directory) -> str:
    """A tiny causal LM saved to ``directory``, its end-of-sequence row scaled up so completions end at varied
    lengths (and their rows are right-padded, besides the prompts' left padding)."""
    model = models(model_type)[0]
    with torch.no_grad():
        model.get_output_embeddings().weight[model.config.eos_token_id] *= 25.0
    model.save_pretrained(directory)
    return str(directory)


def completion_lengths(completions: list[str], **kwargs) -> list[float]:
    return [float(len(completion)) for completion in completions]


def grpo_pair(model_type: str, tmp_path, *, max_tokens_per_row: int | None = None, **config):
    from packfree_plugin.integrations.trl import PackedGRPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    path = saved_model(model_type, tmp_path / "model")
    dataset = datasets.Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS])
    records, trainers = [], []
    for packed in (True, False):
        implementation = "packfree" if packed else STOCK.get(model_type, "sdpa")
        args = trl.GRPOConfig(**common_config(
            tmp_path / str(packed), num_generations=2, max_completion_length=8, beta=0.1, num_iterations=2, learning_rate=0.05, disable_dropout=True,
            model_init_kwargs={"attn_implementation": implementation, "dtype": torch.float64,
                               "experts_implementation": "eager"},
            **config))
        cls = PackedGRPOTrainer if packed else trl.GRPOTrainer
        extra = {"max_tokens_per_row": max_tokens_per_row} if packed else {}
        torch.manual_seed(0)
        trainer = cls(model=path, reward_funcs=completion_lengths, args=args, train_dataset=dataset,
                      processing_class=tiny_tokenizer(), **extra)
        records.append(train(trainer))
        trainers.append(trainer)
    return records, trainers


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3_next", marks=pytest.mark.slow),
                                        pytest.param("mamba2", marks=pytest.mark.slow)])
def test_grpo_packed_equals_padded(tmp_path, packings, model_type: str) -> None:
    dense = {"router_aux_loss_coef": 0.0} if model_type == "qwen3_next" else {}  # its dense config declares router logits
    (packed, padded), (trainer, _) = grpo_pair(model_type, tmp_path, **dense)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert packings and all(rows.packed_tokens < rows.padded_tokens for rows in packings)
    assert packed.logs[0]["completions/mean_length"] == padded.logs[0]["completions/mean_length"]
    assert packed.logs[0]["kl"] == 0.0 and packed.logs[0]["clip_ratio/region_mean"] == 0.0
    assert_runs_equal(packed, padded, rtol=tolerance(model_type), keys=METRICS)


def test_grpo_ratio_one_and_kl_zero_before_the_first_update(tmp_path) -> None:
    """GPT-2 numbers positions absolutely, so a reference (or old policy) scored on TRL's left-padded rows instead
    of packed ones would read other positions and move the KL and ratio off their step-0 values, 0 and 1, by far
    more than rounding."""
    from packfree_plugin.integrations.trl import PackedGRPOTrainer
    from packfree_plugin.cli.tiny import tiny_tokenizer

    path = saved_model("gpt2", tmp_path / "model")
    args = trl.GRPOConfig(**common_config(
        tmp_path / "run", num_generations=2, max_completion_length=8, beta=0.1, num_iterations=2, max_steps=1, disable_dropout=True,
        model_init_kwargs={"attn_implementation": "packfree", "dtype": torch.float64}))
    trainer = PackedGRPOTrainer(model=path, reward_funcs=completion_lengths, args=args, processing_class=tiny_tokenizer(),
                                train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    record = train(trainer)
    assert record.logs[0]["kl"] == 0.0
    assert record.logs[0]["clip_ratio/region_mean"] == 0.0 and record.logs[0]["clip_ratio/high_max"] == 0.0
