"""Vision-language models under packfree, against each sample alone on stock sdpa in float64: unpacked calls
with images, padded batches, generate(), and packed rows with an image per sample (of different sizes where the
model takes them), text-only samples mixed in, with explicit multimodal ids, 2-D ids or boundary keywords alone;
and what is refused because it cannot be exact yet."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from packfree_plugin.packing import VisionPackedCollator
from tests.conftest import assert_close
from tests.models.vlm_cases import CASES, PALIGEMMA, VLMCase

MROPE = [name for name, case in CASES.items() if case.mrope]
EXACT = 1e-12


@cache
def _pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree model, stock model)`` with the same weights (built once per module: the tests only run them)."""
    return CASES[model_type].pair()


def _samples(case: VLMCase) -> list[dict[str, torch.Tensor]]:
    """Two samples with an image each (the model's smallest and largest test size) and a text-only one."""
    return [case.sample([5, 6], [case.sizes[0]], [7, 8, 9], seed=1),
            case.sample([10], [case.sizes[-1]], [11, 12], seed=2),
            case.sample([13, 14, 15, 16], [], [], seed=3)]


def _padded(case: VLMCase, samples: list[dict[str, torch.Tensor]], side: str) -> dict[str, torch.Tensor]:
    """A padded batch of ``samples`` as a processor builds it (pad id 0, ``attention_mask`` 0 on padding)."""
    length = max(sample["input_ids"].shape[1] for sample in samples)
    batch: dict[str, list[torch.Tensor]] = {}
    for sample in samples:
        tokens = sample["input_ids"].shape[1]
        for key, value in {**sample, "attention_mask": torch.ones_like(sample["input_ids"])}.items():
            if key in ("input_ids", "attention_mask", case.token_type_key):
                pad = value.new_zeros(1, length - tokens)
                value = torch.cat([value, pad] if side == "right" else [pad, value], dim=1)
            batch.setdefault(key, []).append(value)
    if case.images_per_row:  # [1, images, ...] per sample: pad with all-zero images
        for key in ("pixel_values", "pixel_attention_mask"):
            most = max(value.shape[1] for value in batch[key])
            batch[key] = [torch.cat([v, v.new_zeros(1, most - v.shape[1], *v.shape[2:])], dim=1) for v in batch[key]]
    return {key: torch.cat(values) for key, values in batch.items()}


@pytest.mark.parametrize("model_type", CASES)
def test_one_sample_with_an_image_equals_stock(model_type: str) -> None:
    """Unpacked, with an image: the vision tower reads its own inputs' boundaries (none), the text model the
    row's, and the logits equal stock sdpa."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    sample = case.sample([5, 6], [case.sizes[-1]], [7, 8, 9], seed=1)
    with torch.no_grad():
        assert_close(model(**sample).logits, stock(**sample).logits, atol=EXACT, rtol=0, what=model_type)


def test_gemma3_unpacked_keeps_its_bidirectional_image_block() -> None:
    """Gemma3's image tokens attend to each other both ways (token_type_ids): packfree builds stock's mask for an
    unpacked call, and the block does change the logits (so the equality above could fail)."""
    case = CASES["gemma3"]
    model, stock = _pair("gemma3")
    sample = case.sample([5, 6], [case.sizes[0]], [7, 8, 9], seed=1)
    causal = {key: value for key, value in sample.items() if key != "token_type_ids"}
    with torch.no_grad():
        ours, theirs = model(**sample).logits, stock(**sample).logits
        assert (stock(**causal).logits - theirs).abs().max() > 1e-3, "the image block made no difference"
    assert_close(ours, theirs, atol=EXACT, rtol=0, what="gemma3 with token_type_ids")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model_type", CASES)
def test_padded_batch_with_images_equals_stock(model_type: str, side: str) -> None:
    case = CASES[model_type]
    model, stock = _pair(model_type)
    batch = _padded(case, _samples(case)[:2], side)
    kept = batch["attention_mask"].bool()
    with torch.no_grad():
        ours, theirs = model(**batch).logits, stock(**batch).logits
    assert_close(ours[kept], theirs[kept], atol=EXACT, rtol=0, what=f"{model_type} {side}-padded")


@pytest.mark.parametrize("model_type", CASES)
def test_generate_with_an_image_equals_stock(model_type: str) -> None:
    """Greedy generation from a prompt with an image: same tokens and scores (MRoPE's rope deltas; Gemma3's
    image block in the prefill)."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    sample = case.sample([5, 6], [case.sizes[-1]], [7, 8, 9], seed=1)
    options = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ours, theirs = model.generate(**sample, **options), stock.generate(**sample, **options)
    assert ours.sequences.tolist() == theirs.sequences.tolist()
    assert_close(torch.stack(ours.scores), torch.stack(theirs.scores), atol=EXACT, rtol=0, what=model_type)


