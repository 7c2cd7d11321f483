"""VisionPackedCollator: its layout, and its rows through real (tiny) VLMs against each sample alone on stock sdpa:
logits, loss and gradients, float64."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.packing import VisionPackedCollator
from tests.conftest import assert_close
from tests.models.vlm_cases import CASES, VLMCase


_GRADIENT_TOLERANCE = {"gemma3": 1e-6, "glm4v": 1e-8}
"""Gemma's RMSNorm computes in float32 even in a float64 model, so its weight gradients, summed over the tokens
in another order packed than alone, differ by ~5e-8. GLM-4V's vision embeddings sample their position table in
float32 (bicubic ``grid_sample``): that table's gradient, summed over every frame at once packed and frame by
sample alone, differs by 3.5e-9."""


def _labelled(case: VLMCase, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sample with labels as a trainer sets them: its ids, -100 on image placeholders."""
    ids = sample["input_ids"]
    return {**sample, "labels": ids.masked_fill(ids == case.image_token, -100)}


def _samples(case: VLMCase) -> list[dict[str, torch.Tensor]]:
    """Four samples: two images (different sizes where the model takes them), one text-only, one more image."""
    return [_labelled(case, sample) for sample in (
        case.sample([5, 6], [case.sizes[0]], [7, 8, 9], seed=1),
        case.sample([10], [case.sizes[-1]], [11, 12], seed=2),
        case.sample([13, 14, 15, 16, 17], [], [], seed=3),
        case.sample([18, 19, 20], [case.sizes[0]], [21], seed=4),
    )]


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over every predicted label, in float64: ``logits [B, T, V]``, ``labels [B, T]``
    (transformers' own loss runs in float32, which would hide anything below 1e-7)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                             reduction="sum")


def _reference(stock: torch.nn.Module, samples: list[dict[str, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample alone on stock: its logits ``[sum T, V]`` (concatenated); the model's loss a packed batch's mean
    over all predicted tokens equals, ``sum(loss_i * n_i) / sum(n_i)`` (``n_i``: sample i's predicted labels);
    and the float64 summed loss whose gradients the packed row's must equal."""
    logits, weighted, summed, count = [], 0, 0, 0
    for sample in samples:
        out = stock(**sample)
        predicted = int((sample["labels"][:, 1:] != -100).sum())
        logits.append(out.logits[0])
        weighted = weighted + out.loss.detach() * predicted
        summed = summed + _summed_loss(out.logits, sample["labels"])
        count += predicted
    return torch.cat(logits), weighted / count, summed


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("model_type", "rows", "checkpointing"), [
    ("qwen2_vl", 1, False), ("qwen2_vl", 2, True), ("llava", 1, True), ("llava", 2, False), ("idefics3", 2, False),
    ("gemma3", 1, False),
], ids=["qwen2_vl-1row", "qwen2_vl-2rows-checkpointing", "llava-1row-checkpointing", "llava-2rows", "idefics3-2rows",
        "gemma3-1row"])
def test_collated_rows_train_like_each_sample_alone(model_type: str, rows: int, checkpointing: bool) -> None:
    """Collator output through the model: logits, the model's loss and every gradient (vision tower included)
    equal each sample alone on stock sdpa. Two rows: the samples spread over both, padded, images row after row.
    Gradient checkpointing (non-reentrant) recomputes the vision tower's layers in backward, outside the forward."""
    case = CASES[model_type]
    model, stock = (twin.train() for twin in case.pair())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    samples = _samples(case)
    total = sum(sample["input_ids"].shape[1] for sample in samples)
    collator = VisionPackedCollator(model, rows_per_batch=rows, max_tokens=total // 2 + 4 if rows > 1 else None)
    batch = collator(samples)
    assert batch["input_ids"].shape[0] == rows and (batch["labels"][:, 0] == -100).all()
    assert batch.get("attention_mask", torch.ones(1, 1))[:, 0].all(), "a row holds no sample"

    out = model(**batch)
    _summed_loss(out.logits, batch["labels"]).backward()
    expected_logits, expected_loss, expected_summed = _reference(stock, samples)
    expected_summed.backward()

    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    order = _row_order(batch, samples)
    assert_close(out.logits[real], expected_logits[order], atol=1e-12, rtol=0, what=f"{model_type} logits")
    assert_close(out.loss, expected_loss, atol=0, rtol=1e-6, what=f"{model_type} loss (float32 inside transformers)")
    ours, theirs = _gradients(model), _gradients(stock)
    assert ours.keys() == theirs.keys() and any("visual" in n or "vision" in n for n in ours)
    for name in theirs:
        assert_close(ours[name], theirs[name], atol=_GRADIENT_TOLERANCE.get(model_type, 1e-11), rtol=0,
                     what=f"{model_type} grad {name}")


@pytest.mark.parametrize(("model_type", "rows", "checkpointing"), [("qwen2_5_vl", 2, False), ("qwen3_vl", 1, True),
                                                               ("glm4v", 2, False)])
def test_collated_video_rows_train_like_each_sample_alone(model_type: str, rows: int, checkpointing: bool) -> None:
    """Videos through the collator (``pixel_values_videos`` and ``video_grid_thw`` concatenated in sample order, each
    sample's own get_rope_index with its videos): logits, loss and every gradient, vision tower included, equal each
    sample alone on stock. Videos of 1, 2 and 3 temporal patches, an image sample (where the model takes images and
    videos in one call) and a text-only one."""
    case = CASES[model_type]
    model, stock = (twin.train() for twin in case.pair())
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mixed = model_type != "glm4v"  # GLM-4V's images and videos share a placeholder: one call takes one kind
    samples = [case.video_sample([5, 6], [(2, 2, 2)], [7, 8], seed=1),
               *([case.sample([10], [case.sizes[-1]], [11, 12], seed=2)] if mixed else []),
               case.video_sample([9], [(1, 2, 4), (3, 2, 2)], [13], seed=3,
                                 image_sizes=(case.sizes[0],) if mixed else ()),
               case.sample([13, 14, 15, 16, 17], [], [], seed=4)]
    samples = [{**sample, "labels": sample["input_ids"].masked_fill(sample["mm_token_type_ids"] > 0, -100)}
               for sample in samples]
    total = sum(sample["input_ids"].shape[1] for sample in samples)
    batch = VisionPackedCollator(model, rows_per_batch=rows, max_tokens=total // 2 + 8 if rows > 1 else None)(samples)
    assert batch["input_ids"].shape[0] == rows and batch["pixel_values_videos"].shape[0] == 28
    assert torch.equal(batch["video_grid_thw"].prod(-1).sum(), torch.tensor(28))

    out = model(**batch)
    _summed_loss(out.logits, batch["labels"]).backward()
    expected_logits, expected_loss, expected_summed = _reference(stock, samples)
    expected_summed.backward()

    real = batch["attention_mask"].bool()
    assert_close(out.logits[real], expected_logits[_row_order(batch, samples)], atol=1e-12, rtol=0,
                 what=f"{model_type} logits")
    assert_close(out.loss, expected_loss, atol=0, rtol=1e-6, what=f"{model_type} loss (float32 inside transformers)")
    ours, theirs = _gradients(model), _gradients(stock)
    assert ours.keys() == theirs.keys() and any("visual" in name for name in ours)
    for name in theirs:
        assert_close(ours[name], theirs[name], atol=_GRADIENT_TOLERANCE.get(model_type, 1e-11), rtol=0,
                     what=f"{model_type} grad {name}")


def _row_order(batch: dict[str, torch.Tensor], samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Indices into the concatenated per-sample tokens, in the order the batch's real tokens lie (row-major):
    found by matching each row's runs of ids to the samples (the test samples' ids are distinct)."""
    starts, offset = {}, 0
    for sample in samples:
        starts[int(sample["input_ids"][0, 0])] = (offset, sample["input_ids"].shape[1])
        offset += sample["input_ids"].shape[1]
    order: list[int] = []
    labels = batch["labels"]
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    for r in range(batch["input_ids"].shape[0]):
        t = 0
        while t < batch["input_ids"].shape[1] and real[r, t]:
            assert labels[r, t] == -100, "a sample's first token must have label -100"
            start, length = starts[int(batch["input_ids"][r, t])]
            order += range(start, start + length)
            t += length
    return torch.tensor(order)


def test_layout_of_rows_labels_images_and_mrope_positions() -> None:
    """Two rows of 14: samples placed by best-fit decreasing, labels -100 at each sample's first token and on
    padding, images in sample order row after row, each sample's positions its own get_rope_index, padding a
    0, 1, ... span on every plane."""
    case = CASES["qwen2_vl"]
    model = case.build("packfree")
    samples = _samples(case)
    batch = VisionPackedCollator(model, rows_per_batch=2, max_tokens=14)(samples)
    rows = [[0, 1], [2, 3]]  # lengths 7, 6, 5, 6: 7 and 6 fill row 0 to 13, the second 6 opens row 1, 5 joins it
    for r, row in enumerate(rows):
        t = 0
        for i in row:
            ids, labels = samples[i]["input_ids"][0], samples[i]["labels"][0]
            n = len(ids)
            assert batch["input_ids"][r, t:t + n].tolist() == ids.tolist()
            assert batch["labels"][r, t:t + n].tolist() == [-100, *labels[1:].tolist()]
            expected, _ = model.model.get_rope_index(ids[None], samples[i]["mm_token_type_ids"],
                                                     image_grid_thw=samples[i].get("image_grid_thw"))
            assert torch.equal(batch["position_ids"][:, r, t:t + n], expected[:, 0])
            t += n
        assert batch["attention_mask"][r].tolist() == [1] * t + [0] * (14 - t)
        assert (batch["labels"][r, t:] == -100).all()
        assert torch.equal(batch["position_ids"][:, r, t:], torch.arange(14 - t).expand(3, -1))
    with_images = [i for row in rows for i in row if "pixel_values" in samples[i]]
    assert torch.equal(batch["pixel_values"], torch.cat([samples[i]["pixel_values"] for i in with_images]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([samples[i]["image_grid_thw"] for i in with_images]))


def test_flat_positions_without_mrope() -> None:
    case = CASES["llava"]
    batch = VisionPackedCollator(case.build("packfree"))(_samples(case))
    lengths = [sample["input_ids"].shape[1] for sample in _samples(case)]
    assert batch["position_ids"].tolist() == [[p for n in lengths for p in range(n)]]


def test_refusals() -> None:
    """A padded sample, and images on an MRoPE model without the mm_token_type_ids that place them."""
    case = CASES["qwen2_vl"]
    collator = VisionPackedCollator(case.build("packfree"))
    sample = case.sample([5], [case.sizes[0]], [6], seed=1)
    padded = {**sample, "attention_mask": torch.tensor([[1] * (sample["input_ids"].shape[1] - 1) + [0]])}
    with pytest.raises(ValueError, match="padding in its attention_mask"):
        collator([padded])
    unmarked = {key: value for key, value in sample.items() if key != "mm_token_type_ids"}
    with pytest.raises(ValueError, match="no mm_token_type_ids"):
        collator([unmarked])
