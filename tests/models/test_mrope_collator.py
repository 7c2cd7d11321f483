"""Multimodal-RoPE models fed the batch transformers' own collator builds: ``DataCollatorWithFlattening``'s row (2-D
``position_ids`` restarting per sample, or ``cu_seq_lens`` alone) with the samples' ``mm_token_type_ids`` laid out
like ``input_ids`` and their images (pixel values, grids) concatenated in sample order. packfree numbers every sample
with the model's own ``get_rope_index`` on that sample alone; logits, loss and every parameter's gradient (vision
tower and projector included) equal each sample alone with its own images on stock sdpa, in float64. Grids that do
not fit their samples are refused, naming the sample and the counts."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import DataCollatorWithFlattening

from packfree_plugin.packing import VisionPackedCollator
from tests.conftest import assert_close
from tests.helpers import gradients, max_grad_diff
from tests.models.vlm_cases import CASES, MORE_MROPE, VLMCase
from tests.test_host_reads import HostReads

TYPES = {**{name: case for name, case in CASES.items() if case.mrope}, **MORE_MROPE}
"""Every multimodal-RoPE type of the VLM cases: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, Qwen3-VL-MoE, Qwen3.5 (Gated
DeltaNet hybrid), Qwen3.5-MoE."""
EXACT = 1e-12
FLOAT32 = 1e-6
"""The model's own loss: transformers computes it from the logits cast to float32."""
FLOAT32_INSIDE = {"qwen3_5": 1e-5, "qwen3_5_moe": 1e-5}
"""Logits and gradient tolerance of the Gated DeltaNet hybrids: stock's torch delta rule runs in float32 (packfree's
op keeps float64), as in ``tests/models/test_hybrids.py``; their text-only packed rows differ by 5.6e-8 too."""
GRADIENT = {"glm4v": 1e-8, **FLOAT32_INSIDE}
"""Gradient tolerance where float64 is not kept throughout (GLM-4V's vision embeddings sample their position table in
float32); 1e-10 elsewhere."""
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@cache
def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree model, stock sdpa model)``, same weights; callers zero the gradients they make."""
    return TYPES[model_type].pair()


def _samples(case: VLMCase) -> list[dict[str, torch.Tensor]]:
    """An image sample, a text-only one, a sample with two images of different sizes, and a text-only one."""
    small, large = case.sizes[0], case.sizes[-1]
    return [case.sample([5, 6], [small], [7, 8, 9], seed=1),
            case.sample([13, 14, 15], [], [], seed=3),
            case.sample([10], [large, small], [11, 12], seed=2),
            case.sample([16, 17], [], [18], seed=4)]


def _flattened(samples: list[dict[str, torch.Tensor]], form: str) -> dict[str, torch.Tensor]:
    """The row ``DataCollatorWithFlattening`` builds from the samples' ``input_ids`` (``form``: ``"position_ids"``,
    its default 2-D ids, or ``"cu_seq_lens"``, its flash kwargs alone), with their ``mm_token_type_ids`` laid out
    like ``input_ids`` and their image tensors concatenated in sample order."""
    collator = DataCollatorWithFlattening(return_position_ids=form == "position_ids",
                                          return_flash_attn_kwargs=form == "cu_seq_lens")
    batch = collator([{"input_ids": sample["input_ids"][0].tolist()} for sample in samples])
    batch["mm_token_type_ids"] = torch.cat([sample["mm_token_type_ids"] for sample in samples], dim=1)
    for key in IMAGE_KEYS:
        parts = [sample[key] for sample in samples if key in sample]
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def _summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss of ``logits [1, T, V]`` summed over the targets, in float64 (transformers' own loss casts
    the logits to float32)."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")


def _alone(stock: torch.nn.Module, samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       dict[str, torch.Tensor]]:
    """Each sample alone on stock: the logits concatenated, the model's token-mean loss over all samples' targets
    (from each sample's own, weighted by its targets) and the gradients of the float64 loss summed over them."""
    stock.zero_grad()
    logits, losses, count = [], [], sum(sample["input_ids"].shape[1] - 1 for sample in samples)
    for sample in samples:
        output = stock(**sample, labels=sample["input_ids"])
        _summed_loss(output.logits, sample["input_ids"]).backward()
        logits.append(output.logits[0].detach())
        losses.append(output.loss.detach().double() * (sample["input_ids"].shape[1] - 1) / count)
    grads = gradients(stock)
    stock.zero_grad()
    return torch.cat(logits), torch.stack(losses).sum(), grads


def _packed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                              dict[str, torch.Tensor]]:
    """The packed row's logits, the model's loss, and the gradients of the float64 loss summed over its targets."""
    model.zero_grad()
    output = model(**batch)
    _summed_loss(output.logits, batch["labels"]).backward()
    grads = gradients(model)
    model.zero_grad()
    return output.logits[0].detach(), output.loss.detach().double(), grads


