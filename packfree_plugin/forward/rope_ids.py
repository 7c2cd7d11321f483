"""Position ids on multimodal-RoPE models: whether a model uses MRoPE, whether a call carries images, the ids of a
packed row with images that came with 2-D ids or boundary keywords alone (each sample numbered by the model's own
``get_rope_index``, :mod:`.rope_samples`), and the refusal of ids whose form does not fit. Read by :mod:`.hook` with
the boundaries, and by the vision collator."""

from __future__ import annotations

from typing import Any

import inspect

import torch
from torch import nn

from ..boundaries import Boundaries, host_of, shape_disagreement
from ..classes import inherited_entry
from .context import kept_on
from .reading import packing_signs
from .rope_samples import GRID_KEYS, packed_rope_positions, rope_index_of
from .unpacked import carries_packing_signal

__all__ = ["ROPE_READS", "VISUAL_TOKEN_KEYS", "carries_images", "rope_ids_for_call", "rope_reads", "uses_mrope"]


_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs")
"""Arguments that say a call carries images or videos (precomputed vision outputs included)."""
VISUAL_TOKEN_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
"""Config attributes that hold a model's image / video placeholder token id."""
ROPE_READS = ("mm_token_type_ids", *GRID_KEYS.values())
"""What numbering a packed row's samples reads on the host: copied in the forward's one read (:func:`rope_reads`)."""
_NUMBERED = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE and GLM-4V"
"""The models whose packed samples packfree numbers itself (config entries with ``rope_per_sample``)."""
_EXPLICIT_IDS = ("the [3, B, T] (or [4, B, T]) ids of each sample's own get_rope_index, concatenated along T "
                 "(packfree_plugin.packing.VisionPackedCollator builds them)")


def carries_images(config: Any, arguments: dict[str, Any]) -> bool:
    """Whether a call has images or videos: a visual input (:data:`_VISUAL_INPUTS`; an empty ``mm_encoder_outputs``
    dict carries none), nonzero ``mm_token_type_ids``, or the config's image/video placeholder tokens in
    ``input_ids``."""
    for name in _VISUAL_INPUTS:
        value = arguments.get(name)
        if value is not None and not (isinstance(value, dict) and not any(v is not None for v in value.values())):
            return True
    token_types = arguments.get("mm_token_type_ids")
    if isinstance(token_types, torch.Tensor) and bool(host_of(token_types).any()):
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


