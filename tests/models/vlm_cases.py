"""Tiny vision-language models and hand-built processor outputs for the VLM tests: one table entry per model
type, no hub access. Each image is built in the shapes its processor returns (pixel tensors, grids, masks) with
the number of placeholder tokens the model expects for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import packfree_plugin

VOCAB = 256
_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             vocab_size=VOCAB, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}
_SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
               patch_size=8)


@dataclass(frozen=True)
class Image:
    """One image as its processor returns it: the model inputs for it alone (``[1, ...]`` batch dim where the
    processor batches per row) and how many placeholder tokens stand for it in ``input_ids``."""

    inputs: dict[str, torch.Tensor]
    tokens: int


def _grid_image(patch: int) -> Callable[[tuple[int, int], torch.Generator], Image]:
    """Qwen-VL / GLM-4V processors: ``pixel_values [h*w, 3*2*patch*patch]`` (flattened patches, temporal patch 2),
    ``image_grid_thw [1, 3]``; a 2x2 merge gives ``h*w/4`` tokens."""

    def image(size: tuple[int, int], generator: torch.Generator) -> Image:
        h, w = size
        pixels = torch.randn(h * w, 3 * 2 * patch * patch, generator=generator, dtype=torch.float64)
        return Image({"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, h, w]])}, h * w // 4)

    return image


def _square_image(side: int, tokens: int) -> Callable[[tuple[int, int], torch.Generator], Image]:
    """LLaVA / Gemma3 / InternVL processors: ``pixel_values [tiles, 3, side, side]``; ``size = (tiles, _)``."""

    def image(size: tuple[int, int], generator: torch.Generator) -> Image:
        tiles = size[0]
        pixels = torch.randn(tiles, 3, side, side, generator=generator, dtype=torch.float64)
        return Image({"pixel_values": pixels}, tiles * tokens)

    return image


def _idefics_image(size: tuple[int, int], generator: torch.Generator) -> Image:
    """Idefics3 / SmolVLM processors: ``pixel_values [1, tiles, 3, 32, 32]`` with ``pixel_attention_mask
    [1, tiles, 32, 32]``; 16 patches of 8 pixels shuffled by scale factor 2 give 4 tokens per tile."""
    tiles = size[0]
    pixels = torch.randn(1, tiles, 3, 32, 32, generator=generator, dtype=torch.float64)
    mask = torch.ones(1, tiles, 32, 32, dtype=torch.bool)
    return Image({"pixel_values": pixels, "pixel_attention_mask": mask}, tiles * 4)


@dataclass(frozen=True)
class VLMCase:
    """A tiny VLM: its config, how its images look and how the processor marks them in the text."""

    model_type: str
    class_name: str
    config: dict[str, Any]
    image_token: int
    image: Callable[[tuple[int, int], torch.Generator], Image]
    sizes: tuple[tuple[int, int], ...]
    """Image sizes the tests use (grid ``(h, w)`` in patches, or ``(tiles, _)``); several where the model allows."""
    opens_image: tuple[int, ...] = ()
    """Tokens the processor puts before each image's placeholders (vision start, begin-of-image)."""
    token_type_key: str | None = None
    """Name of the per-token image marker the model takes (1 on image tokens), if any."""
    mrope: bool = False
    """Multimodal RoPE: positions from each sample's own ``get_rope_index``."""
    images_per_row: bool = False
    """Image tensors are ``[B, images, ...]`` (one entry per row), not ``[images, ...]``."""
    video_token: int | None = None
    """The placeholder of video tokens (MRoPE models; ``mm_token_type_ids`` 2 tells them from image tokens), None
    for models without video input here."""
    frames_apart: bool = False
    """The processor separates a video's frames by text (timestamps), each frame a block of its own placeholders
    (Qwen3-VL, GLM-4V); otherwise one block holds the whole video (Qwen2-VL, Qwen2.5-VL)."""
    video_seconds: bool = False
    """The processor returns ``second_per_grid_ts`` per video (Qwen2.5-VL), read by ``get_rope_index``."""

    def build(self, implementation: str) -> torch.nn.Module:
        """The tiny model in float64 (MoE experts eager), eval mode, same weights for every implementation (seeded)."""
        import transformers

        packfree_plugin.register()
        config = transformers.AutoConfig.for_model(self.model_type, **self.config)
        torch.manual_seed(0)
        cls = getattr(transformers, self.class_name)
        return cls._from_config(config, attn_implementation=implementation, dtype=torch.float64,
                                experts_implementation="eager").eval()  # grouped_mm takes no float64

    def pair(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """``(packfree model, stock sdpa model)`` built by :meth:`build`, the stock one given the packfree one's
        weights."""
        model, stock = self.build("packfree"), self.build("sdpa")
        stock.load_state_dict(model.state_dict())
        return model, stock

    def sample(self, text_before: list[int], sizes: list[tuple[int, int]], text_after: list[int],
               seed: int) -> dict[str, torch.Tensor]:
        """One sample as the processor returns it (``[1, T]`` tensors): text, each image's placeholders, text."""
        generator = torch.Generator().manual_seed(seed)
        ids = list(text_before)
        images = [self.image(size, generator) for size in sizes]
        for image in images:
            ids += [*self.opens_image, *[self.image_token] * image.tokens]
        ids += text_after
        row = torch.tensor([ids])
        sample: dict[str, torch.Tensor] = {"input_ids": row}
        if self.token_type_key:
            sample[self.token_type_key] = (row == self.image_token).long()
        for key in images[0].inputs if images else ():
            sample[key] = torch.cat([image.inputs[key] for image in images], dim=1 if self.images_per_row else 0)
        return sample


    def video_sample(self, text_before: list[int], grids: list[tuple[int, int, int]], text_after: list[int],
                     seed: int, image_sizes: tuple[tuple[int, int], ...] = ()) -> dict[str, torch.Tensor]:
        """One sample with videos (``(t, h, w)`` grids in patches: ``2t`` frames of ``14h x 14w`` pixels), after
        optional images, as the processor returns it: ``pixel_values_videos [t*h*w, 3*2*14*14]``, ``video_grid_thw
        [videos, 3]``, ``mm_token_type_ids`` 1 on image and 2 on video tokens, ``t*h*w/4`` placeholders per video
        (a block of ``h*w/4`` per frame behind a timestamp token where :attr:`frames_apart`)."""
        if self.video_token is None:
            raise ValueError(f"{self.model_type} has no video input in these cases")
        sample = self.sample(text_before, list(image_sizes), [], seed) if image_sizes else \
            {"input_ids": torch.tensor([text_before], dtype=torch.long)}
        generator = torch.Generator().manual_seed(seed + 1000)
        ids, types = sample["input_ids"][0].tolist(), (sample["input_ids"][0] == self.image_token).long().tolist()
        for t, h, w in grids:
            blocks = [(17 + frame, h * w // 4) for frame in range(t)] if self.frames_apart else [(None, t * h * w // 4)]
            for timestamp, tokens in blocks:
                opening = ([timestamp] if timestamp is not None else []) + list(self.opens_image)
                ids += opening + [self.video_token] * tokens
                types += [0] * len(opening) + [2] * tokens
        ids += text_after
        types += [0] * len(text_after)
        sample["input_ids"] = torch.tensor([ids])
        sample["mm_token_type_ids"] = torch.tensor([types])
        sample["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14,
                                                    generator=generator, dtype=torch.float64)
        sample["video_grid_thw"] = torch.tensor(grids)
        if self.video_seconds:
            sample["second_per_grid_ts"] = torch.tensor([0.5 * (index + 1) for index in range(len(grids))])
        return sample


CASES: dict[str, VLMCase] = {case.model_type: case for case in (
    VLMCase("qwen2_vl", "Qwen2VLForConditionalGeneration",
            dict(text_config={**_TEXT, "rope_parameters": _MROPE},
                 vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                                    spatial_merge_size=2, temporal_patch_size=2),
                 image_token_id=250, video_token_id=251, vision_start_token_id=252, eos_token_id=2),
            250, _grid_image(14), ((2, 2), (4, 2)), (252,), "mm_token_type_ids", mrope=True, video_token=251),
    VLMCase("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
            dict(text_config={**_TEXT, "rope_parameters": _MROPE},
                 vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                    fullatt_block_indexes=[1]),
                 image_token_id=250, video_token_id=251, vision_start_token_id=252, eos_token_id=2),
            250, _grid_image(14), ((2, 2), (4, 4)), (252,), "mm_token_type_ids", mrope=True, video_token=251,
            video_seconds=True),
    VLMCase("qwen3_vl", "Qwen3VLForConditionalGeneration",
            dict(text_config={**_TEXT, "rope_parameters": {**_MROPE, "mrope_interleaved": True}},
                 vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                    num_position_embeddings=16, deepstack_visual_indexes=[0]),
                 image_token_id=250, video_token_id=251, vision_start_token_id=252, eos_token_id=2),
            250, _grid_image(14), ((2, 2), (4, 2)), (252,), "mm_token_type_ids", mrope=True, video_token=251,
            frames_apart=True),
    VLMCase("glm4v", "Glm4vForConditionalGeneration",
            dict(text_config={**_TEXT, "rope_parameters": {**_MROPE, "mrope_section": [1, 1, 2],  # half of 16 * 0.5
                                                           "partial_rotary_factor": 0.5}},
                 vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    image_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                 image_token_id=250, video_token_id=251, image_start_token_id=252, image_end_token_id=253,
                 video_start_token_id=254, video_end_token_id=255, eos_token_id=2),
            250, _grid_image(14), ((2, 2), (4, 2)), (252,), "mm_token_type_ids", mrope=True, video_token=250,
            frames_apart=True),  # GLM-4V's processor writes the image placeholder for video frames too
    VLMCase("llava", "LlavaForConditionalGeneration",
            dict(text_config={"model_type": "llama", **_TEXT},
                 vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                                    projection_dim=32),
                 image_token_index=250, image_seq_length=4),
            250, _square_image(28, 4), ((1, 0),)),
    VLMCase("gemma3", "Gemma3ForConditionalGeneration",
            dict(text_config={**_TEXT, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
                 vision_config={"model_type": "siglip_vision_model", **_SIGLIP},
                 mm_tokens_per_image=4, boi_token_index=252, eoi_token_index=253, image_token_index=250),
            250, _square_image(32, 4), ((1, 0),), (252,), "token_type_ids"),
    VLMCase("idefics3", "Idefics3ForConditionalGeneration",
            dict(text_config={"model_type": "llama", **_TEXT}, vision_config=_SIGLIP, scale_factor=2,
                 image_token_id=250, pad_token_id=0),
            250, _idefics_image, ((1, 0), (2, 0)), images_per_row=True),
    VLMCase("smolvlm", "SmolVLMForConditionalGeneration",
            dict(text_config={"model_type": "llama", **_TEXT}, vision_config=_SIGLIP, scale_factor=2,
                 image_token_id=250, pad_token_id=0),
            250, _idefics_image, ((1, 0), (2, 0)), images_per_row=True),
    VLMCase("internvl", "InternVLForConditionalGeneration",
            dict(text_config={"model_type": "qwen2", **_TEXT},
                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=56, patch_size=14),
                 image_token_id=250, image_seq_length=4, downsample_ratio=0.5),
            250, _square_image(56, 4), ((1, 0), (2, 0))),
)}


