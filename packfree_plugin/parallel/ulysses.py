"""DeepSpeed Ulysses (ALST) with packfree as its core attention, in one call."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from torch import nn

from .prepare import prepare_sequence_parallel

__all__ = ["refuse_latent_attention", "register_ulysses"]


def refuse_latent_attention(model: nn.Module) -> None:
    """Raise ``ValueError`` for multi-head latent attention (query/key heads of another size than value heads),
    which DeepSpeed's Ulysses cannot exchange."""
    text = model.config.get_text_config()
    if getattr(text, "kv_lora_rank", None) or getattr(text, "qk_rope_head_dim", None):
        raise ValueError(
            f"{type(model).__name__}: its multi-head latent attention has query/key heads of another size than its "
            "value heads, which DeepSpeed's Ulysses cannot exchange; train it with data parallelism (one packed row "
            "per rank)"
        )


def register_ulysses(model: nn.Module, sequence_parallel_size: int, *, micro_batch_size: int = 1) -> Any:
    """Register DeepSpeed's ``UlyssesSPAttentionHF`` around packfree attention (variable row lengths) and prepare
    ``model`` for shards of its group; returns DeepSpeed's ``mpu`` (its parallel-state module). A model without
    attention layers (Mamba) skips the registration and splits its mixers over the same group. Needs
    ``deepspeed.init_distributed()`` first."""
    if sequence_parallel_size < 2:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size}: one rank holds the whole row, so there is "
                         "nothing to split; run the packfree model as it is (or pass 2 or more)")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    refuse_latent_attention(model)
    text = model.config.get_text_config()
    if getattr(text, "num_attention_heads", None):
        described = model
        if getattr(text, "num_key_value_heads", None) is None:  # BERT-style configs: every head has its own k/v
            config = copy.deepcopy(model.config)
            config.get_text_config().num_key_value_heads = text.num_attention_heads
            described = SimpleNamespace(config=config)
        UlyssesSPAttentionHF.register_with_transformers(
            described, core_attn_implementation="packfree", sequence_parallel_size=sequence_parallel_size,
            micro_batch_size=micro_batch_size, seq_length_is_variable=True)
    else:
        mpu.initialize_sequence_parallel(sequence_parallel_size=sequence_parallel_size)
    prepare_sequence_parallel(model, mpu.get_sequence_parallel_group())
    return mpu