@pytest.mark.parametrize("model_type", CASES)
def test_packed_row_with_images_equals_each_sample_alone(model_type: str) -> None:
    """Three samples in one row (two images of different sizes where the model takes them, and a text-only
    sample): images concatenated in sample order; positions each sample's own get_rope_index (MRoPE) or
    restarting ids. Every sample's logits equal that sample alone on stock (Gemma3: with its bidirectional image
    blocks, through stock's dense mask cut to each sample)."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)
    batch = VisionPackedCollator(model)(samples)
    with torch.no_grad():
        packed = model(**{key: value for key, value in batch.items() if key != "labels"}).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what=f"packed {model_type}")


def test_packed_text_only_gemma3_without_an_attention_mask_equals_each_sample_alone() -> None:
    """Text-only Gemma3 samples packed with position_ids only: its block overlay holds no block (every id -1), so
    transformers' renumbering of positions changes nothing it reads, and the row runs on the boundaries, each sample
    as alone (mutant: a union whose overlay adds no block counted as widening, and the row was refused as renumbered)."""
    case = CASES["gemma3"]
    model, stock = _pair("gemma3")
    samples = [case.sample([13, 14, 15, 16], [], [], seed=3), case.sample([5, 6, 7], [], [], seed=4)]
    batch = VisionPackedCollator(model)(samples)
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "attention_mask")}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what="packed text-only gemma3")


def test_packed_gemma3_image_blocks_without_an_attention_mask_equal_the_row_with_it() -> None:
    """Packed position_ids without an attention_mask make transformers (>= 5.24) renumber positions per sample under
    Gemma3's image-block overlay on sliding layers (stock's overlay then reads another sample's block ids, 0.53 off;
    refused before): packfree lays the blocks out per sample itself, so the row equals the row with the mask
    (tests/models/test_two_way_blocks.py holds both to each sample alone, gradients included)."""
    case = CASES["gemma3"]
    model, _ = _pair("gemma3")
    batch = VisionPackedCollator(model)(_samples(case))
    assert batch["token_type_ids"].sum() > 0
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "attention_mask")}
    with torch.no_grad():
        with_mask = model(**{key: value for key, value in batch.items() if key != "labels"}).logits
        assert_close(model(**inputs).logits, with_mask, atol=EXACT, rtol=0, what="gemma3 packed without a mask")


@pytest.mark.parametrize("model_type", MROPE)
def test_flat_position_ids_with_images_on_mrope_equal_each_sample_alone(model_type: str) -> None:
    """2-D ids restarting in every sample (as DataCollatorWithFlattening numbers them) with the collator's images,
    ``mm_token_type_ids`` and grids: packfree numbers each sample with the model's own get_rope_index, and every
    sample equals itself alone (before, this was refused: the model would copy the ids into its three planes). More
    forms and gradients: ``tests/models/test_mrope_collator.py``."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)
    batch = VisionPackedCollator(model)(samples)
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "position_ids")}
    with torch.no_grad():
        flat = torch.cat([torch.arange(sample["input_ids"].shape[1]) for sample in samples])[None]
        packed = model(**inputs, position_ids=flat).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what=f"{model_type} with 2-D ids")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model_type", MROPE)