PALIGEMMA = VLMCase(
    "paligemma", "PaliGemmaForConditionalGeneration",
    dict(text_config={"model_type": "gemma", **_TEXT},
         vision_config={"model_type": "siglip_vision_model", **_SIGLIP, "projection_dim": 64},
         image_token_index=250, projection_dim=64, hidden_size=64, pad_token_id=0),
    250, _square_image(32, 16), ((1, 0),))
"""PaliGemma (prefix-LM: its token_type_ids mark the suffix, not the image), 16 tokens per 32 px image; kept out
of :data:`CASES`, whose tests mark image tokens."""


_QWEN3_TOWER = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
_QWEN_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, eos_token_id=2)
_GATED_DELTA = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=["linear_attention",
                                                                                     "full_attention"])
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_QWEN3_5_ROPE = {**_MROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True, "partial_rotary_factor": 0.5}

MORE_MROPE: dict[str, VLMCase] = {case.model_type: case for case in (
    VLMCase("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration",
            dict(text_config={**_TEXT, **_EXPERTS, "rope_parameters": {**_MROPE, "mrope_interleaved": True}},
                 vision_config={**_QWEN3_TOWER, "deepstack_visual_indexes": [0]}, **_QWEN_TOKENS),
            250, _grid_image(14), ((2, 2), (4, 2)), (252,), "mm_token_type_ids", mrope=True, video_token=251,
            frames_apart=True),
    VLMCase("qwen3_5", "Qwen3_5ForConditionalGeneration",
            dict(text_config={**_TEXT, **_GATED_DELTA, "rope_parameters": _QWEN3_5_ROPE},
                 vision_config=_QWEN3_TOWER, **_QWEN_TOKENS),
            250, _grid_image(14), ((2, 2), (4, 4)), (252,), "mm_token_type_ids", mrope=True, video_token=251,
            frames_apart=True),
    VLMCase("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
            dict(text_config={**_TEXT, **_GATED_DELTA, **_EXPERTS, "shared_expert_intermediate_size": 32,
                              "rope_parameters": _QWEN3_5_ROPE},
                 vision_config=_QWEN3_TOWER, **_QWEN_TOKENS),
            250, _grid_image(14), ((2, 2), (4, 2)), (252,), "mm_token_type_ids", mrope=True, video_token=251,
            frames_apart=True),
)}
"""Multimodal-RoPE types beyond :data:`CASES` (a MoE text model, Qwen3.5's Gated DeltaNet hybrid), for the tests of
packed rows numbered per sample (``tests/models/test_mrope_collator.py``)."""