@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", TYPES)
def test_flattened_row_with_images_equals_each_sample_alone(model_type: str, form: str) -> None:
    """Two image samples (one with two images of different sizes) and two text-only ones in one flattened row: the
    logits, the loss and every parameter's gradient, the vision tower's and the projector's included, equal each
    sample alone on stock."""
    model, stock = _pair(model_type)
    samples = _samples(TYPES[model_type])
    batch = _flattened(samples, form)
    assert ("position_ids" in batch) == (form == "position_ids") and batch["image_grid_thw"].shape[0] == 3
    logits, loss, grads = _packed(model, batch)
    expected_logits, expected_loss, expected_grads = _alone(stock, samples)
    assert any(name.startswith("model.visual.") for name in grads), "the vision tower got no gradient"
    assert_close(logits, expected_logits, atol=FLOAT32_INSIDE.get(model_type, EXACT), rtol=0,
                 what=f"{model_type} {form} logits")
    assert_close(loss, expected_loss, atol=FLOAT32, rtol=0, what=f"{model_type} {form} loss")
    assert grads.keys() == expected_grads.keys()
    worst = max_grad_diff(grads, expected_grads)
    assert worst <= GRADIENT.get(model_type, 1e-10), f"{model_type} {form}: gradients {worst:.2e} apart"


SHARED_PLACEHOLDER = {"glm4v"}
"""Models whose videos and images share one placeholder token: one call takes images or videos, not both."""


@pytest.mark.parametrize("model_type", TYPES)
def test_flattened_row_with_videos_equals_each_sample_alone(model_type: str) -> None:
    """Videos of 2, 1 and 3 temporal patches, two in one sample, beside an image sample where the model takes both,
    and a text-only sample (Qwen2.5-VL's ``second_per_grid_ts`` split by video, Qwen3-VL's, Qwen3.5's and GLM-4V's
    frames apart): the logits equal each sample alone on stock."""
    case = TYPES[model_type]
    model, stock = _pair(model_type)
    with_images = model_type not in SHARED_PLACEHOLDER
    samples = [case.video_sample([5, 6], [(2, 2, 2)], [7, 8], seed=1),
               *([case.sample([10], [case.sizes[-1]], [11, 12], seed=2)] if with_images else []),
               case.video_sample([9], [(1, 2, 4), (3, 2, 2)], [13], seed=3),
               case.sample([13, 14, 15, 16], [], [], seed=4)]
    for sample in samples:
        sample.setdefault("mm_token_type_ids", torch.zeros_like(sample["input_ids"]))
    batch = _flattened(samples, "position_ids")
    with torch.no_grad():
        packed = model(**batch).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=FLOAT32_INSIDE.get(model_type, EXACT), rtol=0, what=f"{model_type} videos")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_5"])
def test_two_padded_rows_with_flat_ids_equal_each_sample_alone(model_type: str) -> None:
    """Two rows, padded at the end (``attention_mask`` 0 there), with 2-D ids restarting per sample (and counting
    on over the padding): every sample is numbered in its own row, and equals itself alone."""
    case = TYPES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)
    lengths = [sample["input_ids"].shape[1] for sample in samples]
    batch = VisionPackedCollator(model, rows_per_batch=2, max_tokens=sum(lengths) - max(lengths))(samples)
    del batch["labels"]
    places = [_place(batch["input_ids"], sample["input_ids"][0]) for sample in samples]
    flat = torch.arange(batch["input_ids"].shape[1]).repeat(batch["input_ids"].shape[0], 1)
    for (row, start), length in sorted(zip(places, lengths)):
        flat[row, start:] -= flat[row, start].clone()
    batch["position_ids"] = flat
    assert (batch["attention_mask"] == 0).any() and flat.ndim == 2
    with torch.no_grad():
        logits = model(**batch).logits
        for index, ((row, start), length) in enumerate(zip(places, lengths)):
            assert_close(logits[row, start:start + length], stock(**samples[index]).logits[0],
                         atol=FLOAT32_INSIDE.get(model_type, EXACT), rtol=0, what=f"{model_type} sample {index}")