def rope_reads(module: nn.Module, arguments: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors :func:`rope_ids_for_call` may read on the host (an MRoPE model's ``mm_token_type_ids`` and grids),
    for the forward's one read of the batch (:func:`.reading.boundaries_for_call`); none on other models."""
    if not _model_uses_mrope(module):
        return []
    return [value for name in ROPE_READS if isinstance(value := arguments.get(name), torch.Tensor)]


def rope_ids_for_call(module: nn.Module, arguments: dict[str, Any], boundaries: Boundaries | None
                      ) -> torch.Tensor | None:
    """The ``[R, B, T]`` ids to call ``module`` with in place of the batch's, or None to leave them as they are.

    On an MRoPE model with images (any of :func:`carries_images`'s signals), a packed row given 2-D ids (by
    :func:`~packfree_plugin.boundaries.id_starts`'s rule, or beside ``cu_seq_lens`` / ``seq_idx``) or boundary keywords
    alone gets every sample's own positions, numbered by the model's ``get_rope_index`` with the grids whose
    placeholders it holds (:func:`.rope_samples.packed_rope_positions`): what the model computes for each sample alone.
    2-D ids with one sample per row are the model's, as in stock (None). Refused: 3-D ids on a model without MRoPE
    (transformers fails deep inside), and a packed row whose samples packfree cannot number (no ``input_ids``,
    ``mm_token_type_ids`` or grids; a model it has no numbering for; grids that do not fit their samples)."""
    position_ids = arguments.get("position_ids")
    mrope = _model_uses_mrope(module)
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 3 and not mrope:
        raise ValueError(
            f"{type(module).__name__} got position_ids of shape {list(position_ids.shape)}: [R, B, T] ids are for "
            "multimodal RoPE, which this model does not use. Pass [B, T] ids"
        )
    if not mrope or not carries_images(getattr(module, "config", None), arguments):
        return None
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2:
        if not carries_packing_signal(arguments):
            return None  # one sample per row: the model reads its 2-D ids as stock does
        given = "2-D position_ids"
    elif position_ids is None and packing_signs(arguments):
        given = f"a packed batch ({', '.join(packing_signs(arguments))}) without position_ids"
    else:
        return None
    name = type(module).__name__
    rope_index = _per_sample_rope_index(module)
    lacking = _lacking(arguments, boundaries, rope_index is not None)
    if rope_index is None or lacking:
        raise ValueError(_refusal(name, given, lacking, numbered=rope_index is not None))
    tokens = arguments["input_ids"]
    if tuple(arguments["mm_token_type_ids"].shape) != tuple(tokens.shape):
        raise ValueError(shape_disagreement("mm_token_type_ids", arguments["mm_token_type_ids"], *tokens.shape))
    merge = module.config.vision_config.spatial_merge_size
    return packed_rope_positions(rope_index, arguments, boundaries, merge=merge,
                                 takes_seconds=_takes_seconds(module, rope_index), model=name)


def _per_sample_rope_index(module: nn.Module) -> Any:
    """The model's ``get_rope_index`` where packfree numbers its packed samples with it (its config's entry says
    ``rope_per_sample``, and it has a vision config with a spatial merge), else None."""
    config = getattr(module, "config", None)
    vision = getattr(config, "vision_config", None)
    if not inherited_entry(config).rope_per_sample or not isinstance(getattr(vision, "spatial_merge_size", None), int):
        return None
    return rope_index_of(module)


def _takes_seconds(module: nn.Module, rope_index: Any) -> bool:
    """Whether ``rope_index`` reads ``second_per_grid_ts`` (Qwen2.5-VL's), kept on the module."""
    return kept_on(module, "_packfree_rope_takes_seconds",
                   lambda: "second_per_grid_ts" in inspect.signature(rope_index).parameters)


def _lacking(arguments: dict[str, Any], boundaries: Boundaries | None, numbered: bool) -> list[str]:
    """What of the inputs numbering packed samples needs the call lacks (nothing where the model has no numbering)."""
    if not numbered:
        return []
    lacking = [name for name in ("input_ids", "mm_token_type_ids") if not isinstance(arguments.get(name), torch.Tensor)]
    if not any(isinstance(arguments.get(key), torch.Tensor) for key in GRID_KEYS.values()):
        lacking.append("image_grid_thw / video_grid_thw")
    if boundaries is None and not lacking:
        lacking.append("boundaries packfree could read")
    return lacking


def _refusal(name: str, given: str, lacking: list[str], *, numbered: bool) -> str:
    """Why a packed row with images cannot be numbered per sample, and what to pass."""
    if not numbered:
        return (f"{name} got {given} together with images or videos; its multimodal RoPE needs each token's (t, h, w) "
                f"position, which packfree numbers per packed sample only for {_NUMBERED}. Pass {_EXPLICIT_IDS}, or no "
                "position_ids for one sample per row (the model computes them)")
    return (f"{name} got {given} together with images or videos, without {' and '.join(lacking)}; its multimodal "
            "RoPE needs each token's (t, h, w) position, which packfree numbers per sample with the model's own "
            "get_rope_index. Pass input_ids, mm_token_type_ids ([B, T] like input_ids: 1 on image and 2 on video "
            "placeholders, as the processor returns it for each sample, concatenated like input_ids; "
            "DataCollatorWithFlattening drops it) and the samples' image_grid_thw / video_grid_thw in sample order; "
            f"or {_EXPLICIT_IDS}; or no position_ids for one sample per row (the model computes them)")
