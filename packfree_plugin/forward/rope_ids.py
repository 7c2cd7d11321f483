"""Position ids on multimodal-RoPE models: whether a model uses MRoPE, whether a call carries images, and the refusal of
ids whose form does not fit (read by :mod:`.hook` before the boundaries, and by the vision collator)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .context import kept_on
from .reading import packing_signs
from .unpacked import carries_packing_signal

__all__ = ["VISUAL_TOKEN_KEYS", "carries_images", "check_rope_ids", "uses_mrope"]


_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs")
"""Arguments that say a call carries images or videos (precomputed vision outputs included)."""
VISUAL_TOKEN_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
"""Config attributes that hold a model's image / video placeholder token id."""


def carries_images(config: Any, arguments: dict[str, Any]) -> bool:
    """Whether a call has images or videos: a visual input (:data:`_VISUAL_INPUTS`; an empty ``mm_encoder_outputs``
    dict carries none), nonzero ``mm_token_type_ids``, or the config's image/video placeholder tokens in
    ``input_ids``."""
    for name in _VISUAL_INPUTS:
        value = arguments.get(name)
        if value is not None and not (isinstance(value, dict) and not any(v is not None for v in value.values())):
            return True
    token_types = arguments.get("mm_token_type_ids")
    if isinstance(token_types, torch.Tensor) and bool(token_types.any()):
        return True
    tokens = arguments.get("input_ids")
    if not isinstance(tokens, torch.Tensor):
        return False
    placeholders = [getattr(config, name, None) for name in VISUAL_TOKEN_KEYS]
    placeholders = [token for token in placeholders if isinstance(token, int)]
    return bool(placeholders) and bool(torch.isin(tokens, torch.tensor(placeholders, device=tokens.device)).any())


def uses_mrope(config: Any) -> bool:
    """Whether a model's rotary positions are multimodal (MRoPE: separate t/h/w position planes)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for part in (config, text):
        rope = getattr(part, "rope_parameters", None) or getattr(part, "rope_scaling", None)
        if isinstance(rope, dict) and any("mrope" in str(item) for item in (*rope, *rope.values())):
            return True
    return False


def _model_uses_mrope(module: nn.Module) -> bool:
    """:func:`uses_mrope` of ``module``'s config, kept on the module after its first forward: its rotary embedding was
    built from that config, and reading it costs every forward (the text config's lookup, the rope dict's items)."""
    return kept_on(module, "_packfree_uses_mrope", lambda: uses_mrope(getattr(module, "config", None)))


def check_rope_ids(module: nn.Module, arguments: dict[str, Any]) -> None:
    """Refuse position ids whose form does not fit the model's rotary scheme: 3-D ids on a model without MRoPE
    (transformers fails deep inside); on an MRoPE model with images, 2-D ids on a packed row (the model would copy
    them into its three planes, and image tokens would lose their (t, h, w) positions in every sample, the first
    too; with one sample per row that is what stock does, and packfree does the same), and
    packed rows (``cu_seq_lens`` / ``seq_idx``) without ids (packfree would number each sample 0, 1, ... on every
    plane). Images are present when any of :func:`carries_images`'s signals says so: pixel values, grids,
    precomputed vision outputs, or placeholder tokens."""
    position_ids = arguments.get("position_ids")
    mrope = _model_uses_mrope(module)
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 3 and not mrope:
        raise ValueError(
            f"{type(module).__name__} got position_ids of shape {list(position_ids.shape)}: [R, B, T] ids are for "
            "multimodal RoPE, which this model does not use. Pass [B, T] ids"
        )
    if not mrope or not carries_images(getattr(module, "config", None), arguments):
        return
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2:
        if not carries_packing_signal(arguments):
            return  # one sample per row: the model reads its 2-D ids as stock does
        given = "2-D position_ids"
    elif position_ids is None and packing_signs(arguments):
        given = f"a packed batch ({', '.join(packing_signs(arguments))}) without position_ids"
    else:
        return
    raise ValueError(
        f"{type(module).__name__} got {given} together with images or videos; its multimodal RoPE needs each "
        "token's (t, h, w) position. Pass no position_ids for one sample per row (the model computes them), or the "
        "[3, B, T] (or [4, B, T]) ids of each sample's own get_rope_index, concatenated along T "
        "(packfree_plugin.packing.VisionPackedCollator builds them)"
    )

