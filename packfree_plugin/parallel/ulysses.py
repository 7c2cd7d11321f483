"""DeepSpeed Ulysses (ALST) with packfree as its core attention, in one call.

DeepSpeed's ``UlyssesSPAttentionHF`` exchanges query/key/value ``[B, H, T/P, D]`` of one head width for the whole
row of ``H/P`` heads (rank ``r`` gets heads ``[r H/P, (r+1) H/P)``) and hands them to packfree attention without a
mask. :func:`register_ulysses` puts a thin layer of packfree's around DeepSpeed's wrapper, for what it assumes:

- **per-head tensors passed to the attention function** (GPT-OSS's ``s_aux`` sinks, one logit per query head) are
  cut to this rank's heads (DeepSpeed passes them through whole);
- **``position_ids`` in every attention call** (DeepSpeed asserts on them): layers that get none (Granite 4's) are
  given the shard's slice of the whole row's positions, which the sequence-parallel hook already knows;
- **one head width**: multi-head latent attention (DeepSeek-V3, Kimi-Linear: q/k heads of another width than v)
  crosses the exchange with the narrower of them zero-padded to the wider (padded value columns give zero outputs,
  cropped after; padded q/k columns add zero to every logit, with the scale of the true width).
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .setup import prepare_sequence_parallel

__all__ = ["init_deepspeed", "register_ulysses"]

PER_HEAD_ATTENTION_KWARGS = ("s_aux", "sinks")
"""Attention-function arguments ``[H]`` holding one value per query head (GPT-OSS's sinks). The only per-head
tensors packfree attention accepts (it refuses unknown tensors); per-head scales and gates of other models act on
the layer's projections, outside the exchange, where every rank holds all heads of its tokens."""


def _head_widths(config: Any) -> tuple[int, int]:
    """``(query/key width, value width)`` of a text config's attention heads (they differ for latent attention)."""
    text = config.get_text_config()
    default = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if getattr(text, "qk_nope_head_dim", None) is not None and getattr(text, "qk_rope_head_dim", None) is not None:
        qk = text.qk_nope_head_dim + text.qk_rope_head_dim  # DeepSeek-V2/V3, Kimi-Linear: head_dim is the rope part
    else:
        qk = default
    return qk, getattr(text, "v_head_dim", None) or qk


def _rank_heads(tensor: torch.Tensor, heads: int, rank: int) -> torch.Tensor:
    """``[H]`` -> this rank's ``[heads]`` (DeepSpeed's split: rank ``r`` holds heads ``[r heads, (r+1) heads)``)."""
    return tensor[rank * heads:(rank + 1) * heads]


def _packfree_around(ulysses: Callable[..., tuple[torch.Tensor, Any]], widths: tuple[int, int],
                     world: int) -> Callable[..., tuple[torch.Tensor, Any]]:
    """packfree's layer around DeepSpeed's registered attention wrapper (see the module docstring)."""
    from ..forward.context import boundaries_here

    v_width, width = widths[1], max(widths)

    @functools.wraps(ulysses)
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        local = boundaries_here(kwargs)
        shard = local.sequence_shard if local is not None else None
        if shard is None:  # not a shard's forward (an unprepared model: packfree attention refuses it)
            return ulysses(module, query, key, value, attention_mask, *args, **kwargs)
        rank, local_heads = shard.rank, query.shape[1] // world
        for name in PER_HEAD_ATTENTION_KWARGS:
            if isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].shape[0] == query.shape[1]:
                kwargs[name] = _rank_heads(kwargs[name], local_heads, rank)
        if kwargs.get("position_ids") is None:
            length = query.shape[2]
            kwargs["position_ids"] = shard.whole.position_ids[:, rank * length:(rank + 1) * length]
        if query.shape[-1] == value.shape[-1] == width:
            return ulysses(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("scaling") is None:
            kwargs["scaling"] = query.shape[-1] ** -0.5
        query, key, value = (F.pad(x, (0, width - x.shape[-1])) for x in (query, key, value))
        output, weights = ulysses(module, query, key, value, attention_mask, *args, **kwargs)
        output = output.reshape(*output.shape[:2], -1, width)[..., :v_width]  # [B, T/P, H, Dv]
        return output, weights

    return attention


def register_ulysses(model: nn.Module, sequence_parallel_size: int, *, micro_batch_size: int = 1,
                     disable_in_eval: bool = False) -> Any:
    """Register DeepSpeed's ``UlyssesSPAttentionHF`` around packfree attention (variable row lengths) and prepare
    ``model`` for shards of its group; returns DeepSpeed's ``mpu`` (its parallel-state module). A model without
    attention layers (Mamba) skips the registration and splits its mixers over the same group. ``disable_in_eval``
    (DeepSpeed's, accelerate's ``sp_disable_in_eval``): in eval mode every rank runs whole rows, unsplit. Needs
    ``deepspeed.init_distributed()`` (or :func:`init_deepspeed`) first."""
    if sequence_parallel_size < 2:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size}: one rank holds the whole row, so there is "
                         "nothing to split; run the packfree model as it is (or pass 2 or more)")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    text = model.config.get_text_config()
    if getattr(text, "num_attention_heads", None):
        config = copy.deepcopy(model.config)
        described = config.get_text_config()
        if getattr(described, "num_key_value_heads", None) is None:  # BERT-style configs: every head has its own k/v
            described.num_key_value_heads = described.num_attention_heads
        widths = _head_widths(model.config)
        described.head_dim = max(widths)  # DeepSpeed exchanges one head width: latent attention's widest
        UlyssesSPAttentionHF.register_with_transformers(
            SimpleNamespace(config=config), core_attn_implementation="packfree",
            sequence_parallel_size=sequence_parallel_size, micro_batch_size=micro_batch_size,
            seq_length_is_variable=True, disable_in_eval=disable_in_eval)
        ALL_ATTENTION_FUNCTIONS["packfree"] = _packfree_around(ALL_ATTENTION_FUNCTIONS["packfree"], widths,
                                                               sequence_parallel_size)
    else:
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    prepare_sequence_parallel(model, mpu.get_sequence_parallel_group(), disable_in_eval=disable_in_eval)
    return mpu


def init_deepspeed(backend: str | None = None, *, timeout: timedelta | None = None) -> None:
    """``deepspeed.init_distributed`` without DeepSpeed's CPU start-up build: on the CPU (gloo) DeepSpeed 0.19.8
    JIT-compiles a shared-memory all-reduce (``deepspeed_shm_comm``) at every first start, with no setting to turn
    it off; Ulysses and packfree need gloo's collectives only, so the build is skipped (DeepSpeed then all-reduces
    through torch.distributed). On CUDA (NCCL) DeepSpeed builds nothing at start. ``backend`` defaults to NCCL on
    CUDA, else gloo."""
    import deepspeed

    deepspeed_torch = importlib.import_module("deepspeed.comm.torch")  # the package's own ``torch`` name shadows it

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {} if timeout is None else {"timeout": timeout}
    if backend != "gloo":
        deepspeed.init_distributed(dist_backend=backend, **kwargs)
        return
    build = deepspeed_torch.build_shm_op
    deepspeed_torch.build_shm_op = lambda: None
    try:
        deepspeed.init_distributed(dist_backend=backend, **kwargs)
    finally:
        deepspeed_torch.build_shm_op = build
