"""One declarative entry per family of sequence mixers and of attention layers with code of their own (see
:mod:`.entry`).

Every entry runs the layer's own forward per sample (the generic tier) unless it names a native
implementation. ``native_forward`` (:mod:`.routes`) runs the layer's own forward once on the packed
rows, with its kernel calls (conv, delta rule, SSD, selective scan) routed to packfree's ops: the entry's
``routes`` name those kernel functions and the modeling modules they live in. The forwards of :mod:`.forwards` do
the same for layers whose recurrence is inline (lightning attention, RG-LRU). Classes entered with
:func:`.entry.register_refusal` cannot be made exact yet: loading a model that holds one with packfree raises, naming
the class and the reason.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from .entry import MixerAdapter, dense_causal_mask, positions_per_sample, register_adapter, register_refusal
from .forwards import lightning_forward, rg_lru_forward
from .instance import own_parameters
from .routes import native_forward

NOT_MIXERS: frozenset[str] = frozenset({
    # named like mixers, mix nothing themselves: RWKV's containers (their mixers have entries below)
    "RwkvModel", "RwkvForCausalLM", "RwkvBlock",
    # xLSTM's containers and per-token parts (the mLSTM layer has its entry below)
    "xLSTMModel", "xLSTMForCausalLM", "xLSTMBlock", "xLSTMFeedForward", "xLSTMRMSNorm",
})
"""Classes that match the mixer heuristics but mix nothing along the sequence (e.g. a vision patch conv)."""

# ------------------------------------------------------------------ refused: no exact per-sample path (raised at load)
register_refusal("CpmAntEncoder", (
    "CPM-Ant prepends learned prompt tokens to every row and attends bidirectionally over the whole "
    "row, prompt included: each sample alone gets a prompt of its own, a packed row shares one"))
register_refusal("ProphetNetNgramSelfAttention", (
    "ProphetNet numbers positions from the attention mask over the whole row (position_ids are not "
    "read) and its n-gram predict streams attend to the row's main stream"))
register_refusal("XLNetRelativeAttention", (
    "XLNet's two-stream relative attention runs sequence-first ([T, B]) with a bidirectional mask, "
    "relative encodings and permutation masks built for the whole row"))
register_refusal("LSHSelfAttention", (
    "Reformer hashes the whole row into LSH buckets and sorts it, so samples share buckets"))
register_refusal("LocalSelfAttention", (
    "Reformer's local attention runs in fixed chunks of the row that also see the previous chunk"))
register_refusal("DogeCDMoE", (
    "Doge's MoE router splits the router logits of all the batch's tokens into two halves (view(2, B "
    "* T, -1)), so each token's experts depend on the other tokens of the batch, even in stock"))
register_refusal("WhisperEncoder", (
    "Whisper's encoder reads fixed 30-second log-mel windows (input_features) through a conv "
    "front-end, one window per row, not a row of tokens; packfree packs Whisper's decoder alone "
    "(WhisperForCausalLM)"))
for _assistant in ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM"):
    register_refusal(_assistant, (
        "Gemma 4's speculative-decoding assistant runs on its target model's hidden states (inputs_embeds) "
        "and attends bidirectionally to all of the target's keys and values (shared_kv_states): it has no "
        "row of tokens of its own and no keys and values per sample to keep apart"))

# The native families' kernel functions: module-level function of a modeling module -> the kernel it implements
# (a route of :data:`.routes.ROUTED_KERNELS`). These are the functions a modeling module declares with
# ``@use_kernel_func_from_hub_with_fallback("<kernel>", ...)`` and calls from its mixers, for the transformers range
# in :mod:`packfree_plugin.compat` (``tests/adapters/test_kernel_table.py`` checks each exists).
_CONV = {"causal_conv1d_fn": "causal_conv1d_fn", "causal_conv1d_update": "causal_conv1d_update"}
_GATED_DELTA = {**_CONV, "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule"}
_KDA = {**_CONV, "chunk_kimi_delta_attention": "chunk_kda", "recurrent_kimi_delta_attention": "fused_recurrent_kda"}
_MAMBA2 = {**_CONV, "mamba2_chunk_scan": "mamba_chunk_scan_combined",
           "mamba2_split_conv1d_scan_combined": "mamba_split_conv1d_scan_combined",
           "mamba2_selective_state_update": "selective_state_update"}
_MAMBA = {**_CONV, "mamba_selective_scan": "selective_scan_fn", "mamba_selective_state_update": "selective_state_update"}
_FUSED_MAMBA = {**_MAMBA, "mamba_inner_fn": "mamba_inner_fn"}


def _in(functions: dict[str, str], *modules: str) -> dict[str, dict[str, str]]:
    """``functions`` routed in each modeling module (``"mamba2.modeling_mamba2"``, under ``transformers.models``)."""
    return dict.fromkeys(modules, functions)


# ------------------------------------------------------------------ Gated DeltaNet / KDA (conv + delta rule)
GATED_DELTA = register_adapter(MixerAdapter("gated_delta", (
    "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen4ExpTextGatedDeltaNet",
    "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet",
), native=native_forward, routes=_in(
    _GATED_DELTA, "qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen4_exp.modeling_qwen4_exp", "olmo_hybrid.modeling_olmo_hybrid", "lara_mini.modeling_lara_mini",
)))
KIMI_DELTA = register_adapter(MixerAdapter("kimi_delta", (
    "KimiLinearDeltaAttention", "BailingHybridDeltaAttention", "Glm5NextTextLinearAttention",
), native=native_forward, routes=_in(
    _KDA, "kimi_linear.modeling_kimi_linear", "bailing_hybrid.modeling_bailing_hybrid", "glm5_next.modeling_glm5_next",
)))
# ------------------------------------------------------------------ Mamba2 / SSD and Mamba1 (conv + scan)
MAMBA2 = register_adapter(MixerAdapter("mamba2", (
    "Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer",
    "Zamba2MambaMixer",
), native=native_forward, routes=_in(
    _MAMBA2, "mamba2.modeling_mamba2", "bamba.modeling_bamba", "falcon_h1.modeling_falcon_h1",
    "granitemoehybrid.modeling_granitemoehybrid", "nemotron_h.modeling_nemotron_h", "zamba2.modeling_zamba2",
)))
MAMBA = register_adapter(MixerAdapter(
    "mamba", ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"), native=native_forward,
    routes={**_in(_FUSED_MAMBA, "mamba.modeling_mamba", "falcon_mamba.modeling_falcon_mamba", "jamba.modeling_jamba"),
            **_in(_MAMBA, "zamba.modeling_zamba")},
))
# ------------------------------------------------------------------ short / causal convolutions
SHORT_CONV = register_adapter(MixerAdapter("short_conv", (
    "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv",
), native=native_forward, routes=_in(_CONV, "lfm2.modeling_lfm2", "lfm2_moe.modeling_lfm2_moe", "lfm3.modeling_lfm3")))
INKLING_CONV = register_adapter(MixerAdapter(
    "inkling_conv", ("InklingShortConvolution",),
    notes="generic: its native route agrees with stock only to 1e-9 in a float64 model, whose short convs stock "
          "keeps in float32 (float32 rounding of another summation order); not switched this release",
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


def _inkling2_per_sample(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inkling2 attention needs positions and its query-to-key ``relative_distance`` per sample."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    return {"position_ids": positions.expand(*hidden.shape[:2]),
            "relative_distance": positions[:, None] - positions[None, :]}


INKLING2_ATTENTION = register_adapter(MixerAdapter(
    "inkling2_attention", ("Inkling2FullAttention", "Inkling2SlidingAttention", "Inkling2LoopFullAttention",
                           "Inkling2LoopSlidingAttention"),
    token_args=("key_hidden_states", "value_hidden_states"), output_index=0, attention="eager",
    per_sample=_inkling2_per_sample,
    notes="relative-position bias over row distances with position-dependent log scaling, sinks, and k/v "
          "dynamic short convs fed from other layers' hidden states: runs per sample under stock eager",
))


# ------------------------------------------------------------------ attention with code of its own, run per sample
def _group_alibi(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The ALiBi bias ``[n * heads, 1, L]`` of a right-padded group ``hidden [n, L, C]``, from the modeling module's
    own ``build_alibi_tensor``: it grows with the key's position and restarts with every sample (softmax ignores the
    per-query constant, so this equals each sample alone)."""
    build = sys.modules[type(layer).__module__].build_alibi_tensor
    ones = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    return build(ones, layer.num_heads, dtype=hidden.dtype)