def _place(rows: torch.Tensor, ids: torch.Tensor) -> tuple[int, int]:
    """``(row, start)`` of the one place in ``rows [B, T]`` that holds ``ids`` (each test sample differs)."""
    spots = [(row, start) for row in range(rows.shape[0]) for start in range(rows.shape[1] - len(ids) + 1)
             if torch.equal(rows[row, start:start + len(ids)], ids)]
    assert len(spots) == 1, f"a sample of {len(ids)} tokens placed {len(spots)} times"
    return spots[0]


def _image_row(case: VLMCase) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A small-image sample (1 placeholder), a text-only one and a large-image one, flattened with 2-D ids."""
    samples = [case.sample([5, 6], [case.sizes[0]], [7], seed=1), case.sample([8, 9], [], [], seed=2),
               case.sample([10], [case.sizes[-1]], [11], seed=3)]
    return samples, _flattened(samples, "position_ids")


@pytest.mark.parametrize(("change", "refusal"), [
    ("reversed", r"sample 0 of the packed batch \(row 0, tokens 0-4\) holds 1 image placeholder tokens .* but the "
                 r"image_grid_thw grids that come next fill \[4\] tokens"),
    ("one_more", r"image_grid_thw holds 3 grids, but the packed samples' image placeholders \(\[1, 0, 4\] tokens, "
                 r"sample by sample\) take only the first 2"),
    ("one_fewer", r"sample 2 of the packed batch \(row 0, tokens 7-13\) holds 4 image placeholder tokens .* no "
                  r"image_grid_thw grid is left for it"),
    ("no_token_types", r"2-D position_ids together with images or videos, without mm_token_type_ids.* Pass "
                       r"input_ids, mm_token_type_ids"),
])
def test_grids_that_do_not_fit_their_samples_are_refused(change: str, refusal: str) -> None:
    """Grids given in another order than the samples' images, one grid too many or too few, or no
    ``mm_token_type_ids`` to place them by: refused before the model runs, naming the sample and the counts."""
    case = TYPES["qwen2_5_vl"]
    model, _ = _pair("qwen2_5_vl")
    _, batch = _image_row(case)
    grids = batch["image_grid_thw"]
    if change == "reversed":
        batch["image_grid_thw"] = grids.flip(0)
    elif change == "one_more":
        batch["image_grid_thw"] = torch.cat([grids, grids[:1]])
    elif change == "one_fewer":
        batch["image_grid_thw"] = grids[:1]
    else:
        del batch["mm_token_type_ids"]
    with torch.no_grad(), pytest.raises(ValueError, match=refusal):
        model(**batch)


def test_a_flattened_row_reads_the_host_once() -> None:
    """Numbering the samples reads nothing from the device beyond the forward's one read of the batch (the token
    types and grids copied with the boundary inputs): packfree's reads in a forward and backward, at most 1; the
    loss equals each sample alone."""
    model, stock = _pair("qwen2_5_vl")
    samples, batch = _image_row(TYPES["qwen2_5_vl"])
    fresh = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    with HostReads() as reads:
        loss = model(**fresh).loss
        loss.backward()
    model.zero_grad()
    assert reads.by["packfree"] <= 1, dict(reads.where)
    _, expected, _ = _alone(stock, samples)
    assert_close(loss.detach().double(), expected, atol=FLOAT32, rtol=0, what="loss")


def test_flat_ids_passed_positionally_are_replaced_in_place() -> None:
    """``model(input_ids, attention_mask, position_ids, ...)`` by position: the numbered ids take the 2-D ids' place
    (a keyword beside them would be a second value for ``position_ids``), and every sample equals itself alone."""
    model, stock = _pair("qwen2_5_vl")
    samples, batch = _image_row(TYPES["qwen2_5_vl"])
    tokens, ids = batch.pop("input_ids"), batch.pop("position_ids")
    del batch["labels"]
    with torch.no_grad():
        packed = model(tokens, None, ids, **batch).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what="positional ids")
