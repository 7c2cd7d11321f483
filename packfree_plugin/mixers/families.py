"""One declarative adapter per family of sequence mixers and of attention layers with code of their own (see
:mod:`.registry`); each class names its family in its entry (:data:`packfree_plugin.classes.CLASSES`).

The native families are declared in their op folders (``ops/<family>/family.py``) and get their adapter here, the
native tier (:func:`.seam.native_tier`): the layer runs once on the packed rows, its kernel calls routed to the
family's ops, or the family's own forward where transformers computes the recurrence inline. Every other family
runs the layer's own forward per sample (the generic tier).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from ..classes import stock_tables
from .generic import dense_causal_mask
from ..ops.family import families, positions_per_sample
from ..forward.instance import own_parameters
from .registry import MixerAdapter, register_adapter
from .seam import native_tier

# ------------------------------------------------------------------ native families, declared in their op folders
NATIVE = tuple(register_adapter(MixerAdapter(family.name, native=native_tier(family), hidden_arg=family.hidden_arg,
                                             output_index=family.output_index, per_sample=family.per_sample))
               for family in families().values())
# ------------------------------------------------------------------ short / causal convolutions
INKLING_CONV = register_adapter(MixerAdapter(
    "inkling_conv",
    notes="generic: its native route agrees with stock only to 1e-9 in a float64 model, whose short convs stock "
          "keeps in float32 (float32 rounding of another summation order); not switched this release",
))
CCA = register_adapter(MixerAdapter(
    "cca", output_index=(0, 1, 2),
    notes="ZAYA's q/k causal convs and one-token-delayed values; returns per-token (query, key, value)",
))
PLE = register_adapter(MixerAdapter(
    "ple", token_args=("input_ids",),
    notes="hashed n-grams of the previous tokens (its NGramEmbedding child) and a dilated causal conv",
))
# ------------------------------------------------------------------ other recurrences
RWKV_TIME_MIX = register_adapter(MixerAdapter("rwkv_time_mix", hidden_arg="hidden", output_index=0))
RWKV_CHANNEL_MIX = register_adapter(MixerAdapter(
    "rwkv_channel_mix", hidden_arg="hidden", output_index=0,
    notes="RWKV's feed-forward mixes each token with the previous one (token shift)",
))
MLSTM = register_adapter(MixerAdapter("mlstm", hidden_arg="x", output_index=0))
# ------------------------------------------------------------------ attention outside the packfree function
INKLING_ATTENTION = register_adapter(MixerAdapter(
    "custom_attention", output_index=0, attention="sdpa",
    notes="k/v short convs and a relative-position bias passed as `position_bias`, which only stock sdpa/eager apply",
))
QSA_ATTENTION = register_adapter(MixerAdapter(
    "qsa_attention", token_args=("position_embeddings",), output_index=0,
    attention="sdpa", notes="its QSA token indexer selects keys from a dense 4-D mask",
))
DSA_ATTENTION = register_adapter(MixerAdapter(
    "dsa_attention", token_args=("prev_topk_indices", "attention_mask"),
    output_index=(0, 2), attention="sdpa",
    notes="its DSA indexer attends the whole row (causal by itself, given a 2-D padding mask); the top-k key indices it passes to later "
                            "layers are sample-local, consistent because every such layer runs per sample",
))
M3_SPARSE_ATTENTION = register_adapter(MixerAdapter(
    "m3_sparse_attention", token_args=("position_embeddings",), output_index=0,
    attention="sdpa", notes="block-sparse attention chosen by its indexer over pooled key blocks",
))
V4_ATTENTION = register_adapter(MixerAdapter(
    "v4_attention", token_args=("position_embeddings",), output_index=0,
    per_sample=positions_per_sample, attention="eager",
    notes="KV compressors pool blocks of past tokens, an indexer picks compressed blocks; sinks; eager only",
))
INKLING2_CONV = register_adapter(MixerAdapter(
    "inkling2_conv", notes="the post-attention short convolution of every Inkling2 decoder layer",
))


def _inkling2_per_sample(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Inkling2 attention needs positions and its query-to-key ``relative_distance`` per sample."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    return {"position_ids": positions.expand(*hidden.shape[:2]),
            "relative_distance": positions[:, None] - positions[None, :]}


INKLING2_ATTENTION = register_adapter(MixerAdapter(
    "inkling2_attention", token_args=("key_hidden_states", "value_hidden_states"), output_index=0, attention="eager",
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
    "alibi_attention", token_args=("residual",), output_index=0, attention="eager",
    per_sample=_alibi_per_sample, notes="Bloom: ALiBi added to the scores, built by the model for the whole row",
))
FALCON_ATTENTION = register_adapter(MixerAdapter(
    "falcon_attention", token_args=("position_embeddings",), output_index=0, attention="sdpa",
    per_sample=_falcon_per_sample,
    notes="attention of its own; with alibi, the model folds the bias into the mask of the whole row",
))
MPT_ATTENTION = register_adapter(MixerAdapter(
    "mpt_attention", output_index=0, attention="eager", per_sample=_masked_where_true,
    notes="ALiBi position_bias relative to the last key (equal per sample), a bool mask True where hidden",
))
OWN_ATTENTION = register_adapter(MixerAdapter(
    "own_attention", token_args=("position_embeddings",), output_index=0, attention="eager",
    notes="attention code of its own adding the mask to the scores (GPT-Neo: and its causal/local buffer; "
          "GPT-NeoX-Japanese: returns its dense bias, a parameter); GPT-Neo and GIT pick it from a table "
          "(their entries' stock_table)",
))
BARK_ATTENTION = register_adapter(MixerAdapter(
    "bark_attention", output_index=0, attention="eager", causal=lambda layer: layer.is_causal,
    notes="Bark's attention of its own (picked from a table, its entry's stock_table): causal in the semantic and "
          "coarse models, bidirectional in the fine one",
))
OPENAI_ATTENTION = register_adapter(MixerAdapter(
    "openai_attention", hidden_arg="x", output_index=0, attention="eager",
    notes="OpenAI GPT: its causal buffer is added to the scores; the model's mask is 2-D padding only",
))
XLM_ATTENTION = register_adapter(MixerAdapter(
    "xlm_attention", hidden_arg="input", token_args=("mask",), output_index=0, attention="eager",
    per_sample=_xlm_mask,
    notes="XLM/Flaubert attention of its own with a model-built [B, T] (bidirectional) or [B, T, T] (causal) mask",
))
DOGE_ATTENTION = register_adapter(MixerAdapter(
    "doge_attention", token_args=("position_embeddings",), output_index=0, attention="sdpa",
    notes="dynamic mask attention: value-derived key scores added to the mask, top keep_window_size keys kept",
))
SPARSE_INDEXER_ATTENTION = register_adapter(MixerAdapter(
    "sparse_indexer_attention", token_args=("position_embeddings",), output_index=0, attention="sdpa",
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
    "shared_indexer_attention", token_args=("position_embeddings", "prev_topk_indices"), output_index=(0, 2),
    attention="sdpa", per_sample_output=_full_topk_width,
    notes="DSA whose top-k key indices also go to later layers that share them: per sample they are sample-local, "
          "consistent because every such layer runs per sample",
))
SHARED_INDEXER_SINK_ATTENTION = register_adapter(MixerAdapter(
    "shared_indexer_sink_attention", token_args=("position_embeddings", "prev_topk_indices"), output_index=(0, 2),
    attention="eager", per_sample_output=_full_topk_width,
    notes="as shared_indexer_attention, with sinks and an output gate: eager only",
))

_ADDED: list[dict] = []


def add_implementation_entry(model_class: type) -> None:
    """Give every attention-class table named by an entry's ``stock_table`` whose module is loaded (``model_class``'s
    own, and those of the towers it builds, which its module imported) a ``"packfree"`` entry (idempotent). A class
    found there that attends along the text row has a family that runs it per sample under that stock
    implementation."""
    for module_name, (table_name, implementation) in stock_tables().items():
        module = sys.modules.get("transformers.models." + module_name)
        classes = getattr(module, table_name, None) if module is not None else None
        if classes is not None and "packfree" not in classes:
            classes["packfree"] = classes[implementation]
            _ADDED.append(classes)


def remove_implementation_entries() -> None:
    """Undo :func:`add_implementation_entry`."""
    while _ADDED:
        _ADDED.pop().pop("packfree", None)
