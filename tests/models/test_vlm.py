"""Vision-language models under packfree: what is refused because it cannot be exact yet."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, Qwen2VLForConditionalGeneration

import packfree_plugin


def _tiny_qwen2_vl(implementation: str = "packfree"):
    packfree_plugin.register()
    config = AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=256, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, eos_token_id=2)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration._from_config(config, attn_implementation=implementation,
                                                        dtype=torch.float64).eval()


def test_one_sample_with_an_image_equals_stock() -> None:
    """Unpacked, with an image: the vision tower gets its own inputs' boundaries (it used to be checked against
    the text row's and fail), and the logits equal stock sdpa."""
    model, stock = _tiny_qwen2_vl(), _tiny_qwen2_vl("sdpa")
    stock.load_state_dict(model.state_dict())
    ids = torch.tensor([[5, 6, 252, 250, 7, 8]])
    pixels = torch.randn(4, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grid = torch.tensor([[1, 2, 2]])
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                  mm_token_type_ids=(ids == 250).long())  # as the processor returns it: 1 on image tokens
    with torch.no_grad():
        ours, theirs = model(**inputs).logits, stock(**inputs).logits
    assert torch.allclose(ours, theirs, atol=1e-10, rtol=0), (ours - theirs).abs().max()


def test_flat_position_ids_with_images_on_mrope_are_refused() -> None:
    """The collator's 2-D ids with an image would give every image token the wrong (t, h, w) position, in
    every sample: refused, with what to pass instead."""
    model = _tiny_qwen2_vl()
    ids = torch.tensor([[5, 6, 252, 250, 7, 0, 1, 252, 250, 8]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    pixels = torch.randn(8, 3 * 2 * 14 * 14, dtype=torch.float64)
    grid = torch.tensor([[1, 2, 2], [1, 2, 2]])
    with torch.no_grad(), pytest.raises(ValueError, match=r"2-D position_ids together with images"):
        model(input_ids=ids, position_ids=positions, pixel_values=pixels, image_grid_thw=grid)
