"""The loss the user means on packed rows: token mean, per-sample mean, or one loss per sample, with per-token and
per-sample weights, across gradient accumulation and ranks (docs/loss.md).

A causal LM's next-token cross-entropy, reduced by the batch's :class:`~packfree_plugin.Boundaries`:

- ``"token"`` (transformers' default): the weighted token losses summed over the number of targets
  (``num_items_in_batch`` where given: the whole accumulated batch's);
- ``"sample"``: each sample's mean (its weighted token losses summed, over its own number of targets), these means
  summed over the number of samples that have a target (``num_samples_in_batch`` where given), so long samples do not
  outweigh short ones;
- ``"none"``: ``[S]``, one loss per sample (the ``"sample"`` means, NaN for a sample without targets), in the
  batch's sample order (row after row).

Weights multiply each target's loss; they change no count (a weight of 0 is not a -100 label). Both are ``[B, T]``,
laid out like the targets the loss reads (``labels``, or ``shift_labels`` where given): ``token_weights`` one per
token, ``sample_weights`` a sample's weight on each of its tokens (how the collators of :mod:`.packing` lay them out).

A target belongs to the sample of the token it names (a left-padded row's first token, predicted from padding,
belongs to its row's sample, as stock counts it); a target that a packed row's previous sample predicts (its label
at a sample's first token is not -100) belongs to no sample alone and is dropped. One segment reduction
(``index_add`` on each target's segment) per reduction: no host read, no loop over samples, O(tokens) memory. On a
sequence-parallel shard (:func:`packfree_plugin.parallel.shard_batch`) the counts are summed over the shard's group
before any mean, so each rank's loss is its share and the shares sum to one process's loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .boundaries import Boundaries, seq_idx_of
from .forward.keywords import LOSS_WEIGHT_KWARGS
from .forward.loss_inputs import loss_inputs_of
from .forward.reading import boundaries_for_call

__all__ = ["IGNORE_INDEX", "REDUCTIONS", "PackedLoss", "Reduction", "count_samples", "packed_loss"]

Reduction = Literal["token", "sample", "none"]
REDUCTIONS: tuple[str, ...] = ("token", "sample", "none")
IGNORE_INDEX = -100


def packed_loss(outputs: Any, labels: torch.Tensor | None = None, *, reduction: Reduction = "token",
                batch: Mapping[str, Any] | None = None, boundaries: Boundaries | None = None,
                token_weights: torch.Tensor | None = None, sample_weights: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                num_samples_in_batch: int | torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The causal-LM loss of ``outputs`` (a model output with ``logits [B, T, V]``, or the logits) on ``labels
    [B, T]`` (shifted inside, as transformers does) or ``shift_labels [B, T]`` (already shifted), reduced by
    ``reduction``; a scalar, or ``[S]`` for ``"none"``.

    The boundaries are ``boundaries`` where given, else read from ``batch`` as packfree's forward reads them, else
    the ones the forward of ``outputs`` held (a model packfree prepared). Weights and ``shift_labels`` not given are
    taken from ``batch``, else from that forward. Without any, ``"token"`` needs none (packing leaves it unchanged)
    and the others raise. ``num_items_in_batch`` (``"token"``) and ``num_samples_in_batch`` (``"sample"``) are the
    denominators of the whole accumulated batch, on every rank (:func:`count_samples`); without them, this batch's.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    logits = logits_of(outputs)
    kept = loss_inputs_of(outputs, logits) if not isinstance(outputs, torch.Tensor) else None
    sources = [batch] if batch is not None else []
    if kept is not None:
        sources.append({**kept.weights, "shift_labels": kept.shift_labels})
    token_weights = token_weights if token_weights is not None else _first(sources, "token_weights")
    sample_weights = sample_weights if sample_weights is not None else _first(sources, "sample_weights")
    shift_labels = shift_labels if shift_labels is not None else _first(sources, "shift_labels")
    if labels is None and batch is not None:
        labels = batch.get("labels")
    if boundaries is None and batch is not None:
        boundaries = _read(batch)
    elif boundaries is None and kept is not None:
        boundaries = kept.boundaries
    elif boundaries is None and reduction != "token":
        raise ValueError(
            f'reduction="{reduction}" needs the batch\'s sample boundaries: pass batch= (the batch the model was '
            'called with), boundaries=, or the outputs of a model packfree prepared (attn_implementation="packfree")')
    targets, shifted = _targets(labels, shift_labels, logits, ignore_index)
    layout = TargetLayout.of(boundaries, targets, ignore_index=ignore_index)
    losses = _token_losses(logits, targets, ignore_index=ignore_index)
    weight = _weight({"token_weights": token_weights, "sample_weights": sample_weights}, targets, shifted=shifted,
                     dtype=losses.dtype)
    weighted = losses * layout.kept if weight is None else losses * weight * layout.kept
    if reduction == "token":
        count = num_items_in_batch if num_items_in_batch is not None else layout.target_count(losses.dtype)
        return weighted.sum() / _on(count, weighted)
    means, has_targets = layout.segment_means(weighted)
    if reduction == "none":
        return torch.where(has_targets, means, torch.full_like(means, float("nan")))[layout.samples]
    count = num_samples_in_batch if num_samples_in_batch is not None else has_targets.sum()
    return (means * has_targets).sum() / _on(count, means)


class PackedLoss:
    """The loss as the ``Trainer`` takes it: ``Trainer(..., compute_loss_func=PackedLoss("sample"))``, called as
    ``loss(outputs, labels, num_items_in_batch)``, then :meth:`attach` it to the trainer.

    It reads the batch's boundaries, loss weights and ``shift_labels`` from what packfree's forward left on the outputs
    (the batch's ``token_weights`` / ``sample_weights`` reach the model's call, which takes them out), and refuses
    outputs of any other forward. ``"sample"`` divides by the samples of the whole accumulated batch, on every rank
    where the Trainer averages tokens across devices, as ``num_items_in_batch`` counts tokens: :meth:`attach`
    counts them where the Trainer counts its tokens."""

    def __init__(self, reduction: Reduction = "token", *, ignore_index: int = IGNORE_INDEX) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self.ignore_index = ignore_index
        self._counted: tuple[Any, torch.Tensor] | None = None
        """``(num_items_in_batch, samples)`` of the batch the trainer counted last."""

    def __call__(self, outputs: Any, labels: torch.Tensor | None,
                 num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``outputs`` on ``labels [B, T]``: a scalar (``[S]`` for ``"none"``)."""
        if loss_inputs_of(outputs, logits_of(outputs)) is None:
            raise ValueError(
                "PackedLoss reads the batch's boundaries and loss weights from the forward of a model packfree "
                'prepared (attn_implementation="packfree", or packfree_plugin.apply); these outputs come from another '
                "forward (a model packfree did not prepare, a compiled one without weights, or DDP rebuilt them). "
                "Call packfree_plugin.packed_loss(outputs, labels, batch=...) with the batch instead")
        num_samples = None
        if self.reduction == "sample" and num_items_in_batch is not None:
            if self._counted is None or self._counted[0] is not num_items_in_batch:
                raise ValueError(
                    'PackedLoss("sample") got num_items_in_batch (the tokens of the whole accumulated batch, on every '
                    "rank) but no count of that batch's samples: call loss.attach(trainer) once the Trainer is built")
            num_samples = self._counted[1]
        return packed_loss(outputs, labels, reduction=self.reduction, num_items_in_batch=num_items_in_batch,
                           num_samples_in_batch=num_samples, ignore_index=self.ignore_index)

    def attach(self, trainer: Any) -> PackedLoss:
        """Count every accumulated batch's samples where ``trainer`` counts its tokens (``num_items_in_batch``, for
        training and evaluation alike, gathered across ranks as it gathers them), checking there that no target
        crosses into another sample (the labels never reach the model's own check); returns self. Refuses a trainer
        whose ``compute_loss_func`` is not this loss, and the DeepSpeed sequence-parallel route, which computes the
        model's own loss instead."""
        if trainer.compute_loss_func is not self:
            raise ValueError("attach the loss to the Trainer it was given to: Trainer(..., compute_loss_func=loss)")
        config = getattr(trainer.accelerator, "parallelism_config", None)
        if config is not None and getattr(config, "sp_enabled", False) and config.sp_backend == "deepspeed":
            raise ValueError(
                "the Trainer's DeepSpeed sequence-parallel route computes the model's own token-mean loss and never "
                "calls compute_loss_func; for other reductions split the rows with "
                "packfree_plugin.parallel.shard_batch and call packfree_plugin.packed_loss on each shard "
                "(docs/loss.md)")
        count_tokens = trainer._get_num_items_in_batch

        def count(batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
            num_items = count_tokens(batch_samples, device)
            if num_items is not None and batch_samples:
                samples = sum(count_samples(batch, ignore_index=self.ignore_index) for batch in batch_samples)
                samples = samples.to(device)
                if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
                    samples = trainer.accelerator.gather(samples).sum()
                self._counted = (num_items, samples)
            return num_items

        trainer._get_num_items_in_batch = count
        return self


def count_samples(batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The number of samples of ``batch`` (a batch as a model is called with it: ``input_ids``, ``labels`` or
    ``shift_labels``, its boundary fields) that have a target: the ``"sample"`` denominator, as
    ``labels.ne(-100).sum()`` is the ``"token"`` one. A 0-d int64 tensor on the labels' device, read as packfree's
    forward reads the batch (its boundary fields read once to the host; a target that crosses a sample raises)."""
    shift_labels = batch.get("shift_labels")
    targets = shift_labels if shift_labels is not None else batch.get("labels")
    if not isinstance(targets, torch.Tensor) or targets.ndim != 2:
        raise ValueError("count_samples needs a batch with labels [B, T] or shift_labels [B, T]")
    layout = TargetLayout.of(_read(batch), targets if shift_labels is not None else _shifted(targets, IGNORE_INDEX),
                             ignore_index=ignore_index)
    return (layout.segment_counts().gt(0) & ~layout.padding).sum()


def logits_of(outputs: Any) -> torch.Tensor:
    """``outputs``' ``logits [B, T, V]`` (a model output, a mapping with them, or the logits themselves)."""
    logits = outputs if isinstance(outputs, torch.Tensor) else getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        shape = list(logits.shape) if isinstance(logits, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"the loss needs logits [B, T, V], got {shape}; call the model without logits_to_keep and "
                         "without a fused loss head (TRL's fused_lm_head=True returns log-probs, not logits)")
    return logits


class TargetLayout:
    """Where a batch's targets sit: which segment (sample or padding span) each belongs to and which count.

    Attributes:
        kept: ``[B, T]`` bool, the targets that count (not ``ignore_index``, not crossing into another sample).
        segments: ``[B, T]`` int64, the segment of each target (:attr:`Boundaries.seq_idx` numbering).
        padding: ``[N]`` bool, the padding spans among the ``N`` segments (on the targets' device).
        samples: ``[S]`` int64, the segments that are samples, in order (on the targets' device).
        group: the sequence-parallel group whose shards hold the rows' other targets, or None.
    """

    def __init__(self, kept: torch.Tensor, segments: torch.Tensor, padding: torch.Tensor, samples: torch.Tensor,
                 group: dist.ProcessGroup | None) -> None:
        self.kept, self.segments, self.padding, self.samples, self.group = kept, segments, padding, samples, group

    @classmethod
    def of(cls, boundaries: Boundaries | None, targets: torch.Tensor, *, ignore_index: int) -> TargetLayout:
        """The layout of ``targets [B, T]`` (what each token predicts: ``shift_labels``) on rows ``boundaries``
        describe (None: one sample per row). Built from the boundaries' host offset tensors with device ops: no
        device read, and traceable by ``torch.compile`` (the offsets are graph data)."""
        batch_size, length = targets.shape
        device = targets.device
        if boundaries is None:
            segments = torch.arange(batch_size, device=device).unsqueeze(1).expand(batch_size, length)
            every = torch.arange(batch_size, device=device)
            return cls(targets != ignore_index, segments, torch.zeros(batch_size, dtype=torch.bool, device=device),
                       every, None)
        if not boundaries.describes(batch_size, length):
            raise ValueError(f"the labels are [{batch_size}, {length}] but the boundaries describe rows "
                             f"[{boundaries.batch_size}, {boundaries.seq_len}]; pass the batch's own")
        shard = boundaries.sequence_shard
        whole = boundaries if shard is None else shard.whole
        offsets = whole.host_offsets.to(device)
        padding = whole.host_padding.to(device)
        segment_of = seq_idx_of(offsets, batch_size * whole.seq_len).view(batch_size, whole.seq_len)
        segment_of = torch.cat([segment_of, segment_of[:, -1:]], dim=1)  # the token after a row's last: itself
        start = 0 if shard is None else shard.rank * boundaries.seq_len
        before = segment_of[:, start:start + length]  # the predicting token's segment
        named = segment_of[:, start + 1:start + length + 1]  # the predicted token's
        before_pads, named_pads = padding[before], padding[named]
        crossing = (before != named) & ~before_pads & ~named_pads
        segments = torch.where(named_pads, before, named)
        samples = torch.nonzero(~whole.host_padding).squeeze(1).to(device)  # a host tensor: no device read
        return cls((targets != ignore_index) & ~crossing, segments, padding, samples,
                   None if shard is None else shard.group)

    def target_count(self, dtype: torch.dtype) -> torch.Tensor:
        """The number of targets that count, on every shard of the group."""
        count = self.kept.sum().to(dtype)
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        return count

    def segment_counts(self) -> torch.Tensor:
        """``[N]`` targets per segment (summed over the group's shards)."""
        counts = self._per_segment(self.kept.to(torch.int64))
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        return counts

    def segment_means(self, weighted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N], [N])``: each segment's sum of ``weighted [B, T]`` over its number of targets (0 without any; on a
        shard this shard's share), and whether it is a sample with targets."""
        counts = self.segment_counts()
        return self._per_segment(weighted) / counts.clamp(min=1).to(weighted.dtype), (counts > 0) & ~self.padding

    def _per_segment(self, values: torch.Tensor) -> torch.Tensor:
        """``values [B, T]`` summed by segment: ``[N]`` (one segment reduction)."""
        return values.new_zeros(self.padding.shape[0]).index_add(0, self.segments.reshape(-1), values.reshape(-1))


def _targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, logits: torch.Tensor,
             ignore_index: int) -> tuple[torch.Tensor, bool]:
    """``(targets [B, T], given shifted)``: what each token predicts, ``shift_labels`` where given (as transformers'
    loss reads them), else ``labels`` shifted left by one (the labels move, not the logits: no copy of them)."""
    rows = tuple(logits.shape[:2])
    for name, value in (("shift_labels", shift_labels), ("labels", labels)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != rows:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} has shape {shape} but the logits' rows are {list(rows)}; pass {name} [B, T]")
        return (value, True) if name == "shift_labels" else (_shifted(value, ignore_index), False)
    raise ValueError("the loss needs labels [B, T] (or shift_labels [B, T]); got neither")