def _alibi_per_sample(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """ALiBi models given an ``alibi`` argument (Bloom): the group's ``alibi [n * heads, 1, L]``."""
    if call.get("alibi") is None:
        return {}
    return {"alibi": _group_alibi(layer, hidden)}


def _masked_where_true(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """MPT's attention takes a bool mask that is True where a key is hidden (``masked_fill``)."""
    return {"attention_mask": ~dense_causal_mask(hidden.shape[0], hidden.shape[1], hidden.device)}


def _xlm_mask(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """XLM/Flaubert's ``mask``: per token ``[n, L]`` (bidirectional; zero on a group's right padding) as gathered, or,
    for a causal model (``[B, T, T]``, gathered to ``[n, L, T]``), the causal ``[n, L, L]`` of the group."""
    if call["mask"].ndim == 2:
        return {}
    return {"mask": dense_causal_mask(hidden.shape[0], hidden.shape[1], hidden.device)[:, 0]}


def _falcon_per_sample(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Falcon with ALiBi, per right-padded group ``hidden [n, L, C]``: the float ``attention_mask [n, heads, L, L]`` its
    model builds for a whole batch (the bias divided by sqrt(head_dim), the dtype's minimum on hidden keys), which is
    where its sdpa path reads the bias. An attention that takes an ``alibi`` argument (transformers <= 5.24) also
    gets the group's ``alibi [n * heads, 1, L]``, and is ALiBi when given one; a later one takes no ``alibi`` (its
    model folds the bias into the mask alone) and is ALiBi when ``config.alibi`` says so."""
    takes_alibi = "alibi" in own_parameters(layer).names
    if not (call.get("alibi") is not None if takes_alibi else getattr(layer.config, "alibi", False)):
        return {}
    alibi = _group_alibi(layer, hidden)
    bias = alibi.view(hidden.shape[0], layer.num_heads, 1, hidden.shape[1]) / math.sqrt(layer.head_dim)
    hidden_keys = ~dense_causal_mask(hidden.shape[0], hidden.shape[1], hidden.device)
    mask = bias.masked_fill(hidden_keys, torch.finfo(hidden.dtype).min)
    return {"alibi": alibi, "attention_mask": mask} if takes_alibi else {"attention_mask": mask}


ALIBI_ATTENTION = register_adapter(MixerAdapter(
    "alibi_attention", ("BloomAttention",), token_args=("residual",), output_index=0, attention="eager",
    per_sample=_alibi_per_sample, notes="Bloom: ALiBi added to the scores, built by the model for the whole row",
))
FALCON_ATTENTION = register_adapter(MixerAdapter(
    "falcon_attention", ("FalconAttention",), token_args=("position_embeddings",), output_index=0, attention="sdpa",
    per_sample=_falcon_per_sample,
    notes="attention of its own; with alibi, the model folds the bias into the mask of the whole row",
))
MPT_ATTENTION = register_adapter(MixerAdapter(
    "mpt_attention", ("MptAttention",), output_index=0, attention="eager", per_sample=_masked_where_true,
    notes="ALiBi position_bias relative to the last key (equal per sample), a bool mask True where hidden",
))
OWN_ATTENTION = register_adapter(MixerAdapter(
    "own_attention", ("GPTNeoSelfAttention", "GitSelfAttention", "GPTNeoXJapaneseAttention"),
    token_args=("position_embeddings",), output_index=0, attention="eager",
    notes="attention code of its own adding the mask to the scores (GPT-Neo: and its causal/local buffer; "
          "GPT-NeoX-Japanese: returns its dense bias, a parameter); GPT-Neo and GIT pick it from a table "
          "(IMPLEMENTATION_TABLES)",
))
BARK_ATTENTION = register_adapter(MixerAdapter(
    "bark_attention", ("BarkSelfAttention",), output_index=0, attention="eager", causal=lambda layer: layer.is_causal,
    notes="Bark's attention of its own (picked from a table, IMPLEMENTATION_TABLES): causal in the semantic and "
          "coarse models, bidirectional in the fine one",
))
OPENAI_ATTENTION = register_adapter(MixerAdapter(
    "openai_attention", ("openai.Attention",), hidden_arg="x", output_index=0, attention="eager",
    notes="OpenAI GPT: its causal buffer is added to the scores; the model's mask is 2-D padding only",
))
XLM_ATTENTION = register_adapter(MixerAdapter(
    "xlm_attention", ("xlm.MultiHeadAttention", "flaubert.MultiHeadAttention"), hidden_arg="input",
    token_args=("mask",), output_index=0, attention="eager", per_sample=_xlm_mask,
    notes="XLM/Flaubert attention of its own with a model-built [B, T] (bidirectional) or [B, T, T] (causal) mask",
))
DOGE_ATTENTION = register_adapter(MixerAdapter(
    "doge_attention", ("DogeAttention",), token_args=("position_embeddings",), output_index=0, attention="sdpa",
    notes="dynamic mask attention: value-derived key scores added to the mask, top keep_window_size keys kept",
))
SPARSE_INDEXER_ATTENTION = register_adapter(MixerAdapter(
    "sparse_indexer_attention", ("DeepseekV32Attention", "AXK2Attention", "Dots3NoteTextAttention"),
    token_args=("position_embeddings",),
    output_index=0, attention="sdpa",
    notes="DSA: an indexer picks each query's top-k keys from a dense mask; per sample the top-k stays inside the sample",
))


def _full_topk_width(layer: nn.Module, output: tuple) -> tuple:
    """``(out, weights, topk_indices [n, L, min(index_topk, L)])`` -> the indices ``[n, L, index_topk]``, widened by
    repeating their first column: a group shorter than ``index_topk`` selects all of its keys, and a repeated index
    selects nothing more, so every group's indices have the width the packed row scatters back."""
    indices = output[2]
    missing = layer.config.index_topk - indices.shape[-1]
    if missing <= 0:
        return output
    indices = torch.cat([indices, indices[..., :1].expand(*indices.shape[:-1], missing)], dim=-1)
    return (*output[:2], indices, *output[3:])


SHARED_INDEXER_ATTENTION = register_adapter(MixerAdapter(
    "shared_indexer_attention", ("GlmMoeDsaAttention",),
    token_args=("position_embeddings", "prev_topk_indices"), output_index=(0, 2), attention="sdpa",
    per_sample_output=_full_topk_width,
    notes="DSA whose top-k key indices also go to later layers that share them: per sample they are sample-local, "
          "consistent because every such layer runs per sample",
))
SHARED_INDEXER_SINK_ATTENTION = register_adapter(MixerAdapter(
    "shared_indexer_sink_attention", ("HYV4Attention",),
    token_args=("position_embeddings", "prev_topk_indices"), output_index=(0, 2), attention="eager",
    per_sample_output=_full_topk_width, notes="as shared_indexer_attention, with sinks and an output gate: eager only",
))

IMPLEMENTATION_TABLES: dict[str, tuple[str, str]] = {
    "transformers.models.gpt_neo.modeling_gpt_neo": ("GPT_NEO_ATTENTION_CLASSES", "eager"),
    "transformers.models.falcon.modeling_falcon": ("FALCON_ATTENTION_CLASSES", "sdpa"),
    "transformers.models.git.modeling_git": ("GIT_SELF_ATTENTION_CLASSES", "eager"),
    "transformers.models.bark.modeling_bark": ("BARK_ATTENTION_CLASSES", "eager"),
    # vision towers (SAM-style image encoders inside DeepSeek-OCR2, DeepSeek-VL-hybrid, ...): they attend over
    # their own patches, never along a packed text row, so stock's class is exact as it is
    "transformers.models.sam.modeling_sam": ("SAM_VISION_ATTENTION_CLASSES", "sdpa"),
    "transformers.models.sam_hq.modeling_sam_hq": ("SAM_HQ_VISION_ATTENTION_CLASSES", "sdpa"),
    "transformers.models.deepseek_ocr2.modeling_deepseek_ocr2": ("DEEPSEEK_OCR2_SAM_VISION_ATTENTION_CLASSES", "sdpa"),
    "transformers.models.unlimited_ocr.modeling_unlimited_ocr": ("UNLIMITED_OCR_SAM_VISION_ATTENTION_CLASSES", "sdpa"),
}
"""Modeling module -> (its table of attention classes by implementation, the entry ``"packfree"`` gets). A class
found there that attends along the text row is covered by an adapter above, which runs it per sample under that
stock implementation."""
_ADDED: list[dict] = []


def add_implementation_entry(model_class: type) -> None:
    """Give every attention-class table of :data:`IMPLEMENTATION_TABLES` whose module is loaded (``model_class``'s own,
    and those of the towers it builds, which its module imported) a ``"packfree"`` entry (idempotent)."""
    for module_name, (table_name, implementation) in IMPLEMENTATION_TABLES.items():
        module = sys.modules.get(module_name)
        classes = getattr(module, table_name, None) if module is not None else None
        if classes is not None and "packfree" not in classes:
            classes["packfree"] = classes[implementation]
            _ADDED.append(classes)


def remove_implementation_entries() -> None:
    """Undo :func:`add_implementation_entry`."""
    while _ADDED:
        _ADDED.pop().pop("packfree", None)
