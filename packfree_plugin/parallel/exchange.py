"""Autograd-correct collectives over a sequence-parallel group (torch.distributed; gloo on the CPU, NCCL on CUDA).

Every rank holds an equal, contiguous shard of the same rows. :func:`sequence_to_heads` turns a local
``[..., T/P (seq_dim), ..., H (head_dim), ...]`` tensor into the whole row for ``H/P`` heads; :func:`heads_to_sequence`
is its inverse; :func:`gather_sequence` hands every rank the whole row of a tensor that is not split by heads.
Backward of each runs the inverse exchange, so gradients reach the rank that owns each token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["gather_sequence", "heads_to_sequence", "sequence_to_heads"]


def _exchange(x: torch.Tensor, split_dim: int, cat_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``x`` into ``P`` equal chunks along ``split_dim``, send chunk ``j`` to rank ``j``, and concatenate what
    arrives (in rank order) along ``cat_dim``."""
    world = dist.get_world_size(group)
    if x.shape[split_dim] % world:
        raise ValueError(f"cannot split dimension {split_dim} of size {x.shape[split_dim]} over {world} ranks")
    sends = [chunk.contiguous() for chunk in x.chunk(world, dim=split_dim)]
    receives = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(receives, sends, group=group)
    return torch.cat(receives, dim=cat_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, split_dim: int, cat_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group = (split_dim, cat_dim), group
        return _exchange(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_dim, cat_dim = ctx.dims
        return _exchange(grad, cat_dim, split_dim, ctx.group), None, None, None


def sequence_to_heads(x: torch.Tensor, seq_dim: int, head_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Local shard, all heads -> whole row, this rank's ``H/P`` heads (rank ``r`` gets heads ``[r H/P, (r+1) H/P)``)."""
    return _Exchange.apply(x, head_dim % x.ndim, seq_dim % x.ndim, group)


def heads_to_sequence(x: torch.Tensor, seq_dim: int, head_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Whole row, this rank's heads -> local shard, all heads (the inverse of :func:`sequence_to_heads`)."""
    return _Exchange.apply(x, seq_dim % x.ndim, head_dim % x.ndim, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seq_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.seq_dim, ctx.group = seq_dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank used the whole row: this shard's gradient is the sum of every rank's gradient for it
        world = dist.get_world_size(ctx.group)
        sends = [chunk.contiguous() for chunk in grad.chunk(world, dim=ctx.seq_dim)]
        receives = [torch.empty_like(sends[0]) for _ in range(world)]
        dist.all_to_all(receives, sends, group=ctx.group)
        return torch.stack(receives).sum(0), None, None


def gather_sequence(x: torch.Tensor, seq_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Local shard -> the whole row on every rank, along ``seq_dim``."""
    return _Gather.apply(x, seq_dim % x.ndim, group)
