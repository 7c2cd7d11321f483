"""The head-parallel route for sequence mixers on a sequence-parallel shard.

Heads (and conv channels) of every mixer packfree routes are independent of each other; what crosses tokens is
each head's own recurrence or convolution. So a routed op on a shard of the row runs as: all-to-all
sequence -> heads (this rank gets the whole row for ``H/P`` heads), packfree's own boundary-aware op on the whole
row's boundaries, all-to-all heads -> sequence. Per-head parameters are sliced to this rank's heads (their gradient
reaches the full parameter, zero outside the slice; summed over the group it is one process's gradient).

Each op's :class:`~packfree_plugin.ops.opaque.Layout`, declared once with the op
(:func:`~packfree_plugin.ops.opaque.boundary_op`), says what each of its tensor arguments is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..ops.opaque import CHANNELS, GROUPS, PARAMS, TOKENS, declared
from .exchange import gather_sequence, heads_to_sequence, sequence_to_heads

if TYPE_CHECKING:
    from .shard import SequenceShard

__all__ = ["run_head_parallel", "sequence_parallel_call"]

_DIMS = {TOKENS: (1, 2), CHANNELS: (2, 1)}  # role -> (sequence dim, head dim)


def _group_slice(groups: int, heads: int, world: int, rank: int, layer: str) -> slice:
    """The groups this rank's heads ``[r H/P, (r+1) H/P)`` read (head h reads group ``h // (H / G)``)."""
    if groups % world and world % groups:
        raise ValueError(
            f"{layer}: {groups} head groups cannot be split over {world} sequence-parallel ranks (neither divides the "
            f"other); use a sequence-parallel size that divides or is a multiple of {groups}, or data parallelism"
        )
    local = heads // world
    first = rank * local * groups // heads
    last = ((rank + 1) * local - 1) * groups // heads
    return slice(first, last + 1)


def run_head_parallel(shard: SequenceShard, name: str, function: Callable[..., torch.Tensor],
                      tensors: tuple[torch.Tensor | None, ...], options: dict[str, Any], layer: str) -> torch.Tensor:
    """Run the boundary op ``name`` (``function(boundaries, *tensors, **options)``) of a shard's mixer on the whole
    row for this rank's heads; returns the shard's output for all heads. Raises ``ValueError`` (in the forward) when
    the op has no head-parallel layout or its heads do not split over the group."""
    layout = declared(name).layout
    if layout is None:
        raise ValueError(
            f"{layer}: packfree has no head-parallel route for {name} on a sequence-parallel shard; train this model "
            "with data parallelism (DDP/FSDP), one packed row per rank"
        )
    roles, output = layout.inputs, layout.output
    group, world, rank = shard.group, shard.world_size, shard.rank
    seq_dim, head_dim = _DIMS[roles[0]]
    heads = tensors[0].shape[head_dim]
    if heads % world:
        raise ValueError(
            f"{layer}: {heads} {'channels' if roles[0] == CHANNELS or name.endswith('conv1d') else 'heads'} cannot "
            f"be split over {world} sequence-parallel ranks; use a sequence-parallel size that divides {heads}, or "
            "data parallelism"
        )
    local = heads // world
    mine = slice(rank * local, (rank + 1) * local)
    ready: list[torch.Tensor | None] = []
    for role, tensor in zip(roles, tensors, strict=True):
        if tensor is None:
            ready.append(None)
        elif role in _DIMS:
            ready.append(sequence_to_heads(tensor, *_DIMS[role], group))
        elif role == PARAMS:
            ready.append(tensor[mine])
        elif role == GROUPS:
            whole = gather_sequence(tensor, 1, group)
            ready.append(whole[:, :, _group_slice(tensor.shape[2], heads, world, rank, layer)])
        else:  # SHARED
            whole = gather_sequence(tensor, -1, group)
            if whole.ndim == 4:
                whole = whole[:, _group_slice(tensor.shape[1], heads, world, rank, layer)]
            ready.append(whole)
    out = function(shard.whole, *ready, **options)
    return heads_to_sequence(out, *_DIMS[output], group)


def sequence_parallel_call(shard: SequenceShard, name: str, function: Callable[..., torch.Tensor],
                           tensors: tuple[torch.Tensor | None, ...], options: dict[str, Any]) -> torch.Tensor:
    """:func:`packfree_plugin.ops.opaque.call` for boundaries of a sequence-parallel shard (eager only)."""
    from ..mixers.seam import running_layer

    layer = running_layer() or name
    if torch.compiler.is_compiling():
        raise ValueError(f"{layer}: packfree's head-parallel mixers run eagerly; compile the model without "
                         "sequence parallelism, or run this one uncompiled")
    return run_head_parallel(shard, name, function, tensors, options, layer)