def test_flat_position_ids_with_images_unpacked_equal_stock(model_type: str, side: str) -> None:
    """One sample per row with 2-D ids beside images (a padded batch, ids ``(cumsum(mask) - 1) * mask`` as
    transformers' tests build them, and one sample with ``arange`` ids): no packing signal, so packfree runs it as
    stock sdpa does (the model copies the ids into its planes), never refused. The same ids restarting in a packed
    row are refused (above)."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    batch = _padded(case, _samples(case)[:2], side)
    mask = batch["attention_mask"]
    batch["position_ids"] = (mask.cumsum(1) - 1) * mask
    one = case.sample([5, 6], [case.sizes[-1]], [7, 8, 9], seed=1)
    one["position_ids"] = torch.arange(one["input_ids"].shape[1])[None]
    with torch.no_grad():
        ours, theirs = model(**batch).logits, stock(**batch).logits
        assert_close(ours[mask.bool()], theirs[mask.bool()], atol=EXACT, rtol=0, what=f"{model_type} {side}-padded")
        assert_close(model(**one).logits, stock(**one).logits, atol=EXACT, rtol=0, what=f"{model_type} one sample")


def _vision_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """``mm_encoder_outputs`` as a caller precomputes them: the vision tower's outputs for the batch's images."""
    with torch.no_grad():
        return {"image": model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])}


@pytest.mark.parametrize("signal", ["mm_encoder_outputs", "mm_encoder_outputs_only", "image_grid_thw",
                                    "placeholder_tokens"])
@pytest.mark.parametrize("model_type", MROPE)
def test_flat_position_ids_with_any_image_signal_on_mrope_are_refused(model_type: str, signal: str) -> None:
    """Precomputed vision outputs (``mm_encoder_outputs``) with 2-D ids were silently wrong (0.44-0.76 off on these
    tiny models): the refusal keyed on pixel values only. Any sign of images without the ``mm_token_type_ids`` that
    place them refuses: vision outputs (with or without their grids), a grid alone, or image placeholder tokens in
    ``input_ids``."""
    case = CASES[model_type]
    model, _ = _pair(model_type)
    batch = VisionPackedCollator(model)(_samples(case)[:2])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "position_ids": batch["position_ids"][0]}
    if signal.startswith("mm_encoder_outputs"):
        inputs["mm_encoder_outputs"] = _vision_outputs(model, batch)
    if signal in ("mm_encoder_outputs", "image_grid_thw"):
        inputs["image_grid_thw"] = batch["image_grid_thw"]
    with torch.no_grad(), pytest.raises(ValueError, match=r"2-D position_ids together with images"):
        model(**inputs)


@pytest.mark.parametrize("model_type", MROPE)
def test_precomputed_vision_outputs_with_mrope_ids_equal_each_sample_alone(model_type: str) -> None:
    """The form that works: ``mm_encoder_outputs`` with each sample's own ``[3, B, T]`` ids gives every sample
    its logits alone (so the refusal above refuses only the 2-D ids)."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)
    batch = VisionPackedCollator(model)(samples)
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "pixel_values")}
    with torch.no_grad():
        packed = model(**inputs, mm_encoder_outputs=_vision_outputs(model, batch)).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what=f"{model_type} with mm_encoder_outputs")


