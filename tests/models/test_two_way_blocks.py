"""Two-way image blocks inside packed samples (Gemma 3, Gemma 4, PaliGemma), from the batch a flattening collator
makes (``DataCollatorWithFlattening``: ``position_ids`` restarting per sample, or ``cu_seq_lens``, no
``attention_mask``) plus the samples' image tensors. Against each sample alone, with its own images, on stock sdpa in
float64: logits, the model's loss, and the gradient of every parameter (vision tower and projector included). Rows
hold two images in one sample, a text-only sample, and a sample ending in an image next to one starting with one (the
block ids run on across that boundary: a block that crossed samples would show there)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DataCollatorWithFlattening

from packfree_plugin import boundaries as boundary_package
from tests.conftest import assert_close
from tests.models.vlm_cases import CASES, GEMMA4, PALIGEMMA, VLMCase

EXACT = 1e-12
GEMMA3 = dataclasses.replace(CASES["gemma3"], opens_image=())
"""Gemma 3 without its begin-of-image token, so a sample can start or end on image tokens."""


def _pair(case: VLMCase) -> tuple[torch.nn.Module, torch.nn.Module]:
    model, stock = case.pair()
    return model.train(), stock.train()  # no dropout in these configs; training turns on packfree's backward paths


def _samples(case: VLMCase, token_key: str) -> list[dict[str, torch.Tensor]]:
    """Two images in the first sample, a text-only sample, a sample ending in an image, one starting with one."""
    samples = [case.sample([5, 6], [(1, 0), (1, 0)], [7, 8, 9], seed=1),
               case.sample([13, 14, 15, 16], [], [], seed=2),
               case.sample([10, 11], [(1, 0)], [], seed=3),
               case.sample([], [(1, 0)], [12, 17], seed=4)]
    for sample in samples:
        sample[token_key] = (sample["input_ids"] == case.image_token).long()
    return samples


def _flattened(samples: list[dict[str, torch.Tensor]], signal: str, token_key: str) -> dict[str, torch.Tensor]:
    """The samples as DataCollatorWithFlattening packs them (``position_ids`` or ``cu_seq_lens``), with the image
    tensors and the per-token image marker concatenated in sample order."""
    collator = DataCollatorWithFlattening(return_position_ids=signal == "position_ids",
                                          return_flash_attn_kwargs=signal == "cu_seq_lens", return_tensors="pt")
    batch = dict(collator([{"input_ids": s["input_ids"][0].tolist()} for s in samples]))
    batch[token_key] = torch.cat([s[token_key] for s in samples], dim=1)
    with_images = [s for s in samples if "pixel_values" in s]
    for key in with_images[0]:
        if key not in ("input_ids", token_key):
            batch[key] = torch.cat([s[key] for s in with_images])
    return batch


def _check(case: VLMCase, samples: list[dict[str, torch.Tensor]], batch: dict[str, torch.Tensor], *, atol: float,
           what: str) -> None:
    """Packed logits, loss and every parameter's gradient (relative to its largest entry) against each sample alone
    on stock."""
    model, stock = _pair(case)
    packed = model(**batch)
    packed.loss.backward()
    alone, losses, counted = [], [], []
    for sample in samples:
        output = stock(**sample, labels=sample["input_ids"])
        alone.append(output.logits[0])
        losses.append(output.loss)
        counted.append(sample["input_ids"].shape[1] - 1)
    total = sum(loss * count for loss, count in zip(losses, counted)) / sum(counted)
    total.backward()
    assert_close(packed.logits[0], torch.cat(alone), atol=atol, rtol=0, what=f"{what} logits")
    assert_close(packed.loss, total, atol=atol, rtol=0, what=f"{what} loss")
    expected = dict(stock.named_parameters())
    towers = 0
    for name, parameter in model.named_parameters():
        if expected[name].grad is None:
            assert parameter.grad is None or not parameter.grad.any(), f"{what}: {name} has a gradient alone has not"
            continue
        towers += "vision" in name or "projector" in name
        # relative to the largest entry (the projector's reach 1e9), at float32's 1e-6 at least: Gemma's RMSNorm
        # computes in float32 (its weights' gradients differ by 1.5e-7 relative on a text-only packed row too)
        scale = max(float(expected[name].grad.abs().max()), 1e-3)  # a key bias: 0 in exact arithmetic
        assert_close(parameter.grad, expected[name].grad, atol=max(atol, 1e-6) * scale, rtol=0,
                     what=f"{what} gradient of {name}")
    assert towers > 0, f"{what}: no vision tower or projector parameter got a gradient"


@pytest.mark.parametrize("signal", ["position_ids", "cu_seq_lens"])
def test_gemma3_flattened_images_equal_each_sample_alone(signal: str) -> None:
    """Gemma 3's image tokens attend both ways inside their own image and sample, causal elsewhere: with position_ids
    transformers renumbers the row under its image-block overlay (refused before), with cu_seq_lens it sees one row;
    packfree lays the blocks out per sample either way."""
    samples = _samples(GEMMA3, "token_type_ids")
    _check(GEMMA3, samples, _flattened(samples, signal, "token_type_ids"), atol=EXACT, what=f"gemma3 {signal}")


@pytest.mark.parametrize("signal", ["position_ids", "cu_seq_lens"])
def test_gemma4_flattened_images_equal_each_sample_alone(signal: str) -> None:
    """Gemma 4 (``use_bidirectional_attention="vision"``): image tokens attend both ways on its sliding layers only.
    Its vision tower pools in float32 even in a float64 model: float32's tolerance."""
    case = dataclasses.replace(GEMMA4, opens_image=())
    samples = _samples(case, "mm_token_type_ids")
    _check(case, samples, _flattened(samples, signal, "mm_token_type_ids"), atol=1e-6, what=f"gemma4 {signal}")


