"""Token-budget packing: which samples share a row, and the collator that lays a batch out as packed rows.

Data flows top to bottom:

1. :func:`pack_best_fit_decreasing` puts sample lengths into bins of at most ``max_tokens`` tokens.
2. :class:`TokenBudgetBatchSampler` packs a whole dataset once per epoch and yields, per step, the dataset
   indices of ``rows_per_batch`` bins.
3. :class:`PackedCollator` turns those samples into ``rows_per_batch`` packed rows plus the boundary fields
   every packed kernel needs (``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``, ``max_length_q/k``).

Boundary fields (the collator's output contract):

- ``cu_seq_lens_q`` / ``cu_seq_lens_k``: ``[N+1]``, int32, cumulative segment lengths over the flattened
  ``B*T`` tokens (row after row), ``cu[0] = 0``, ``cu[-1] = B*T``; N = number of segments. A padding span at
  the end of a row is a segment of its own, so no segment crosses a row end.
- ``seq_idx``: ``[B, T]``, int32, the segment each token belongs to, counted over the flattened batch
  (``seq_idx == k`` exactly on ``cu[k]:cu[k+1]``). With ``rows_per_batch=1`` there is no padding and segment
  ``k`` is the ``k``-th non-empty feature, as in :class:`transformers.DataCollatorWithFlattening`.
- ``position_ids``: ``[B, T]``, int64, restarting at ``position_ids_start`` (default 0) at every segment start
  (padding spans too). RoBERTa-style models number a lone sample from ``padding_idx + 1``: pass that as
  ``position_ids_start`` (as ``DataCollatorWithFlattening(position_ids_start=...)``) to number each packed sample so.
- ``max_length_q`` / ``max_length_k``: python ints, the longest segment (padding spans included).

With ``rows_per_batch=1`` the output equals ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)`` on every field both produce (B = 1, T = total tokens, no padding).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from .weights import SAMPLE_WEIGHTS, TOKEN_WEIGHTS, check_all_or_none, weights_of

__all__ = [
    "PackedCollator",
    "TokenBudgetBatchSampler",
    "pack_best_fit_decreasing",
    "packing_efficiency",
]


def _check_max_tokens(max_tokens: Any, name: str = "max_tokens") -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{name} must be a positive int, got {max_tokens!r}")
    return max_tokens


def _effective_lengths(lengths: Sequence[int], max_tokens: int, truncate: bool) -> list[int]:
    """Validated lengths, each cut to ``max_tokens`` when ``truncate`` (else an oversize sample raises)."""
    out: list[int] = []
    for i, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int):
            try:
                as_int = int(length)  # numpy / 0-d torch integers
            except (TypeError, ValueError):
                as_int = None
            if as_int is None or as_int != length:
                raise ValueError(f"length of sample {i} must be an int, got {length!r}")
            length = as_int
        if length < 0:
            raise ValueError(f"sample {i} has negative length {length}")
        if length > max_tokens:
            if not truncate:
                raise ValueError(
                    f"sample {i} has {length} tokens > max_tokens={max_tokens}; "
                    "raise max_tokens, drop the sample, or pass truncate=True to cut it to max_tokens"
                )
            length = max_tokens
        out.append(length)
    return out


def pack_best_fit_decreasing(
    lengths: Sequence[int], max_tokens: int, *, truncate: bool = False
) -> list[list[int]]:
    """Pack samples into bins of at most ``max_tokens`` tokens by best-fit decreasing.

    Samples are taken longest first (ties: in the order given) and each goes into the open bin it fills the
    most (ties: the bin opened first), or into a new bin when none has room. The open bins are kept sorted by free space, so each
    placement is one binary search plus a list insert (``O(n log n + n * bins)`` worst case, fast in practice).

    Args:
        lengths: ``[n]`` token count of every sample.
        max_tokens: capacity of one bin (one packed row).
        truncate: keyword-only; count a sample longer than ``max_tokens`` as ``max_tokens`` long (the caller
            cuts it) instead of raising.

    Returns:
        Bins in the order they were opened; each lists sample indices in the order they were placed
        (non-increasing length). Every index appears exactly once; zero-length samples are placed too.
        Deterministic: a function of ``lengths`` and ``max_tokens`` only.

    Restriction property (what :class:`TokenBudgetBatchSampler` relies on): for any subset of the returned
    bins, packing the lengths of their samples again, listed in their original relative order, returns
    exactly those bins (up to renumbering). Each such sample saw the same states of those bins in both runs.

    Raises:
        ValueError: ``max_tokens`` is not a positive int, a length is negative or not an int, or a sample is
            longer than ``max_tokens`` and ``truncate`` is false (the message names the sample).
    """
    max_tokens = _check_max_tokens(max_tokens)
    sizes = _effective_lengths(lengths, max_tokens, truncate)
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: ties keep input order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for i in order:
        size = sizes[i]
        pos = bisect.bisect_left(free, (size, -1))  # tightest bin with room; lowest id among equals
        if pos < len(free):
            remaining, b = free.pop(pos)
        else:
            remaining, b = max_tokens, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (remaining - size, b))
    return bins


def packing_efficiency(bins: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> float:
    """Real tokens / row capacity: ``sum(min(lengths[i], max_tokens) for i in bins) / (len(bins) * max_tokens)``.

    Samples are counted at most ``max_tokens`` long (as :func:`pack_best_fit_decreasing` with
    ``truncate=True`` counts them). Returns ``0.0`` for no bins.

    Raises:
        ValueError: an index is out of range, or a bin holds more than ``max_tokens`` tokens.
    """
    max_tokens = _check_max_tokens(max_tokens)
    if not bins:
        return 0.0
    real = 0
    for b, members in enumerate(bins):
        total = 0
        for i in members:
            if not 0 <= i < len(lengths):
                raise ValueError(f"bin {b} holds index {i}, outside 0..{len(lengths) - 1}")
            total += min(int(lengths[i]), max_tokens)
        if total > max_tokens:
            raise ValueError(f"bin {b} holds {total} tokens > max_tokens={max_tokens}")
        real += total
    return real / (len(bins) * max_tokens)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batch sampler whose every batch packs into ``rows_per_batch`` rows of ``max_tokens`` tokens.

    Each epoch the dataset order is shuffled (``torch.Generator`` seeded with ``seed + epoch``), the whole
    dataset is packed by :func:`pack_best_fit_decreasing` (ties broken by the shuffled order, so bins differ
    between epochs), the bins are shuffled, and every ``rows_per_batch`` consecutive bins form one batch.
    A batch lists its indices in the epoch's shuffled order, so :class:`PackedCollator` with the same
    ``max_tokens`` and ``rows_per_batch`` re-packs them into exactly those rows (see the restriction property
    of :func:`pack_best_fit_decreasing`) and never runs out of rows.

    The number of bins depends only on the multiset of lengths, so ``len(sampler)`` is the same every epoch.

    Args:
        lengths: ``[n]`` token count of every dataset item (as the collator will see it).
        max_tokens: tokens per row.
        rows_per_batch: rows per batch (the collator's B).
        shuffle: reshuffle every epoch; ``False`` yields the bins of the dataset order, in packing order.
        seed: base seed; the epoch is added (call :meth:`set_epoch` before each epoch).
        drop_last: drop the last batch when it has fewer than ``rows_per_batch`` bins.
        truncate: keyword-only; count an item longer than ``max_tokens`` as ``max_tokens`` (pass the same to
            :class:`PackedCollator`) instead of raising ``ValueError``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        rows_per_batch: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        truncate: bool = False,
    ) -> None:
        self.max_tokens = _check_max_tokens(max_tokens)
        if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be a positive int, got {rows_per_batch!r}")
        self.lengths = _effective_lengths(lengths, self.max_tokens, truncate)
        self.rows_per_batch = rows_per_batch
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.truncate = truncate
        self.epoch = 0
        num_bins = len(pack_best_fit_decreasing(self.lengths, self.max_tokens))
        self._num_batches = (
            num_bins // rows_per_batch if drop_last else math.ceil(num_bins / rows_per_batch)
        )

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration's shuffle (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.lengths)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            generator = None
            order = list(range(n))
        bins = pack_best_fit_decreasing([self.lengths[i] for i in order], self.max_tokens)
        if generator is not None:
            bins = [bins[j] for j in torch.randperm(len(bins), generator=generator).tolist()]
        rows = self.rows_per_batch
        for start in range(0, len(bins), rows):
            group = bins[start : start + rows]
            if self.drop_last and len(group) < rows:
                return
            positions = sorted(p for members in group for p in members)  # the epoch's order
            yield [order[p] for p in positions]


_Sample = tuple[list[int], list[int] | None, tuple[list[float] | None, float | None]]
"""A sample's input_ids, labels (or None), and token weights and sample weight (:func:`.weights.weights_of`)."""