@pytest.mark.parametrize("boundary", ["cu_seq_lens", "seq_idx"])
@pytest.mark.parametrize("model_type", MROPE)
def test_packed_boundaries_without_position_ids_on_mrope_equal_each_sample_alone(model_type: str,
                                                                                 boundary: str) -> None:
    """cu_seq_lens / seq_idx with images and no ids: packfree numbers every sample with the model's own
    get_rope_index (numbering each 0, 1, ... on every plane was 2.7e-3 off on Qwen2-VL, and was refused since)."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)[:2]
    inputs = {key: value for key, value in VisionPackedCollator(model)(samples).items()
              if key not in ("labels", "position_ids")}
    first, total = samples[0]["input_ids"].shape[1], inputs["input_ids"].shape[1]
    if boundary == "seq_idx":
        inputs["seq_idx"] = (torch.arange(total) >= first).to(torch.int32)[None]
    else:
        cu = torch.tensor([0, first, total], dtype=torch.int32)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=total, max_length_k=total)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what=f"{model_type} {boundary} without ids")


SHARED_PLACEHOLDER = {"glm4v"}
"""Models whose videos and images share one placeholder token, so one call takes images or videos, not both (stock's
own limit: the model scatters image features over every placeholder)."""


def _video_samples(case: VLMCase) -> list[dict[str, torch.Tensor]]:
    """Videos of 2, 1 and 3 temporal patches (4, 2, 6 frames) and of different frame sizes, two in one sample, mixed
    with an image sample (and a sample with an image and videos) where the model takes both, and a text-only one."""
    with_images = case.model_type not in SHARED_PLACEHOLDER
    return [case.video_sample([5, 6], [(2, 2, 2)], [7, 8], seed=1),
            *([case.sample([10], [case.sizes[-1]], [11, 12], seed=2)] if with_images else []),
            case.video_sample([9], [(1, 2, 4), (3, 2, 2)], [13], seed=3,
                              image_sizes=(case.sizes[0],) if with_images else ()),
            case.sample([13, 14, 15, 16], [], [], seed=4)]


@pytest.mark.parametrize("model_type", MROPE)
def test_packed_row_with_videos_equals_each_sample_alone(model_type: str) -> None:
    """Packed rows with videos (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``; each
    sample's own ``get_rope_index``, from the collator): every sample's logits equal that sample alone on stock, on
    one row and on two padded rows; each sample unpacked equals stock too."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _video_samples(case)
    with torch.no_grad():
        alone = [stock(**sample).logits[0] for sample in samples]
        for index, sample in enumerate(samples):
            assert_close(model(**sample).logits[0], alone[index], atol=EXACT, rtol=0, what=f"{model_type} {index}")
        one_row = VisionPackedCollator(model)(samples)
        assert one_row["position_ids"].shape[0] == 3 and "pixel_values_videos" in one_row
        packed = model(**{key: value for key, value in one_row.items() if key != "labels"}).logits[0]
        assert_close(packed, torch.cat(alone), atol=EXACT, rtol=0, what=f"{model_type} one packed row")
        longest = max(sample["input_ids"].shape[1] for sample in samples)
        collator = VisionPackedCollator(model, rows_per_batch=2, max_tokens=sum(
            sample["input_ids"].shape[1] for sample in samples) - longest + 1)
        two_rows = collator(samples)
        logits = model(**{key: value for key, value in two_rows.items() if key != "labels"}).logits
        for index, (row, start, length) in enumerate(_placements(two_rows["input_ids"], samples)):
            assert_close(logits[row, start:start + length], alone[index], atol=EXACT, rtol=0,
                         what=f"{model_type} two rows, sample {index}")


def _placements(rows: torch.Tensor, samples: list[dict[str, torch.Tensor]]) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of each sample in packed ``rows [B, T]``, found by its tokens (each sample differs)."""
    found = []
    for sample in samples:
        ids = sample["input_ids"][0]
        spots = [(row, start) for row in range(rows.shape[0]) for start in range(rows.shape[1] - len(ids) + 1)
                 if torch.equal(rows[row, start:start + len(ids)], ids)]
        assert len(spots) == 1, f"sample of {len(ids)} tokens placed {len(spots)} times"
        found.append((*spots[0], len(ids)))
    return found


@pytest.mark.parametrize(("model_type", "rope"), [
    ("qwen2_vl", {"mrope_section": [16, 24, 24]}),
    ("qwen2_5_vl", {"mrope_section": [16, 24, 24]}),
    ("glm4v", {"mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}),
])
def test_gate_proves_checkpoint_mrope_configs(model_type: str, rope: dict) -> None:
    """A checkpoint's config (its mrope_section fits 128-wide heads) loads: the gate's tiny copy scales the
    sections to its own heads (it could not be built before, so loading was refused) and is proved exact."""
    import transformers

    from packfree_plugin.gate.admission import bypassed
    from packfree_plugin.gate.proof import build_pair, prove
    from packfree_plugin.gate.shrink import shrink_config

    cls = getattr(transformers, CASES[model_type].class_name)
    config = cls.config_class(text_config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, **rope}})
    with bypassed():
        packed, stock, implementation = build_pair(cls, shrink_config(config))
        proof = prove(packed, stock, stock_name=implementation)
    assert proof.exact, proof.summary()


def test_compiled_gemma3_with_an_image_block_is_never_silently_wrong() -> None:
    """Under torch.compile packfree sees the image block's union at the top of the mask function only: an
    unpacked call must still equal stock (or be refused), never drop the block (it gave 0.21 off before)."""
    case = CASES["gemma3"]
    model, stock = _pair("gemma3")
    sample = case.sample([5, 6], [case.sizes[0]], [7, 8, 9], seed=1)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(model, backend="eager")(**sample, use_cache=False).logits
            expected = stock(**sample, use_cache=False).logits
    except ValueError as refusal:
        assert "overlays a pattern of its own" in str(refusal)
    else:
        assert_close(compiled, expected, atol=EXACT, rtol=0, what="compiled gemma3")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("model_type", [name for name in CASES if name not in MROPE])
def test_flattening_collator_kwargs_with_images_equal_each_sample_alone(model_type: str) -> None:
    """DataCollatorWithFlattening's cu_seq_lens (no position_ids) on a model with ordinary RoPE: packfree numbers
    each sample from 0, and every sample equals itself alone."""
    case = CASES[model_type]
    model, stock = _pair(model_type)
    samples = _samples(case)
    inputs = {key: value for key, value in VisionPackedCollator(model)(samples).items()
              if key not in ("labels", "position_ids")}
    lengths = torch.tensor([sample["input_ids"].shape[1] for sample in samples])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    longest = int(lengths.max())
    with torch.no_grad():
        packed = model(**inputs, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                       max_length_k=longest).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=EXACT, rtol=0, what=f"{model_type} with cu_seq_lens")


def test_packed_overlay_that_depends_on_row_position_is_refused() -> None:
    """Stock's mask cut to each sample is exact only for overlays that read relative distances or per-token ids;
    one that counts from the row's start (Llama 4's attention chunks) would cut the wrong chunks: refused."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay

    from packfree_plugin import Boundaries
    from packfree_plugin.forward import context
    from packfree_plugin.attention.masks import packfree_attention_mask

    boundaries = Boundaries.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    chunked = and_masks(causal_mask_function, chunked_overlay(2, torch.zeros(1, dtype=torch.long)))
    context.push(boundaries)
    try:
        with pytest.raises(ValueError, match=r"chunked_overlay.*depend on a token's place in the row"):
            packfree_attention_mask(1, 7, 7, mask_function=chunked, use_vmap=True)
    finally:
        context.pop()


