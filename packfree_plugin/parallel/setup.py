"""Setting a model up to run one packed row split over a sequence-parallel group.

:func:`prepare_sequence_parallel` refuses at set-up every layer that would read the shard as the row, and adds a
hook after packfree's model hook: it all-gathers the shard's ``position_ids`` over the group, builds the whole
row's boundaries once per forward, and attaches them to the shard's boundaries as a :class:`.shard.SequenceShard`.
The shard boundaries never become sample boundaries. The hook also checks the loss targets a shard is called with
(``shift_labels``, as transformers' DeepSpeed sequence-parallel loss passes them, else ``labels``) over the whole row,
gathered, so every rank refuses a target that crosses a sample alike (the entry's own check, of one shard, is off).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..mixers.registry import adapter_for
from ..boundaries import Boundaries
from ..classes import entry_of
from ..forward.context import boundaries_here
from ..forward.keywords import PACKING_KWARGS
from ..forward.reading import check_labels
from ..forward.hook import add_step, apply_model_hook, leave_targets_to_a_step
from ..forward.signature import class_forward_parameters, without_cache
from .head_parallel import sequence_parallel_call
from .shard import SequenceShard

__all__ = ["check_splittable", "layout_of", "prepare_sequence_parallel"]

_HOOK_ATTR = "_packfree_sequence_parallel"
_EVAL_ATTR = "_packfree_sequence_parallel_off_in_eval"
def _gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, T/P]`` on every rank -> ``[B, T]`` (rank order along T); equal shard lengths are required."""
    world = dist.get_world_size(group)
    length = torch.tensor([local.shape[-1]], dtype=torch.int64, device=local.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    if len({int(n) for n in lengths}) != 1:
        raise ValueError(
            f"sequence-parallel shards of unequal lengths {[int(n) for n in lengths]}: every rank must hold T/P tokens "
            "of the row. Pad the row to a multiple of the group size first (packfree_plugin.parallel.shard_batch does)"
        )
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _shard_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """After packfree's model hook: attach the whole row's boundaries to the shard's (outermost model only; nested
    models get the same boundary object through their kwargs), and turn the cache off as for any packed row."""
    local = boundaries_here()  # what packfree's hook just pushed (models without **kwargs get no packfree_boundaries)
    if local is None or local.sequence_shard is not None:
        return None
    if not module.training and getattr(module, _EVAL_ATTR, False):  # eval runs whole rows, as Ulysses does then
        return None
    group = getattr(module, _HOOK_ATTR)
    given = [name for name in PACKING_KWARGS if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} passed to a sequence-parallel shard: each rank's copy would have to describe the whole "
            "row. Pass each shard's position_ids (restarting at 0 in every sample) instead"
        )
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2:
        raise ValueError(
            f"{type(module).__name__} runs sequence-parallel without [B, T/P] position_ids: the whole row's samples "
            "are read from them. Shard the batch with packfree_plugin.parallel.shard_batch or DeepSpeed's "
            "UlyssesSPDataLoaderAdapter, which keep the row's position_ids"
        )
    rows = _gather_rows(position_ids, group)
    whole = Boundaries.from_position_ids(rows, device=position_ids.device)
    if whole.is_packed and not getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        _check_whole_row_targets(kwargs, whole, group)
    SequenceShard(whole, group, dist.get_rank(group), dist.get_world_size(group), sequence_parallel_call).attach(local)
    # A shard is never a whole sample (the row goes on on other ranks), so every consumer takes packfree's path, on
    # every rank alike: a rank whose shard holds one sample must not run a stock mixer while the others exchange.
    # packfree's hook read a shard holding one sample's middle as unpacked and left the model's cache on; a cache
    # filled from a shard is wrong, and the packed mixers refuse one (on that rank only, leaving the others waiting
    # in an exchange).
    local.is_packed = True
    return without_cache(class_forward_parameters(type(module)), args, kwargs)


def _check_whole_row_targets(kwargs: dict, whole: Boundaries, group: dist.ProcessGroup) -> None:
    """Refuse, on every rank alike, loss targets of the shards that cross a sample of the ``whole`` row: the shards'
    ``shift_labels`` (or ``labels``) ``[B, T/P]`` gathered into ``[B, T]`` and checked as one row's."""
    name = "shift_labels" if isinstance(kwargs.get("shift_labels"), torch.Tensor) else "labels"
    targets = kwargs.get(name)
    if isinstance(targets, torch.Tensor) and targets.ndim == 2:
        check_labels({name: _gather_rows(targets, group)}, whole)


def check_splittable(model: nn.Module) -> None:
    """Raise ``ValueError`` for the first layer of ``model`` whose packed behaviour would read a shard as the row."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: packfree does not run encoder-decoder models sequence-parallel; use data "
                         "parallelism (one packed row per rank)")
    if getattr(config, "_attn_implementation", None) != "packfree":
        raise ValueError(f"{name} uses attn_implementation={getattr(config, '_attn_implementation', None)!r}; load it "
                         "with attn_implementation='packfree' to run packed rows sequence-parallel")
    for path, module in model.named_modules():
        kind = type(module).__name__
        adapter = adapter_for(type(module))
        if adapter is not None and adapter.native is None:  # every op of a native family is head-parallel
            raise ValueError(
                f"{path} ({kind}): its {adapter.family} adapter runs the layer's recurrence on the shard's tokens "
                "alone (per sample, not through packfree's routed ops, the ones that run head-parallel over the whole "
                "row), and a sample that began on another rank is not on this shard; packfree splits only routed "
                "mixers (Gated DeltaNet, KDA, Mamba2, Mamba, short convs, lightning attention, RG-LRU). Use data "
                "parallelism (DDP/FSDP, one packed row per rank) for this model"
            )
        if entry_of(type(module)).numbering is not None:
            raise ValueError(
                f"{path} ({kind}) numbers positions per sample itself, which a shard cannot do for a sample that "
                "starts on another rank. Use data parallelism (DDP/FSDP, one packed row per rank) for this model"
            )


def prepare_sequence_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                              disable_in_eval: bool = False) -> nn.Module:
    """Make a packfree model run one packed row split over ``group`` (default: the world): whole-row boundaries
    for its attention and head-parallel routed mixers; with ``disable_in_eval``, whole rows unsplit in eval mode.
    Raises ``ValueError`` for a model packfree cannot split exactly. Idempotent; returns ``model``."""
    from transformers import PreTrainedModel

    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call dist.init_process_group (or "
                         "deepspeed.init_distributed) before prepare_sequence_parallel")
    group = group if group is not None else dist.group.WORLD
    check_splittable(model)
    apply_model_hook(model)  # packfree's own entry: the shard step runs in it, after it has added the boundaries
    outermost = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    add_step(outermost, _shard_hook)
    leave_targets_to_a_step(outermost)
    setattr(outermost, _HOOK_ATTR, group)
    setattr(outermost, _EVAL_ATTR, disable_in_eval)
    return model


def layout_of(model: nn.Module) -> dict[str, Any] | None:
    """The sequence-parallel layout a prepared model runs with (``{"world_size", "rank"}``), None if unprepared."""
    group = getattr(model, _HOOK_ATTR, None)
    if group is None:
        return None
    return {"world_size": dist.get_world_size(group), "rank": dist.get_rank(group)}
