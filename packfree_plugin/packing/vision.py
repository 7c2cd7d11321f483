"""Packing for vision-language models: samples that carry their own images, laid out as packed rows.

:class:`VisionPackedCollator` takes per-sample processor outputs (``input_ids``, optional ``labels``, the image
tensors the model takes: ``pixel_values`` with ``image_grid_thw``, ``pixel_attention_mask``, ...) and returns
rows the model reads as separate samples:

- text fields as :class:`~packfree_plugin.packing.PackedCollator` lays them out (same rows, same order: samples go
  to rows by :func:`~packfree_plugin.packing.pack_best_fit_decreasing`), labels -100 at every sample's first token;
- every image and video tensor (``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ...)
  concatenated in sample order, row after row, which is the order in which the model fills its image and video
  placeholders (Idefics3/SmolVLM keep a row dimension: ``[B, images, ...]``, rows padded with all-zero
  images, which those models drop, as their processors do);
- positions: on a multimodal-RoPE model (Qwen2/2.5/3-VL, GLM-4V) each sample's own ``get_rope_index`` (given its
  image and video grids), concatenated along T (``[3, B, T]``), so image and video tokens keep their (t, h, w)
  positions; otherwise ``[B, T]`` ids restarting at 0 in every sample. Either way packfree reads the boundaries
  from them (a padding span is a segment of its own, and ``attention_mask`` marks it);
- ``attention_mask`` ``[B, T]`` always, ones where no row is padded (marking padding spans; Gemma 3's and Gemma 4's
  image blocks are laid out per sample with or without it).

GLM-4V writes one placeholder for image and video tokens alike, so one call of it takes images or videos, not both
(stock's own limit): collate its image samples and its video samples into different batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..classes import inherited_entry
from ..forward.rope_ids import uses_mrope
from ..forward.rope_samples import lay_out_positions, rope_index_of, sample_positions
from .rows import PackedCollator, pack_best_fit_decreasing

__all__ = ["VisionPackedCollator"]

_TEXT_KEYS = ("input_ids", "labels")
_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
"""Per-token image markers (1 on image tokens): laid out like ``input_ids``, 0 on padding."""
_ROPE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""What ``get_rope_index`` reads besides ``input_ids`` and ``mm_token_type_ids``."""


def _ids(value: Any, what: str) -> torch.Tensor:
    """``value`` (list, ``[T]`` or ``[1, T]`` tensor) as a ``[T]`` int64 tensor."""
    tensor = torch.as_tensor(value)
    if tensor.ndim == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.ndim != 1 or tensor.is_floating_point():
        raise ValueError(f"{what} must be integer ids of shape [T] or [1, T], got {list(tensor.shape)} {tensor.dtype}")
    return tensor.long()


