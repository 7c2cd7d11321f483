"""Cutting a packed batch into sequence-parallel shards, and the loss whose sum over ranks is one process's."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..forward.reading import check_labels
from ..boundaries import Boundaries
from ..forward.keywords import BOUNDARY_KWARGS, LOSS_WEIGHT_KWARGS

__all__ = ["shard_batch", "shard_loss"]

IGNORE = -100


def shard_batch(batch: dict[str, torch.Tensor], rank: int, world_size: int, *, causal: bool = True,
                pad_token_id: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's shard of a packed batch (``input_ids`` / ``position_ids`` / ``labels`` or ``shift_labels``
    ``[B, T]``, as ``DataCollatorWithFlattening`` or :class:`packfree_plugin.packing.PackedCollator` build it; ``cu_seq_lens``
    / ``seq_idx`` are turned into ``position_ids``) -> ``(inputs [B, T'/P], targets [B, T'/P])``.

    ``T`` is padded to ``T'``, a multiple of ``world_size``, with one padding sample (positions 0, 1, ...; targets
    -100), which no real sample sees. ``targets`` are what each token predicts: for a causal LM the row's
    ``shift_labels`` where given (transformers' name for targets already shifted), else its labels shifted left by
    one *before* sharding (so a shard's last token predicts the next shard's first, and a sample's last token predicts
    nothing: its next label is the -100 at the next sample's start); otherwise the labels. A causal target that
    crosses into the next sample is refused, as the model refuses it on a whole row. Pass ``inputs`` to the model and
    ``targets`` to :func:`shard_loss`, or to :func:`packfree_plugin.packed_loss` as ``shift_labels`` (any reduction).
    The batch's loss weights (``token_weights`` / ``sample_weights [B, T]``, laid out like its labels) are shifted and
    sharded as the labels are and passed in ``inputs``: the model's entry takes them out and leaves them for the
    loss."""
    tokens = batch["input_ids"]
    batch_size, seq_len = tokens.shape
    whole = Boundaries.from_model_inputs(batch_size=batch_size, seq_len=seq_len, device=tokens.device,
                                         position_ids=batch.get("position_ids"),
                                         **{name: batch.get(name) for name in BOUNDARY_KWARGS})
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = whole.position_ids.to(torch.long)
    shift_labels = batch.get("shift_labels") if causal else None
    labels = shift_labels if shift_labels is not None else batch.get("labels")
    if labels is None:
        raise ValueError("shard_batch needs labels [B, T] (-100 at every packed sample's first token) or, for a causal "
                         "LM, shift_labels [B, T] (-100 at every packed sample's last token)")
    if causal:
        check_labels({"shift_labels" if shift_labels is not None else "labels": labels}, whole)
    pad = -seq_len % world_size
    weights = {name: batch[name] for name in LOSS_WEIGHT_KWARGS if batch.get(name) is not None}
    if causal and shift_labels is None:
        labels = torch.cat([labels[:, 1:], labels.new_full((batch_size, 1), IGNORE)], dim=1)
        weights = {name: torch.cat([value[:, 1:], value.new_zeros(batch_size, 1)], dim=1)
                   for name, value in weights.items()}
    if pad:
        tokens = torch.cat([tokens, tokens.new_full((batch_size, pad), pad_token_id)], dim=1)
        position_ids = torch.cat([position_ids, _filler_positions(position_ids, pad)], dim=1)
        labels = torch.cat([labels, labels.new_full((batch_size, pad), IGNORE)], dim=1)
        weights = {name: torch.cat([value, value.new_zeros(batch_size, pad)], dim=1) for name, value in weights.items()}
    width = (seq_len + pad) // world_size
    mine = slice(rank * width, (rank + 1) * width)
    inputs = {"input_ids": tokens[:, mine], "position_ids": position_ids[:, mine]}
    inputs.update({name: value[:, mine] for name, value in weights.items()})
    return inputs, labels[:, mine]


def _filler_positions(position_ids: torch.Tensor, pad: int) -> torch.Tensor:
    """``[B, pad]`` positions of the padding sample that ends every row: 0, 1, ... (a sample of its own; positions
    continuing the row's last sample would make the filler part of it, and a bidirectional model attends to it)."""
    batch_size = position_ids.shape[0]
    return torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device).expand(batch_size, pad)


def shard_loss(logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This shard's share of the row's mean token loss: ``logits [B, T/P, V]``, ``targets [B, T/P]`` (-100: none)
    -> the sum of its tokens' cross-entropies over the number of targets on every rank of ``group``. Summed over the
    group it is one process's mean loss, and so are the gradients (each rank backpropagates its own share)."""
    count = (targets != IGNORE).sum().to(torch.float64)
    dist.all_reduce(count, group=group)
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    losses = F.cross_entropy(flat, targets.reshape(-1).to(flat.device), ignore_index=IGNORE, reduction="sum")
    return losses / count.to(losses.dtype)
