"""torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``, which accelerate's
``ParallelismConfig(cp_size=...)`` and FSDP2 CP use) and packed rows: refused.

Inside ``context_parallel`` torch shards the rows in place and replaces ``scaled_dot_product_attention`` with ring
attention over the shards, with ``is_causal`` as the only mask: the samples of a packed row would attend to each
other, and packfree's per-sample attention calls would each be ringed over the group as if one sample were the
whole row. Mixers would see only their shard. Nothing there can carry the row's boundaries, so packfree refuses a
packed row inside it at the first forward (before any backward) and names the exact route: DeepSpeed Ulysses with
:func:`packfree_plugin.parallel.prepare_sequence_parallel`.

:func:`packfree_plugin.apply` adds the refusal to the model entry's read checks
(:func:`packfree_plugin.forward.hook.add_read_check`), so the entry runs it on every batch it reads without knowing of
parallelism: the entry stays below this package, which builds on it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch.nn.functional as F

if TYPE_CHECKING:
    from ..boundaries import Boundaries

__all__ = ["refuse_packed_rows_under_context_parallel", "torch_context_parallel_active"]

_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


def torch_context_parallel_active() -> bool:
    """Whether a ``torch.distributed.tensor.experimental.context_parallel`` region is active: its SDPA patch, or
    its DTensor SDPA handlers (the module-wrapper dispatch mode) are installed."""
    module = sys.modules.get(_CP_MODULE)
    if module is None:
        return False
    if F.scaled_dot_product_attention in getattr(module, "_replaced_functions", {}):
        return True
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    return any(op in handlers for op in getattr(module, "custom_ops", {}))


def refuse_packed_rows_under_context_parallel(boundaries: Boundaries) -> None:
    """Raise ``ValueError`` for a packed row inside torch's context parallelism."""
    if boundaries.is_packed and torch_context_parallel_active():
        raise ValueError(
            "a packed row (several samples per row) inside torch's context_parallel (accelerate "
            "ParallelismConfig(cp_size=...)): its ring attention masks causally over the whole row, so samples would "
            "attend to each other. Split packed rows with DeepSpeed Ulysses instead: "
            "UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation='packfree', ...) then "
            "packfree_plugin.parallel.prepare_sequence_parallel(model, group) (docs/distributed.md)"
        )
