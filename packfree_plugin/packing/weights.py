"""Loss weights that survive flattening: a feature's ``token_weights`` (one number per token) and ``sample_weight``
(one number) laid out on its tokens, as the batch's ``token_weights`` / ``sample_weights`` ``[B, T]`` float32 (0 on
padding), wherever the collator put the feature's tokens. :class:`~.rows.PackedCollator` lays them out itself;
:class:`WithLossWeights` wraps any other collator (``DataCollatorWithFlattening``, TRL's
``DataCollatorForLanguageModeling`` with or without ``padding_free``, a padding collator) and places them by the
boundaries of the batch it returns. :mod:`packfree_plugin.loss` reads them (docs/loss.md)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy
import torch

from ..forward.reading import boundaries_for_call

__all__ = ["SAMPLE_WEIGHT", "TOKEN_WEIGHTS", "WithLossWeights", "weights_of"]

TOKEN_WEIGHTS = "token_weights"
"""A feature's per-token weights, and the batch's ``[B, T]`` field."""
SAMPLE_WEIGHT = "sample_weight"
"""A feature's one weight; the batch carries it on the feature's tokens as ``sample_weights [B, T]``."""
SAMPLE_WEIGHTS = "sample_weights"


def weights_of(feature: Mapping[str, Any], index: int) -> tuple[list[float] | None, float | None]:
    """``(token weights, sample weight)`` of feature ``index`` (None where it has none). Raises ``ValueError`` for
    ``token_weights`` of another length than its ``input_ids`` (naming the feature and both lengths), and for
    weights that are not numbers."""
    tokens = feature.get(TOKEN_WEIGHTS)
    sample = feature.get(SAMPLE_WEIGHT)
    if tokens is not None:
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or \
                not all(isinstance(value, numbers.Real) and not isinstance(value, bool) for value in tokens):
            raise ValueError(f"feature {index} token_weights must be a sequence of numbers, got {tokens!r:.80}")
        length = len(feature["input_ids"])
        if len(tokens) != length:
            raise ValueError(f"feature {index} has {length} input_ids but {len(tokens)} token_weights: give one "
                             "weight per token, in the order of its input_ids (the labels' layout)")
        tokens = [float(value) for value in tokens]
    if sample is not None:
        sample = sample.item() if hasattr(sample, "item") else sample
        if not isinstance(sample, numbers.Real) or isinstance(sample, bool):
            raise ValueError(f"feature {index} sample_weight must be one number, got {sample!r:.80}")
        sample = float(sample)
    return tokens, sample


def check_all_or_none(found: Sequence[tuple[list[float] | None, float | None]]) -> tuple[bool, bool]:
    """Whether the features carry token weights and sample weights: every feature or none (else ``ValueError``,
    naming the first that disagrees with feature 0)."""
    present = []
    for slot, name in enumerate((TOKEN_WEIGHTS, SAMPLE_WEIGHT)):
        has = [weights[slot] is not None for weights in found]
        if any(has) and not all(has):
            index = has.index(not has[0])
            raise ValueError(f"feature {index} {'has' if has[index] else 'lacks'} {name}, feature 0 does not agree: "
                             f"give {name} to every feature of a batch or to none")
        present.append(bool(has) and has[0])
    return present[0], present[1]


class WithLossWeights:
    """``WithLossWeights(collator)``: ``collator``'s batch, plus the features' ``token_weights`` / ``sample_weight``
    laid out on their tokens as ``token_weights`` / ``sample_weights [B, T]`` (only the fields the features carry).

    The weight fields are taken off the features before ``collator`` sees them. The features' tokens are placed, in
    order, on the batch's sample tokens (its padding spans skipped; what is left after the last feature must be
    ignored labels, as a ``pad_to_multiple_of`` tail is); each feature must start and end a sample of the batch's
    boundaries, read as packfree's forward reads them. A collator that reorders or drops features (other than empty
    ones) is refused with ``ValueError``."""

    def __init__(self, collator: Callable[..., Mapping[str, Any]]) -> None:
        self.collator = collator

    def __call__(self, features: Sequence[Mapping[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        found = [weights_of(feature, index) for index, feature in enumerate(features)]
        has_tokens, has_samples = check_all_or_none(found)
        batch = dict(self.collator([{key: value for key, value in feature.items()
                                     if key not in (TOKEN_WEIGHTS, SAMPLE_WEIGHT)} for feature in features],
                                   *args, **kwargs))
        if not (has_tokens or has_samples):
            return batch
        lengths = [len(feature["input_ids"]) for feature in features]
        tokens = _feature_tokens(batch, [feature["input_ids"] for feature, length in zip(features, lengths) if length])
        kept = [(weights, length) for weights, length in zip(found, lengths) if length]
        shape = tuple(batch["input_ids"].shape)
        if has_tokens:
            batch[TOKEN_WEIGHTS] = _laid_out(tokens, shape, numpy.concatenate([w[0] for w, _ in kept]))
        if has_samples:
            batch[SAMPLE_WEIGHTS] = _laid_out(tokens, shape, numpy.repeat([w[1] for w, _ in kept],
                                                                          [n for _, n in kept]))
        return batch


def _feature_tokens(batch: Mapping[str, Any], features_ids: list[Any]) -> numpy.ndarray:
    """The flat ``[B * T]`` token indices of the features' tokens, in order, in ``batch`` (``features_ids``: the
    non-empty features' ``input_ids``); ``ValueError`` where the batch does not hold them there, in order, each as
    whole samples."""
    lengths = [len(ids) for ids in features_ids]
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("WithLossWeights wraps collators that return input_ids [B, T] tensors")
    boundaries = boundaries_for_call(dict(batch))
    if boundaries is None:
        raise ValueError("WithLossWeights cannot place the weights: the batch's padding mask has holes inside rows")
    is_padding = numpy.repeat(numpy.array(boundaries.padding, dtype=bool), boundaries.lengths)
    sample_tokens = numpy.flatnonzero(~is_padding)
    ends = numpy.cumsum(lengths)
    if len(ends) == 0 or ends[-1] > len(sample_tokens):
        raise ValueError(f"the collator's batch holds {len(sample_tokens)} sample tokens, the features "
                         f"{int(ends[-1]) if len(ends) else 0}: it dropped or cut some")
    offsets = set(boundaries.offsets)
    for index, (start, end) in enumerate(zip(ends - lengths, ends)):
        first, last = int(sample_tokens[start]), int(sample_tokens[end - 1])
        if first not in offsets or last + 1 not in offsets:
            raise ValueError(
                f"the collator's batch does not hold non-empty feature {index} ({lengths[index]} tokens) as whole "
                f"samples in feature order (its tokens would be {first}..{last} of the flattened batch): "
                "WithLossWeights places weights only where the collator keeps features in order (PackedCollator "
                "lays weights out itself)")
    placed = input_ids.reshape(-1).numpy()[sample_tokens[:ends[-1]]]
    wanted = numpy.concatenate([numpy.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=numpy.int64)
                                for ids in features_ids])
    if not numpy.array_equal(placed, wanted):
        index = int(numpy.searchsorted(ends, numpy.flatnonzero(placed != wanted)[0], side="right"))
        raise ValueError(f"the collator's batch does not hold non-empty feature {index}'s input_ids where the features "
                         "in order would put them: it reorders features (PackedCollator lays weights out itself)")
    rest = sample_tokens[ends[-1]:]
    labels = batch.get("labels")
    if len(rest) and (not isinstance(labels, torch.Tensor) or (labels.reshape(-1)[rest] != -100).any()):
        raise ValueError(f"the collator's batch holds {len(rest)} sample tokens after the last feature's that are "
                         "trained on: it holds tokens the features do not")
    return sample_tokens[:ends[-1]]


def _laid_out(tokens: numpy.ndarray, shape: tuple[int, int], values: numpy.ndarray) -> torch.Tensor:
    """``values`` placed at the flat ``tokens`` of a ``shape`` batch, 0 elsewhere: float32 ``[B, T]``."""
    flat = numpy.zeros(shape[0] * shape[1], dtype=numpy.float32)
    flat[tokens] = values
    return torch.from_numpy(flat.reshape(shape))
