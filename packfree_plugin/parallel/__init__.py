"""One packed row split over several ranks, exact: DeepSpeed Ulysses for attention, head-parallel routed mixers,
and a refusal for torch's context parallelism. See docs/distributed.md."""

from .batch import shard_batch, shard_loss
from .setup import layout_of, prepare_sequence_parallel
from .shard import SequenceShard
from .torch_cp import torch_context_parallel_active
from .ulysses import init_deepspeed, register_ulysses

__all__ = ["SequenceShard", "init_deepspeed", "layout_of", "prepare_sequence_parallel", "register_ulysses", "shard_batch", "shard_loss",
           "torch_context_parallel_active"]