def test_gemma3_image_blocks_make_no_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks run per sample: no [B, 1, T, T] mask is built for the packed row (a dense mask marks itself)."""
    def refuse(mask: torch.Tensor) -> torch.Tensor:
        raise AssertionError(f"a dense mask {list(mask.shape)} was built")

    monkeypatch.setattr(boundary_package.two_way, "mark_per_sample", refuse)
    from packfree_plugin.attention import masks

    monkeypatch.setattr(masks, "mark_per_sample", refuse)
    samples = _samples(GEMMA3, "token_type_ids")
    model, _ = _pair(GEMMA3)
    with torch.no_grad():
        model(**_flattened(samples, "position_ids", "token_type_ids"))


def test_paligemma_flattened_prefix_blocks_equal_each_sample_alone() -> None:
    """PaliGemma's prefix (image and prompt, token_type_ids 0) attends both ways; its block id is 0 in every sample,
    so only the samples keep the prefixes apart. PaliGemma hands its mask to its Gemma, which gets the blocks' dense
    form. Gemma's RMSNorm computes in float32 even in a float64 model: float32's tolerance."""
    samples = [PALIGEMMA.sample([5, 6], [(1, 0)], [7, 8, 9], seed=1),
               PALIGEMMA.sample([15, 16, 17, 18], [], [], seed=3),
               PALIGEMMA.sample([10], [(1, 0)], [11, 12, 13, 14], seed=2)]
    for sample in samples:
        suffix = torch.zeros_like(sample["input_ids"])
        suffix[0, -2:] = 1
        sample["token_type_ids"] = suffix
    _check(PALIGEMMA, samples, _flattened(samples, "position_ids", "token_type_ids"), atol=1e-6, what="paligemma")


def _mask_call(position_ids: list[int], mask_function) -> object:
    """packfree's mask function for one packed row of ``position_ids`` (no attention_mask, no cache)."""
    from packfree_plugin import Boundaries
    from packfree_plugin.attention.masks import packfree_attention_mask
    from packfree_plugin.forward import context

    context.push(Boundaries.from_position_ids(torch.tensor([position_ids])))
    try:
        return packfree_attention_mask(1, len(position_ids), len(position_ids), mask_function=mask_function)
    finally:
        context.pop()


def test_block_ids_running_across_samples_make_a_block_in_each() -> None:
    """The ids of one image run on from the end of sample 0 into sample 1 (transformers numbers blocks over the row):
    packfree cuts them into a block of each sample; a window under the blocks is kept with them."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_overlay)

    from packfree_plugin.boundaries import TwoWayBlocks

    ids = torch.tensor([[-1, 0, 0, 0, 0, -1, -1]])
    pattern = and_masks(or_masks(causal_mask_function, blockwise_overlay(ids)), sliding_window_overlay(3))
    blocks = _mask_call([0, 1, 2, 0, 1, 2, 3], pattern)
    assert isinstance(blocks, TwoWayBlocks)
    assert blocks.spans == ((1, 3, 0), (3, 5, 3)) and blocks.window == 3


def test_an_overlay_packfree_cannot_lay_out_under_renumbered_positions_is_refused_by_name() -> None:
    """A block that is not one run of its sample (id 0 at tokens 0 and 2 of sample 0) is no range of keys: with
    transformers' renumbering around it, the refusal names the overlay."""
    from transformers.masking_utils import (blockwise_overlay, causal_mask_function, or_masks,
                                            remap_positions_for_packed_sequence)

    positions = [0, 1, 2, 0, 1, 2, 3]
    ids = torch.tensor([[0, -1, 0, -1, 1, 1, -1]])
    pattern = remap_positions_for_packed_sequence(or_masks(causal_mask_function, blockwise_overlay(ids)),
                                                  torch.tensor([positions]))
    with pytest.raises(ValueError, match=r"blockwise_overlay.*cannot lay out per sample.*renumbered"):
        _mask_call(positions, pattern)
