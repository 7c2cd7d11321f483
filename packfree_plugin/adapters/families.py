"""One declarative entry per family of sequence mixers (see :mod:`.registry`).

Every entry runs the layer's own forward per sample (the generic tier) unless it names a native
implementation. ``native_forward`` (:mod:`.routes`) runs the layer's own forward once on the packed
rows, with its kernel calls (conv, delta rule, SSD, selective scan) routed to packfree's ops; the
forwards of :mod:`.forwards` do the same for layers whose recurrence is inline (lightning attention, RG-LRU). Classes listed in :data:`REFUSED` cannot be made exact yet: loading a model that holds
one with packfree raises, naming the class and the reason.
"""

from __future__ import annotations

import torch

from .registry import MixerAdapter, positions_per_sample, register_adapter
from .forwards import lightning_forward, rg_lru_forward
from .routes import native_forward

NOT_MIXERS: frozenset[str] = frozenset({
    # named like mixers, mix nothing themselves: RWKV's containers (their mixers have entries below)
    "RwkvModel", "RwkvForCausalLM", "RwkvBlock",
    # xLSTM's containers and per-token parts (the mLSTM layer has its entry below)
    "xLSTMModel", "xLSTMForCausalLM", "xLSTMBlock", "xLSTMFeedForward", "xLSTMRMSNorm",
})
"""Classes that match the mixer heuristics but mix nothing along the sequence (e.g. a vision patch conv)."""

REFUSED: dict[str, str] = {}
"""Layer class -> why packfree cannot run it exactly on packed rows (raised at load)."""

# ------------------------------------------------------------------ Gated DeltaNet / KDA (conv + delta rule)
GATED_DELTA = register_adapter(MixerAdapter("gated_delta", (
    "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet",
    "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet",
), native=native_forward))
KIMI_DELTA = register_adapter(MixerAdapter("kimi_delta", (
    "KimiLinearDeltaAttention", "BailingHybridDeltaAttention", "Glm5NextTextLinearAttention",
), native=native_forward))
# ------------------------------------------------------------------ Mamba2 / SSD and Mamba1 (conv + scan)
MAMBA2 = register_adapter(MixerAdapter("mamba2", (
    "Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer",
    "Zamba2MambaMixer",
), native=native_forward))
MAMBA = register_adapter(MixerAdapter("mamba", ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"),
                                     native=native_forward))
# ------------------------------------------------------------------ short / causal convolutions
SHORT_CONV = register_adapter(MixerAdapter("short_conv", (
    "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv",
), native=native_forward))
INKLING_CONV = register_adapter(MixerAdapter(
    "inkling_conv", ("InklingShortConvolution",),
    notes="generic: its native route agrees with stock only to 1e-9 in float64, unexplained, so not used",
))
CCA = register_adapter(MixerAdapter(
    "cca", ("ZayaCCAProjection",), output_index=(0, 1, 2),
    notes="ZAYA's q/k causal convs and one-token-delayed values; returns per-token (query, key, value)",
))
PLE = register_adapter(MixerAdapter(
    "ple", ("Qwen4ExpTextPLELayer",), token_args=("input_ids",),
    notes="hashed n-grams of the previous tokens (its NGramEmbedding child) and a dilated causal conv",
))
# ------------------------------------------------------------------ other recurrences
LIGHTNING = register_adapter(MixerAdapter(
    "lightning", ("MiniMaxLightningAttention",), native=lightning_forward, output_index=0,
    notes="MiniMax's decay linear attention, computed inline: packfree's decay linear-attention op",
))
RWKV_TIME_MIX = register_adapter(MixerAdapter("rwkv_time_mix", ("RwkvSelfAttention",), hidden_arg="hidden",
                                              output_index=0))
RWKV_CHANNEL_MIX = register_adapter(MixerAdapter(
    "rwkv_channel_mix", ("RwkvFeedForward",), hidden_arg="hidden", output_index=0,
    notes="RWKV's feed-forward mixes each token with the previous one (token shift)",
))
RG_LRU = register_adapter(MixerAdapter(
    "rg_lru", ("RecurrentGemmaRecurrentBlock",), native=rg_lru_forward, hidden_arg="input_states", output_index=0,
    per_sample=positions_per_sample,
    notes="conv1d + RG-LRU, computed inline: packfree's conv and linear-recurrence ops",
))
MLSTM = register_adapter(MixerAdapter("mlstm", ("xLSTMLayer",), hidden_arg="x", output_index=0))
# ------------------------------------------------------------------ attention outside the packfree function
INKLING_ATTENTION = register_adapter(MixerAdapter(
    "custom_attention", ("InklingAttention",), output_index=0, attention="sdpa",
    notes="k/v short convs and a relative-position bias passed as `position_bias`, which only stock sdpa/eager apply",
))
QSA_ATTENTION = register_adapter(MixerAdapter(
    "qsa_attention", ("Qwen4ExpTextAttention",), token_args=("position_embeddings",), output_index=0,
    attention="sdpa", notes="its QSA token indexer selects keys from a dense 4-D mask",
))
DSA_ATTENTION = register_adapter(MixerAdapter(
    "dsa_attention", ("Glm5NextTextAttention",), token_args=("prev_topk_indices", "attention_mask"),
    output_index=(0, 2), attention="sdpa",
    notes="its DSA indexer attends the whole row (causal by itself, given a 2-D padding mask); the top-k key indices it passes to later "
                            "layers are sample-local, consistent because every such layer runs per sample",
))
M3_SPARSE_ATTENTION = register_adapter(MixerAdapter(
    "m3_sparse_attention", ("MiniMaxM3VLAttention",), token_args=("position_embeddings",), output_index=0,
    attention="sdpa", notes="block-sparse attention chosen by its indexer over pooled key blocks",
))
V4_ATTENTION = register_adapter(MixerAdapter(
    "v4_attention", ("DeepseekV4Attention",), token_args=("position_embeddings",), output_index=0,
    per_sample=positions_per_sample, attention="eager",
    notes="KV compressors pool blocks of past tokens, an indexer picks compressed blocks; sinks; eager only",
))
INKLING2_CONV = register_adapter(MixerAdapter(
    "inkling2_conv", ("Inkling2ShortConvolution", "Inkling2LoopShortConvolution"),
    notes="the post-attention short convolution of every Inkling2 decoder layer",
))


def _inkling2_per_sample(num_samples: int, length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Inkling2 attention needs positions and its query-to-key ``relative_distance`` per sample."""
    positions = torch.arange(length, device=device)
    return {"position_ids": positions.expand(num_samples, length),
            "relative_distance": positions[:, None] - positions[None, :]}


INKLING2_ATTENTION = register_adapter(MixerAdapter(
    "inkling2_attention", ("Inkling2FullAttention", "Inkling2SlidingAttention", "Inkling2LoopFullAttention",
                           "Inkling2LoopSlidingAttention"),
    token_args=("key_hidden_states", "value_hidden_states"), output_index=0, attention="eager",
    per_sample=_inkling2_per_sample,
    notes="relative-position bias over row distances with position-dependent log scaling, sinks, and k/v "
          "dynamic short convs fed from other layers' hidden states: runs per sample under stock eager",
))
