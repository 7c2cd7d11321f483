"""Packed seq2seq batches: source and target samples of different lengths packed into encoder and decoder rows.

:class:`Seq2SeqPackedCollator` takes tokenised examples as ``DataCollatorForSeq2Seq`` does (``input_ids`` and
``labels`` lists, optionally ``decoder_input_ids``), puts them into rows under a token budget for each side, and
returns packfree's seq2seq input contract (docs/input-contract.md):

- encoder rows: ``input_ids [B, Te]``, ``attention_mask [B, Te]`` (0 on padding) and ``position_ids [B, Te]``
  restarting at 0 in every sample;
- decoder rows: ``labels [B, Td]`` (-100 on padding), ``decoder_attention_mask [B, Td]`` and
  ``decoder_position_ids [B, Td]`` restarting at 0 in every sample; ``decoder_input_ids`` when the examples carry
  them or a ``model`` is given (each sample's own shift of its labels), else the model shifts the labels of each
  sample itself under packfree.

Row ``i``'s ``k``-th decoder sample is the target of row ``i``'s ``k``-th encoder sample: both sides hold the same
examples in the same order. The batch goes to a model loaded with ``attn_implementation="packfree"`` (for example as
``Seq2SeqTrainer``'s ``data_collator``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .rows import _check_max_tokens

__all__ = ["Seq2SeqPackedCollator", "pack_pairs"]


def pack_pairs(source_lengths: Sequence[int], target_lengths: Sequence[int], *, max_source_tokens: int,
               max_target_tokens: int) -> list[list[int]]:
    """Example indices per row: each example goes, in order, to the first row where its source and its target both
    still fit their budgets (first fit). An example longer than a budget raises ``ValueError``."""
    _check_max_tokens(max_source_tokens, "max_source_tokens")
    _check_max_tokens(max_target_tokens, "max_target_tokens")
    rows: list[list[int]] = []
    used: list[tuple[int, int]] = []
    for index, (source, target) in enumerate(zip(source_lengths, target_lengths, strict=True)):
        if source < 1 or target < 1:
            raise ValueError(f"example {index} has an empty source or target ({source} and {target} tokens)")
        if source > max_source_tokens or target > max_target_tokens:
            raise ValueError(f"example {index} has {source} source and {target} target tokens, over the budgets "
                             f"max_source_tokens={max_source_tokens}, max_target_tokens={max_target_tokens}")
        row = next((r for r, (s, t) in enumerate(used)
                    if s + source <= max_source_tokens and t + target <= max_target_tokens), None)
        if row is None:
            rows.append([])
            used.append((0, 0))
            row = len(rows) - 1
        rows[row].append(index)
        used[row] = (used[row][0] + source, used[row][1] + target)
    return rows


class Seq2SeqPackedCollator:
    """Pack seq2seq examples into encoder and decoder rows (module docstring).

    Args:
        max_source_tokens: encoder tokens per row at most.
        max_target_tokens: decoder tokens per row at most.
        pad_token_id: the id written on padding in ``input_ids`` and ``decoder_input_ids``.
        label_pad_token_id: the label written on decoder padding (-100: ignored by the loss).
        model: optional seq2seq model with ``prepare_decoder_input_ids_from_labels`` (as ``DataCollatorForSeq2Seq``
            takes it): the collator then returns each sample's own shifted labels as ``decoder_input_ids``.
        pad_to_multiple_of: round ``Te`` and ``Td`` up to a multiple of this.
    """

    def __init__(self, max_source_tokens: int, max_target_tokens: int, *, pad_token_id: int = 0,
                 label_pad_token_id: int = -100, model: nn.Module | None = None,
                 pad_to_multiple_of: int | None = None) -> None:
        self.max_source_tokens = max_source_tokens
        self.max_target_tokens = max_target_tokens
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.model = model
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("Seq2SeqPackedCollator received no examples")
        missing = [i for i, f in enumerate(features) if "input_ids" not in f or "labels" not in f]
        if missing:
            raise ValueError(f"example {missing[0]} lacks input_ids or labels; Seq2SeqPackedCollator packs tokenised "
                             "(source, target) pairs")
        sources = [_ids(f["input_ids"]) for f in features]
        targets = [_ids(f["labels"]) for f in features]
        decoder_inputs = self._decoder_inputs(features, targets)
        rows = pack_pairs([len(s) for s in sources], [len(t) for t in targets],
                          max_source_tokens=self.max_source_tokens, max_target_tokens=self.max_target_tokens)
        batch = _pack_side(rows, sources, self.pad_token_id, self.pad_to_multiple_of, ids="input_ids",
                           mask="attention_mask", positions="position_ids")
        batch.update(_pack_side(rows, targets, self.label_pad_token_id, self.pad_to_multiple_of, ids="labels",
                                mask="decoder_attention_mask", positions="decoder_position_ids"))
        if decoder_inputs is not None:
            batch["decoder_input_ids"] = _pack_side(rows, decoder_inputs, self.pad_token_id, self.pad_to_multiple_of,
                                                    ids="decoder_input_ids")["decoder_input_ids"]
        return batch

    def _decoder_inputs(self, features: Sequence[Mapping[str, Any]],
                        targets: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Each example's decoder inputs: its own ``decoder_input_ids``, else its labels shifted by ``model``, else
        None (the model shifts each sample's labels under packfree)."""
        if all("decoder_input_ids" in f for f in features):
            given = [_ids(f["decoder_input_ids"]) for f in features]
            if any(len(g) != len(t) for g, t in zip(given, targets)):
                raise ValueError("an example's decoder_input_ids and labels differ in length")
            return given
        prepare = getattr(self.model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is None:
            return None
        return [prepare(labels=t[None])[0].to(torch.long) for t in targets]


def _ids(values: Any) -> torch.Tensor:
    """A 1-D int64 tensor of an example's token ids."""
    tensor = torch.as_tensor(values, dtype=torch.long)
    if tensor.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got shape {tuple(tensor.shape)}")
    return tensor


def _pack_side(rows: list[list[int]], samples: list[torch.Tensor], pad: int, multiple: int | None, *, ids: str,
               mask: str | None = None, positions: str | None = None) -> dict[str, torch.Tensor]:
    """``rows`` of ``samples`` laid out as ``[B, T]`` ``ids`` (``pad`` after each row's samples), and where named
    its padding ``mask`` (1 on tokens) and ``positions`` (0, 1, ... in every sample, 0 on padding)."""
    width = max(sum(len(samples[i]) for i in row) for row in rows)
    if multiple:
        width = -(-width // multiple) * multiple
    out = {ids: torch.full((len(rows), width), pad, dtype=torch.long)}
    if mask:
        out[mask] = torch.zeros(len(rows), width, dtype=torch.long)
    if positions:
        out[positions] = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            length = len(samples[i])
            out[ids][r, start:start + length] = samples[i]
            if mask:
                out[mask][r, start:start + length] = 1
            if positions:
                out[positions][r, start:start + length] = torch.arange(length)
            start += length
    return out
