"""A shard of one packed row split over a sequence-parallel group, and the whole row's boundaries it carries.

Each rank holds an equal, contiguous shard ``[B, T/P]`` of the same rows. packfree's model hook builds the shard's
own :class:`Boundaries`, where the shard's first token starts a sample; :mod:`.setup` attaches a
:class:`SequenceShard` holding the whole row's boundaries to them (the ``Boundaries.sequence_shard`` slot), and
every boundary-aware consumer reads that slot, without importing this package:

- packfree attention, called by Ulysses on the whole row for ``H/P`` heads, runs on :meth:`SequenceShard.whole_row`;
- a routed mixer op runs head-parallel on it (:meth:`SequenceShard.call`, :mod:`.head_parallel`).

Gradient checkpointing recomputes with the same boundary object, so the attachment holds there too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..boundaries import Boundaries

__all__ = ["SequenceShard"]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's shard of a sequence-parallel forward: the whole row's boundaries and the group."""

    whole: Boundaries
    """Boundaries of the whole rows ``[B, T]``."""
    group: dist.ProcessGroup
    rank: int
    world_size: int
    mixer_route: Callable[..., torch.Tensor]
    """``(shard, name, function, tensors, options) -> output``: how a routed mixer op runs on the whole row."""

    def attach(self, local: Boundaries) -> None:
        local.sequence_shard = self

    def whole_row(self, length: int) -> Boundaries:
        """The whole row's boundaries for packfree attention over ``length`` tokens (Ulysses gathered the row).
        Raises ``ValueError`` when the attention sees fewer tokens than the row: it would attend over the shard."""
        if self.whole.seq_len == length:
            return self.whole
        raise ValueError(
            f"packfree attention got {length} tokens of a sequence-parallel shard of rows of {self.whole.seq_len}: "
            "attention over a shard sees only the shard. Register DeepSpeed Ulysses around packfree attention "
            "(packfree_plugin.parallel.register_ulysses) so each rank attends over the whole row for its heads"
        )

    def call(self, name: str, function: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor | None, ...],
             options: dict[str, Any]) -> torch.Tensor:
        """Run boundary function ``name`` (:mod:`packfree_plugin.ops.opaque`) of a shard's mixer on the whole row, with
        the route :mod:`.setup` gave this shard (:func:`.head_parallel.sequence_parallel_call`: head-parallel)."""
        return self.mixer_route(self, name, function, tensors, options)