class VisionPackedCollator:
    """Collate VLM samples into packed rows; see the module docstring for the layout.

    Args:
        model: the model the rows are for: its config tells whether positions are multimodal (then its
            ``get_rope_index`` numbers each sample) and how it batches image tensors. Optional when ``rope_index``
            is given, or for a model with ordinary RoPE.
        rope_index: ``get_rope_index(input_ids [1, T], mm_token_type_ids [1, T], image_grid_thw=..., ...)`` ->
            ``(positions [R, 1, T], deltas)``; overrides the model's. Its presence means multimodal positions.
        images_per_row: image tensors are ``[B, images, ...]``; default from the config class's quirk (Idefics3, SmolVLM).
        rows_per_batch / max_tokens / pad_token_id / label_pad: as :class:`PackedCollator` (``max_tokens`` is the
            row length when ``rows_per_batch > 1``, else an optional budget). Samples are never truncated: that
            could cut an image's placeholders.

    Features: mappings with ``input_ids`` and optional ``labels`` (all or none), the token marker the model takes
    (``mm_token_type_ids`` / ``token_type_ids``), an all-ones ``attention_mask`` if any, and image tensors as the
    processor returns them for that sample alone. Output: ``input_ids``, ``labels``, ``position_ids`` (``[B, T]``,
    or ``[R, B, T]`` for multimodal RoPE), ``attention_mask`` ``[B, T]`` (0 on padding), the token markers
    ``[B, T]``, and every image key concatenated over the samples that have it.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        rope_index: Callable[..., tuple[torch.Tensor, Any]] | None = None,
        images_per_row: bool | None = None,
        rows_per_batch: int = 1,
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        label_pad: int = -100,
    ) -> None:
        config = getattr(model, "config", None)
        if rope_index is None and config is not None and uses_mrope(config):
            rope_index = rope_index_of(model)
            if rope_index is None:
                raise ValueError(f"{type(model).__name__} uses multimodal RoPE but has no get_rope_index; pass "
                                 "rope_index=")
        self.rope_index = rope_index
        if images_per_row is None:
            images_per_row = inherited_entry(config).images_per_row
        self.images_per_row = images_per_row
        self.pad_token_id = int(pad_token_id)
        self._text = PackedCollator(rows_per_batch, max_tokens, pad_token_id, label_pad, return_seq_idx=False,
                                   return_flash_attn_kwargs=False)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or not features:
            raise ValueError(f"features must be a non-empty list of mappings, got {type(features).__name__}")
        samples = [self._sample(i, feature) for i, feature in enumerate(features)]
        samples = [sample for sample in samples if len(sample["input_ids"])]  # as PackedCollator drops them
        batch = self._text([{key: sample[key] for key in _TEXT_KEYS if key in sample} for sample in samples])
        rows = self._rows(samples)
        row_len = batch["input_ids"].shape[1]
        for key in _TOKEN_KEYS:
            if any(key in sample for sample in samples):
                batch[key] = self._per_token(rows, samples, key, row_len)
        if self.rope_index is not None:
            batch["position_ids"] = self._rope_positions(rows, samples, row_len)
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        batch.update(self._images(rows, samples))
        return batch

    def _sample(self, index: int, feature: Mapping[str, Any]) -> dict[str, Any]:
        """One feature with ``input_ids``, ``labels`` and token markers as ``[T]`` tensors, the rest as given."""
        if not isinstance(feature, Mapping) or "input_ids" not in feature:
            raise ValueError(f"feature {index} must be a mapping with 'input_ids'")
        sample = {key: value for key, value in feature.items() if value is not None and key != "attention_mask"}
        for key in (*_TEXT_KEYS, *_TOKEN_KEYS):
            if key in sample:
                sample[key] = _ids(sample[key], f"feature {index} {key}")
                if len(sample[key]) != len(sample["input_ids"]):
                    raise ValueError(f"feature {index} has {len(sample['input_ids'])} input_ids but "
                                     f"{len(sample[key])} {key}")
        mask = feature.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).all()):
            raise ValueError(f"feature {index} has padding in its attention_mask; pass each sample unpadded")
        if self.rope_index is not None and any(key in sample for key in _ROPE_KEYS) \
                and "mm_token_type_ids" not in sample:
            raise ValueError(f"feature {index} has images but no mm_token_type_ids, which get_rope_index needs to "
                             "place them (the processor returns it)")
        return sample

    def _rows(self, samples: list[dict[str, Any]]) -> list[list[int]]:
        """Sample indices of each row, as :class:`PackedCollator` lays them out."""
        lengths = [len(sample["input_ids"]) for sample in samples]
        if self._text.rows_per_batch == 1:
            return [list(range(len(samples)))]
        bins = pack_best_fit_decreasing(lengths, self._text.max_tokens)
        return [sorted(members) for members in bins] + [[] for _ in range(self._text.rows_per_batch - len(bins))]

    def _per_token(self, rows: list[list[int]], samples: list[dict[str, Any]], key: str, row_len: int) -> torch.Tensor:
        """``[B, T]`` of a per-token field (0 where a sample lacks it, and on padding)."""
        out = torch.zeros(len(rows), row_len, dtype=torch.int64)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                length = len(samples[i]["input_ids"])
                if key in samples[i]:
                    out[r, start:start + length] = samples[i][key]
                start += length
        return out

    def _rope_positions(self, rows: list[list[int]], samples: list[dict[str, Any]], row_len: int) -> torch.Tensor:
        """``[R, B, T]``: each sample's own ``get_rope_index``; a padding span counts 0, 1, ... on every plane."""
        per_row = []
        for row in rows:
            pieces = [self._sample_positions(samples[i]) for i in row]
            used = sum(piece.shape[-1] for piece in pieces)
            per_row.append(pieces + [torch.arange(row_len - used)])
        return lay_out_positions(per_row)

    def _sample_positions(self, sample: dict[str, Any]) -> torch.Tensor:
        """``[R, T]`` multimodal positions of one sample, numbered as the model numbers it alone."""
        ids = sample["input_ids"]
        markers = sample.get("mm_token_type_ids", torch.zeros_like(ids))
        return sample_positions(self.rope_index, ids, markers, **{key: sample[key] for key in _ROPE_KEYS
                                                                   if key in sample})

    def _images(self, rows: list[list[int]], samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Every image key, its tensors concatenated in sample order (row after row)."""
        keys = [key for sample in samples for key in sample if key not in (*_TEXT_KEYS, *_TOKEN_KEYS)]
        images: dict[str, torch.Tensor] = {}
        order = [i for row in rows for i in row]
        for key in dict.fromkeys(keys):
            parts = [torch.as_tensor(samples[i][key]) for i in order if key in samples[i]]
            if not self.images_per_row:
                images[key] = torch.cat(parts)
                continue
            if any(part.shape[0] != 1 for part in parts):
                raise ValueError(f"{key} must be [1, images, ...] per sample for this model (as its processor returns "
                                 f"it), got {[list(part.shape) for part in parts]}")
            per_row = [torch.cat([torch.as_tensor(samples[i][key])[0] for i in row if key in samples[i]] or
                                 [parts[0][0, :0]]) for row in rows]
            most = max(part.shape[0] for part in per_row)
            images[key] = torch.stack([torch.cat([part, part.new_zeros(most - part.shape[0], *part.shape[1:])])
                                       for part in per_row])
        return images