def _token_losses(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """``[B, T]`` cross-entropy of every target (0 where ``ignore_index``), in float32 or the logits' wider dtype."""
    flat = logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(flat, targets.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction="none")
    return losses.view(targets.shape)


def _weight(weights: dict[str, torch.Tensor | None], targets: torch.Tensor, *, shifted: bool,
            dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, T]``: the product of the weights given (each ``[B, T]``, laid out like the labels read, ``shifted``
    with them), or None."""
    product = None
    for name in LOSS_WEIGHT_KWARGS:
        value = weights.get(name)
        if value is None:
            continue
        rows = tuple(targets.shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != rows or not value.is_floating_point():
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{name} must be a float tensor shaped like the {'shift_labels' if shifted else 'labels'} "
                f"{list(rows)}, got {shape}" + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else "")
                + "; lay each sample's weights out on its tokens as its labels are (packfree's collators and "
                "packfree_plugin.packing.WithLossWeights do)")
        value = (value if shifted else _shifted(value, 0)).to(device=targets.device, dtype=dtype)
        product = value if product is None else product * value
    return product


def _shifted(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``values [B, T]`` moved left by one token, ``fill`` at each row's end: labels as ``shift_labels``."""
    return torch.cat([values[:, 1:], values.new_full((values.shape[0], 1), fill)], dim=1)


def _on(count: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor | int:
    """A denominator on ``like``'s device and dtype (an int stays an int)."""
    return count.to(device=like.device, dtype=like.dtype) if isinstance(count, torch.Tensor) else count


def _first(sources: list[Mapping[str, Any]], name: str) -> Any:
    """``name``'s value in the first of ``sources`` that holds one, or None."""
    return next((source[name] for source in sources if source.get(name) is not None), None)


def _read(batch: Mapping[str, Any]) -> Boundaries | None:
    """``batch``'s boundaries, read as packfree's forward reads them (None: one sample per row, as stock reads a
    batch whose padding mask has holes)."""
    if not isinstance(batch.get("input_ids", batch.get("inputs_embeds")), torch.Tensor):
        raise ValueError("the batch has no input_ids (nor inputs_embeds): pass the batch the model was called with")
    return boundaries_for_call(dict(batch))