def test_paligemma_hands_its_mask_to_gemma_and_packed_text_rows_are_exact() -> None:
    """PaliGemma builds the mask and passes it to its Gemma as ``attention_mask``; Gemma makes its own mask from it
    again, which read packfree's boundaries as a tensor (AttributeError 'ndim'). The inner model now takes them as its
    boundaries: a packed row equals each sample alone on stock."""
    import transformers

    from packfree_plugin.gate.admission import bypassed
    from packfree_plugin.gate.proof import build_pair, prove
    from packfree_plugin.gate.shrink import tiny_config_for

    with bypassed():
        model, stock, implementation = build_pair(transformers.PaliGemmaForConditionalGeneration,
                                                  tiny_config_for("paligemma"))
        proof = prove(model, stock, stock_name=implementation, diagnose=False)
    assert proof.exact, proof.verdict()


def test_paligemma_packed_prefix_lm_rows_with_images_equal_each_sample_alone() -> None:
    """PaliGemma's processor marks the prefix (image and prompt, attended bidirectionally) with token_type_ids 0
    and the suffix (the target, causal) with 1. Packed with an image per sample, every sample's logits equal that
    sample alone on stock, and one unpacked sample equals stock. The tolerance is float32's: Gemma's RMSNorm
    computes in float32 even in a float64 model; a prefix block that crossed samples differs by orders more."""
    model, stock = PALIGEMMA.pair()
    samples = [PALIGEMMA.sample([5, 6], [(1, 0)], [7, 8, 9], seed=1),
               PALIGEMMA.sample([10], [(1, 0)], [11, 12, 13, 14], seed=2),
               PALIGEMMA.sample([15, 16, 17, 18], [], [], seed=3)]
    for sample in samples:
        suffix = torch.zeros_like(sample["input_ids"])
        suffix[0, -2:] = 1
        sample["token_type_ids"] = suffix
    batch = VisionPackedCollator(model)(samples)
    with torch.no_grad():
        assert_close(model(**samples[0]).logits, stock(**samples[0]).logits, atol=EXACT, rtol=0, what="unpacked")
        packed = model(**{key: value for key, value in batch.items() if key != "labels"}).logits[0]
        alone = torch.cat([stock(**sample).logits[0] for sample in samples])
    assert_close(packed, alone, atol=1e-6, rtol=0, what="packed paligemma")


def test_a_tower_whose_patches_have_the_text_rows_shape_keeps_its_own_attention() -> None:
    """Qwen2-VL's vision tower takes ``[N, 1176]`` patches; with N = 4 and 4 text rows of 1176 tokens the shapes
    coincide. The tower once took the text rows' boundaries (a ValueError on a batch stock runs); now a 2-D float
    tensor is never a row of tokens, and the batch equals stock."""
    case = CASES["qwen2_vl"]
    model, stock = _pair("qwen2_vl")
    image = case.sample([5], [(2, 2)], [7], seed=1)
    patches, width = image["pixel_values"].shape
    rows = torch.randint(3, 200, (patches, width), generator=torch.Generator().manual_seed(0))
    rows[0, :image["input_ids"].shape[1]] = image["input_ids"][0]
    batch = {"input_ids": rows, "pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"],
             "mm_token_type_ids": (rows == case.image_token).long()}
    with torch.no_grad():
        assert_close(model(**batch).logits, stock(**batch).logits, atol=EXACT, rtol=0, what="qwen2_vl")