def _as_int_list(value: Any, what: str) -> list[int]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a sequence of ints, got {type(value).__name__}")
    out: list[int] = []
    for v in value:
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))  # python and numpy integers
        except TypeError:
            raise ValueError(f"{what} must hold ints only, found {v!r}") from None
    return out


class PackedCollator:
    """Collate features into packed rows with exact sequence boundaries.

    ``rows_per_batch=1``: one flattened row, ``B = 1``, ``T`` = total tokens, no padding; the output equals
    ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` on every
    field both produce. ``max_tokens``, when given, is a budget: more tokens raise ``ValueError``.

    ``rows_per_batch=B > 1``: ``B`` rows of exactly ``T = max_tokens`` tokens. Samples are assigned to rows by
    :func:`pack_best_fit_decreasing` (within a row they keep the order they came in); the tail of each row
    is padding (``pad_token_id``, labels ``label_pad``, position_ids ``start, start + 1, ...`` so it is a segment
    of its own), and ``attention_mask`` (``[B, T]``, int64, 0 on padding) is emitted only when some row is padded.
    Rows left without samples are one padding segment each.

    Output (see the module docstring for the boundary fields): ``input_ids [B, T]`` int64, ``labels [B, T]``
    int64 (``label_pad`` on the first token of every sample, as ``DataCollatorWithFlattening`` with
    ``separator_id=-100``; the sample's own labels, else its input_ids, elsewhere), ``position_ids [B, T]``,
    ``seq_idx [B, T]`` int32, ``cu_seq_lens_q/k [N+1]`` int32, ``max_length_q/k`` ints.

    Args:
        rows_per_batch: B.
        max_tokens: row length; required when ``rows_per_batch > 1``.
        pad_token_id: input id of padding tokens.
        label_pad: label of padding tokens and of every sample's first token.
        return_seq_idx / return_flash_attn_kwargs / return_position_ids: emit those fields.
        position_ids_start: keyword-only; the first position id of every segment (0; ``padding_idx + 1`` for
            RoBERTa-style models, ``2`` for RoBERTa itself, which then numbers each sample as it numbers it alone).
        truncate: keyword-only; cut samples longer than ``max_tokens`` to ``max_tokens`` instead of raising.

    Features are mappings with ``input_ids`` (list, tensor or array of ints) and optional ``labels`` of the
    same length (all features or none). Empty samples are dropped, as ``DataCollatorWithFlattening`` does. Loss
    weights (all features or none, :mod:`.weights`): a feature's ``token_weights`` (one per token) and
    ``sample_weight`` (one number) come out as ``token_weights`` / ``sample_weights [B, T]`` float32, on its tokens
    (0 on padding), for :mod:`packfree_plugin.loss`.
    """

    def __init__(
        self,
        rows_per_batch: int = 1,
        max_tokens: int | None = None,
        pad_token_id: int = 0,
        label_pad: int = -100,
        return_seq_idx: bool = True,
        return_flash_attn_kwargs: bool = True,
        return_position_ids: bool = True,
        *,
        truncate: bool = False,
        position_ids_start: int = 0,
    ) -> None:
        if isinstance(position_ids_start, bool) or not isinstance(position_ids_start, int) or position_ids_start < 0:
            raise ValueError(f"position_ids_start must be an int >= 0, got {position_ids_start!r}")
        if isinstance(rows_per_batch, bool) or not isinstance(rows_per_batch, int) or rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be a positive int, got {rows_per_batch!r}")
        if max_tokens is not None:
            max_tokens = _check_max_tokens(max_tokens)
        elif rows_per_batch > 1:
            raise ValueError(f"rows_per_batch={rows_per_batch} > 1 needs max_tokens (the row length)")
        if truncate and max_tokens is None:
            raise ValueError("truncate=True needs max_tokens")
        self.rows_per_batch = rows_per_batch
        self.max_tokens = max_tokens
        self.pad_token_id = int(pad_token_id)
        self.label_pad = int(label_pad)
        self.return_seq_idx = return_seq_idx
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_position_ids = return_position_ids
        self.truncate = truncate
        self.position_ids_start = position_ids_start

    def _samples(self, features: Sequence[Mapping[str, Any]]) -> list[_Sample]:
        """``(input_ids, labels or None, loss weights)`` of every non-empty feature, validated."""
        if isinstance(features, Mapping) or not isinstance(features, Sequence) or len(features) == 0:
            raise ValueError(f"features must be a non-empty list of mappings, got {type(features).__name__}")
        with_labels = None
        samples: list[_Sample] = []
        weights = [weights_of(feature, i) if isinstance(feature, Mapping) and "input_ids" in feature else (None, None)
                   for i, feature in enumerate(features)]
        check_all_or_none(weights)
        for i, feature in enumerate(features):
            if not isinstance(feature, Mapping) or "input_ids" not in feature:
                raise ValueError(f"feature {i} must be a mapping with 'input_ids', got {feature!r:.80}")
            ids = _as_int_list(feature["input_ids"], f"feature {i} input_ids")
            has_labels = feature.get("labels") is not None
            if with_labels is None:
                with_labels = has_labels
            elif has_labels != with_labels:
                raise ValueError(f"feature {i} {'has' if has_labels else 'lacks'} labels, feature 0 does not agree")
            labels = None
            if has_labels:
                labels = _as_int_list(feature["labels"], f"feature {i} labels")
                if len(labels) != len(ids):
                    raise ValueError(f"feature {i} has {len(ids)} input_ids but {len(labels)} labels")
            if self.max_tokens is not None and len(ids) > self.max_tokens:
                if not self.truncate:
                    raise ValueError(
                        f"feature {i} has {len(ids)} tokens > max_tokens={self.max_tokens}; "
                        "pass truncate=True to cut it"
                    )
                ids = ids[: self.max_tokens]
                labels = None if labels is None else labels[: self.max_tokens]
            token_weights, sample_weight = weights[i]
            if ids:
                samples.append((ids, labels, (None if token_weights is None else token_weights[:len(ids)],
                                              sample_weight)))
        if not samples:
            raise ValueError("PackedCollator received a batch where every example is empty")
        return samples

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        samples = self._samples(features)
        lengths = [len(ids) for ids, _, _ in samples]
        if self.rows_per_batch == 1:
            if self.max_tokens is not None and sum(lengths) > self.max_tokens:
                raise ValueError(f"batch holds {sum(lengths)} tokens > max_tokens={self.max_tokens}")
            rows = [list(range(len(samples)))]
            row_len = sum(lengths)
        else:
            assert self.max_tokens is not None
            bins = pack_best_fit_decreasing(lengths, self.max_tokens)
            if len(bins) > self.rows_per_batch:
                raise ValueError(
                    f"samples of lengths {lengths} need {len(bins)} rows of {self.max_tokens} tokens, "
                    f"rows_per_batch={self.rows_per_batch}"
                )
            rows = [sorted(b) for b in bins] + [[] for _ in range(self.rows_per_batch - len(bins))]
            row_len = self.max_tokens

        input_ids: list[list[int]] = []
        labels: list[list[int]] = []
        position_ids: list[list[int]] = []
        seq_idx: list[list[int]] = []
        mask: list[list[int]] = []
        weights: dict[str, list[list[float]]] = {TOKEN_WEIGHTS: [], SAMPLE_WEIGHTS: []}
        segments: list[int] = []
        for row in rows:
            r_weights: dict[str, list[float]] = {TOKEN_WEIGHTS: [], SAMPLE_WEIGHTS: []}
            r_ids: list[int] = []
            r_labels: list[int] = []
            r_pos: list[int] = []
            r_seq: list[int] = []
            for i in row:
                ids, own_labels, (token_weights, sample_weight) = samples[i]
                r_weights[TOKEN_WEIGHTS] += token_weights or []
                r_weights[SAMPLE_WEIGHTS] += [] if sample_weight is None else [sample_weight] * len(ids)
                r_ids += ids
                r_labels += [self.label_pad] + (ids if own_labels is None else own_labels)[1:]
                r_pos += range(self.position_ids_start, self.position_ids_start + len(ids))
                r_seq += [len(segments)] * len(ids)
                segments.append(len(ids))
            real = len(r_ids)
            pad = row_len - real
            if pad:
                r_ids += [self.pad_token_id] * pad
                r_labels += [self.label_pad] * pad
                r_pos += range(self.position_ids_start, self.position_ids_start + pad)
                r_seq += [len(segments)] * pad
                segments.append(pad)
            for name, values in r_weights.items():
                weights[name].append(values + [0.0] * (row_len - len(values)))
            input_ids.append(r_ids)
            labels.append(r_labels)
            position_ids.append(r_pos)
            seq_idx.append(r_seq)
            mask.append([1] * real + [0] * pad)

        batch: dict[str, Any] = {
            "input_ids": torch.tensor(input_ids, dtype=torch.int64),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }
        if self.return_position_ids:
            batch["position_ids"] = torch.tensor(position_ids, dtype=torch.int64)
        if self.return_seq_idx:
            batch["seq_idx"] = torch.tensor(seq_idx, dtype=torch.int32)
        if self.rows_per_batch > 1 and any(0 in m for m in mask):
            batch["attention_mask"] = torch.tensor(mask, dtype=torch.int64)
        for name, present in zip((TOKEN_WEIGHTS, SAMPLE_WEIGHTS), check_all_or_none([s[2] for s in samples])):
            if present:
                batch[name] = torch.tensor(weights[name], dtype=torch.float32)
        if self.return_flash_attn_kwargs:
            cu = [0]
            for length in segments:
                cu.append(cu[-1] + length)
            batch["cu_seq_lens_q"] = torch.tensor(cu, dtype=torch.int32)
            batch["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
            batch["max_length_q"] = batch["max_length_k"] = max(segments)
        return batch