def _gemma4_image(size: tuple[int, int], generator: torch.Generator) -> Image:
    """Gemma 4's processor: ``pixel_values [1, patches, 3 * 4 * 4]`` (flattened 4-pixel patches in [0, 1]) with each
    patch's ``(x, y)`` in ``image_position_ids [1, patches, 2]``; a 4 x 4 grid pooled 2 x 2 gives 4 tokens."""
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    pixels = torch.rand(1, 16, 3 * 4 * 4, generator=generator, dtype=torch.float64)
    return Image({"pixel_values": pixels, "image_position_ids": torch.stack([xs, ys], dim=-1).reshape(1, 16, 2)}, 4)


GEMMA4 = VLMCase(
    "gemma4", "Gemma4ForConditionalGeneration",
    dict(text_config={**_TEXT, "global_head_dim": 16, "sliding_window": 4, "use_bidirectional_attention": "vision",
                      "layer_types": ["sliding_attention", "full_attention"], "vocab_size_per_layer_input": VOCAB,
                      "hidden_size_per_layer_input": 8},
         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                            position_embedding_size=16),
         audio_config=None, image_token_id=250, video_token_id=251, boi_token_id=252, eoi_token_id=253,
         audio_token_id=249, boa_token_id=248, eoa_token_index=247),
    250, _gemma4_image, ((1, 0),), token_type_key="mm_token_type_ids")
"""Gemma 4 with ``use_bidirectional_attention="vision"`` (its image tokens attend both ways on sliding layers); kept
out of :data:`CASES`, whose tests predate it."""

