"""Everything packfree knows about single transformers classes: one table, :data:`CLASSES`, one entry per class.

The key is the class's name, qualified by its model folder (``"openai.Attention"`` for
``transformers.models.openai.modeling_openai.Attention``) where transformers has several classes of that name.
A class is a layer (a mixer, an attention layer, an embedding, a decoder layer), a model, a cache layer, or, for what a
model decides from its config, the config class. This file holds data only: each field names a behaviour that lives in
the layer acting on it, which looks the entry up (:func:`entry_of`, :func:`inherited_entry`):

- ``mixer``: the family of sequence mixers or attention layers with code of their own that runs the class on packed
  rows: a native family declared in its op folder (``ops/<family>/family.py``, :func:`.ops.family.families`), else
  a key of :data:`.mixers.registry.ADAPTERS` (:mod:`.mixers.families`, :mod:`.mixers.encoders`);
  ``modeling``: for a native family that routes kernel functions, the class's modeling module, where the family's
  functions are routed (:mod:`.mixers.seam`);
- ``stock_table``: the class is picked from a table of attention classes by implementation, which gets a
  ``"packfree"`` entry (:mod:`.mixers.families`);
- ``mixes_nothing``: looks like a sequence mixer, mixes nothing (:func:`.mixers.entry.check_coverage`);
- ``refused``: why packfree cannot run the class exactly on packed rows, raised at load (:mod:`.mixers.entry`) or
  by a packed row (:mod:`.quirks.whole_row`, :mod:`.quirks.dense_masks`);
- ``numbering``: an embedding module that computes positions itself (:mod:`.quirks.positions`);
- ``shifted_decoder_input``: a seq2seq model that shifts this argument right into decoder inputs
  (:mod:`.quirks.decoder_inputs`);
- ``dense_mask``, ``causal_self_attention``: attention that adds ``attention_mask`` to its scores itself, and decoder
  layers whose self-attention does not say it is causal (:mod:`.quirks.dense_masks`);
- ``relative_position_bias``, ``half_width_window``: attention layers that pass T5's relative bias, or their window as
  a half-width (:mod:`.attention.interface`; the bias is cut to the longest sample in :mod:`.quirks.whole_row`);
- ``tensor_mask``, ``slices_mask``: config classes whose model code works on the attention mask as a tensor, or
  indexes it (:mod:`.attention.masks`, :mod:`.forward.unpacked`);
- ``images_per_row``: config classes whose image tensors are ``[B, images, ...]`` (:mod:`.packing.vision`);
- ``rope_per_sample``: config classes of multimodal-RoPE models whose packed rows packfree numbers per sample with the
  model's own ``get_rope_index`` (:mod:`.forward.rope_ids`);
- ``stores_nothing``: cache layers that hold no state, so say nothing of earlier tokens (:mod:`.forward.reading`).

A new model class, quirk or refusal is one entry here (or one more field on an entry); a new native mixer family is
one op folder under ``ops/`` with its ``family.py``, named by its classes' entries (docs/layout.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CLASSES", "ClassEntry", "DenseMask", "Refusal", "StockTable", "classes_with", "entry_of",
           "inherited_entry", "stock_tables", "switched_on"]


@dataclass(frozen=True)
class Refusal:
    """Why packfree cannot run a class exactly on packed rows."""

    reason: str
    on: Literal["load", "packed_row"] = "load"
    """``"load"``: loading a model that holds the class with packfree raises the reason. ``"packed_row"``: the class
    runs as stock on one sample per row, and a packed row through it raises."""
    when: tuple[str, Any] | None = None
    """``(attribute, value)``: the layer is refused only while its attribute has this value (packed rows only)."""

    def __post_init__(self) -> None:
        if self.when is not None and self.on != "packed_row":
            raise ValueError("a refusal under a condition of the layer is raised by a packed row, not at load")


@dataclass(frozen=True)
class DenseMask:
    """An attention layer that adds ``attention_mask`` to its scores itself. ``cross_input``: the name of its
    cross-attention input (None: self-attention only)."""

    cross_input: str | None = None


@dataclass(frozen=True)
class StockTable:
    """A table of attention classes by implementation that a model picks the class from: it gets a ``"packfree"``
    entry, the class of ``implementation``."""

    module: str
    """The modeling module, under ``transformers.models``."""
    table: str
    implementation: str


@dataclass(frozen=True)
class ClassEntry:
    """What packfree knows about one transformers class (every field but ``notes`` defaults to: nothing)."""

    mixer: str | None = None
    """The family that runs the class on packed rows: a key of :data:`.mixers.registry.ADAPTERS`."""
    modeling: str | None = None
    """Native tier: the class's modeling module (under ``transformers.models``), whose kernel functions its family
    routes (the family's ``routes``, :class:`packfree_plugin.ops.family.MixerFamily`)."""
    stock_table: StockTable | None = None
    """The table of attention classes its model picks the class from."""
    mixes_nothing: bool = False
    """Matches the mixer heuristics (:func:`.mixers.entry.check_coverage`) but mixes nothing along the sequence."""
    refused: Refusal | None = None
    """Why packfree cannot run the class exactly on packed rows."""
    numbering: str | None = None
    """Embedding module: the name of its rule in :data:`.quirks.positions.RULES` (``after_padding_idx``,
    ``position_buffer``, ``by_shape``, ``per_sample``)."""
    shifted_decoder_input: str | None = None
    """Seq2seq model: the argument its forward shifts right into ``decoder_input_ids`` when none are given."""
    dense_mask: DenseMask | None = None
    """Eager-only attention layer that adds ``attention_mask`` to its scores itself."""
    causal_self_attention: str | None = None
    """Decoder layer: the attribute holding its self-attention, which does not declare ``is_causal``."""
    relative_position_bias: bool = False
    """Attention layer that passes T5's relative ``position_bias [1, H, Tq, Tk]`` to the attention function."""
    half_width_window: bool = False
    """Bidirectional attention layer that passes its mask's half-width ``w`` as ``sliding_window`` (not ``w + 1``)."""
    tensor_mask: bool | str = False
    """Config class: its model code works on the attention mask as a tensor before its layers (True, or the config
    switch under which it does)."""
    slices_mask: bool | str = False
    """Config class: its model code indexes the masks it builds (True, or the config switch under which it does)."""
    images_per_row: bool = False
    """Config class: its image tensors are ``[B, images, ...]`` (one entry per row), not ``[images, ...]``."""
    rope_per_sample: bool = False
    """Config class of a multimodal-RoPE model whose forward numbers a lone sample with
    ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw[, second_per_grid_ts])``: a packed
    row with images and 2-D ids (or boundary kwargs alone) gets each sample's own positions from that function."""
    stores_nothing: bool = False
    """Cache layer that stores nothing (the MLP / MoE-only layers of hybrids such as NemotronH)."""
    notes: str = field(default="", compare=False)

    @property
    def refused_at_load(self) -> bool:
        return self.refused is not None and self.refused.on == "load"


def _table(*groups: tuple[Iterable[str], ClassEntry]) -> dict[str, ClassEntry]:
    """``(class names, entry)`` groups as one table; a class named twice raises (one entry per class)."""
    table: dict[str, ClassEntry] = {}
    for names, entry in groups:
        for name in names:
            if name in table:
                raise ValueError(f"{name} has two entries; give it one with every field it needs")
            table[name] = entry
    return table


def _refused(name: str, reason: str) -> tuple[tuple[str], ClassEntry]:
    """A class packfree refuses at load, saying ``reason``."""
    return (name,), ClassEntry(refused=Refusal(reason))


def _routed(mixer: str, modules: Mapping[str, str]) -> list[tuple[tuple[str], ClassEntry]]:
    """Classes of the native family ``mixer``, each with its modeling module (``modules``: class name -> module under
    ``transformers.models``), where the family's kernel functions are routed."""
    return [((name,), ClassEntry(mixer=mixer, modeling=module)) for name, module in modules.items()]


_FAIRSEQ_EMBEDDINGS = (
    "RobertaEmbeddings", "XLMRobertaEmbeddings", "CamembertEmbeddings", "Data2VecTextEmbeddings",
    "RobertaPreLayerNormEmbeddings", "XLMRobertaXLEmbeddings", "XmodEmbeddings", "IBertEmbeddings", "LukeEmbeddings",
    "MPNetEmbeddings", "Kosmos2_5TextSinusoidalPositionalEmbedding",
)
_TABLE_EMBEDDINGS = (
    "BartLearnedPositionalEmbedding", "MBartLearnedPositionalEmbedding", "PLBartLearnedPositionalEmbedding",
    "MvpLearnedPositionalEmbedding", "TrOCRLearnedPositionalEmbedding", "BigBirdPegasusLearnedPositionalEmbedding",
    "BlenderbotLearnedPositionalEmbedding", "BlenderbotSmallLearnedPositionalEmbedding",
    "MarianSinusoidalPositionalEmbedding", "PegasusSinusoidalPositionalEmbedding",
    "MusicgenSinusoidalPositionalEmbedding", "MusicgenMelodySinusoidalPositionalEmbedding", "WhisperPositionalEmbedding",
)
_DENOISING_MODELS = ("BartModel", "MBartModel", "PLBartModel", "MvpModel", "BigBirdPegasusModel")
_GENERATION_HEADS = (
    "BartForConditionalGeneration", "MBartForConditionalGeneration", "PLBartForConditionalGeneration",
    "MvpForConditionalGeneration", "BigBirdPegasusForConditionalGeneration", "MarianMTModel",
    "PegasusForConditionalGeneration", "BlenderbotForConditionalGeneration", "BlenderbotSmallForConditionalGeneration",
    "T5ForConditionalGeneration", "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration",
    "LongT5ForConditionalGeneration",
)
_SAM_TOWER = "vision tower: attends over its own patches, never along a packed text row, so stock's class is exact"

CLASSES: dict[str, ClassEntry] = _table(
    # ================================================================ sequence mixers
    # ---------------------------------------------------------------- Gated DeltaNet / KDA (conv + delta rule)
    *_routed("gated_delta", {
        "Qwen3NextGatedDeltaNet": "qwen3_next.modeling_qwen3_next", "Qwen3_5GatedDeltaNet": "qwen3_5.modeling_qwen3_5",
        "Qwen3_5MoeGatedDeltaNet": "qwen3_5_moe.modeling_qwen3_5_moe",
        "Qwen4ExpTextGatedDeltaNet": "qwen4_exp.modeling_qwen4_exp",
        "OlmoHybridGatedDeltaNet": "olmo_hybrid.modeling_olmo_hybrid",
        "LaraMiniGatedDeltaNet": "lara_mini.modeling_lara_mini",
    }),
    *_routed("kimi_delta", {
        "KimiLinearDeltaAttention": "kimi_linear.modeling_kimi_linear",
        "BailingHybridDeltaAttention": "bailing_hybrid.modeling_bailing_hybrid",
        "Glm5NextTextLinearAttention": "glm5_next.modeling_glm5_next",
    }),
    # ---------------------------------------------------------------- Mamba2 / SSD and Mamba1 (conv + scan)
    *_routed("mamba2", {
        "Mamba2Mixer": "mamba2.modeling_mamba2", "BambaMixer": "bamba.modeling_bamba",
        "FalconH1Mixer": "falcon_h1.modeling_falcon_h1",
        "GraniteMoeHybridMambaLayer": "granitemoehybrid.modeling_granitemoehybrid",
        "NemotronHMamba2Mixer": "nemotron_h.modeling_nemotron_h", "Zamba2MambaMixer": "zamba2.modeling_zamba2",
    }),
    *_routed("mamba", {
        "MambaMixer": "mamba.modeling_mamba", "FalconMambaMixer": "falcon_mamba.modeling_falcon_mamba",
        "JambaMambaMixer": "jamba.modeling_jamba",
    }),
    *_routed("mamba", {"ZambaMambaMixer": "zamba.modeling_zamba"}),
    # ---------------------------------------------------------------- short / causal convolutions
    *_routed("short_conv", {
        "Lfm2ShortConv": "lfm2.modeling_lfm2", "Lfm2MoeShortConv": "lfm2_moe.modeling_lfm2_moe",
        "Lfm3ShortConv": "lfm3.modeling_lfm3",
    }),
    (("InklingShortConvolution",), ClassEntry(mixer="inkling_conv")),
    (("ZayaCCAProjection",), ClassEntry(mixer="cca")),
    (("Qwen4ExpTextPLELayer",), ClassEntry(mixer="ple")),
    (("Inkling2ShortConvolution", "Inkling2LoopShortConvolution"), ClassEntry(mixer="inkling2_conv")),
    # ---------------------------------------------------------------- other recurrences
    (("MiniMaxLightningAttention",), ClassEntry(mixer="lightning")),
    (("RwkvSelfAttention",), ClassEntry(mixer="rwkv_time_mix")),
    (("RwkvFeedForward",), ClassEntry(mixer="rwkv_channel_mix")),
    (("RecurrentGemmaRecurrentBlock",), ClassEntry(mixer="rg_lru")),
    (("xLSTMLayer",), ClassEntry(mixer="mlstm")),
    # ---------------------------------------------------------------- named like mixers, mix nothing themselves
    (("RwkvModel", "RwkvForCausalLM", "RwkvBlock"), ClassEntry(
        mixes_nothing=True, notes="RWKV's containers (their mixers have entries above)")),
    (("xLSTMModel", "xLSTMForCausalLM", "xLSTMBlock", "xLSTMFeedForward", "xLSTMRMSNorm"), ClassEntry(
        mixes_nothing=True, notes="xLSTM's containers and per-token parts (the mLSTM layer has its entry above)")),
    # ================================================================ attention with code of its own, run per sample
    (("InklingAttention",), ClassEntry(mixer="custom_attention")),
    (("Qwen4ExpTextAttention",), ClassEntry(mixer="qsa_attention")),
    (("Glm5NextTextAttention",), ClassEntry(mixer="dsa_attention")),
    (("MiniMaxM3VLAttention",), ClassEntry(mixer="m3_sparse_attention")),
    (("DeepseekV4Attention",), ClassEntry(mixer="v4_attention")),
    (("Inkling2FullAttention", "Inkling2SlidingAttention", "Inkling2LoopFullAttention",
      "Inkling2LoopSlidingAttention"), ClassEntry(mixer="inkling2_attention")),
    (("BloomAttention",), ClassEntry(mixer="alibi_attention")),
    (("FalconAttention",), ClassEntry(
        mixer="falcon_attention", stock_table=StockTable("falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES", "sdpa"),
        notes="picked from FALCON_ATTENTION_CLASSES where the release has that table")),
    (("MptAttention",), ClassEntry(mixer="mpt_attention")),
    (("GPTNeoSelfAttention",), ClassEntry(
        mixer="own_attention",
        stock_table=StockTable("gpt_neo.modeling_gpt_neo", "GPT_NEO_ATTENTION_CLASSES", "eager"))),
    (("GitSelfAttention",), ClassEntry(
        mixer="own_attention", stock_table=StockTable("git.modeling_git", "GIT_SELF_ATTENTION_CLASSES", "eager"))),
    (("GPTNeoXJapaneseAttention",), ClassEntry(mixer="own_attention")),
    (("BarkSelfAttention",), ClassEntry(
        mixer="bark_attention", stock_table=StockTable("bark.modeling_bark", "BARK_ATTENTION_CLASSES", "eager"))),
    (("openai.Attention",), ClassEntry(mixer="openai_attention")),
    (("xlm.MultiHeadAttention", "flaubert.MultiHeadAttention"), ClassEntry(mixer="xlm_attention")),
    (("DogeAttention",), ClassEntry(mixer="doge_attention")),
    (("DeepseekV32Attention", "AXK2Attention", "Dots3NoteTextAttention"), ClassEntry(mixer="sparse_indexer_attention")),
    (("GlmMoeDsaAttention",), ClassEntry(mixer="shared_indexer_attention")),
    (("HYV4Attention",), ClassEntry(mixer="shared_indexer_sink_attention")),
    # ---------------------------------------------------------------- vision towers picking attention from a table
    (("SamVisionSdpaAttention",), ClassEntry(
        stock_table=StockTable("sam.modeling_sam", "SAM_VISION_ATTENTION_CLASSES", "sdpa"), notes=_SAM_TOWER)),
    (("SamHQVisionSdpaAttention",), ClassEntry(
        stock_table=StockTable("sam_hq.modeling_sam_hq", "SAM_HQ_VISION_ATTENTION_CLASSES", "sdpa"), notes=_SAM_TOWER)),
    (("DeepseekOcr2SamVisionSdpaAttention",), ClassEntry(
        stock_table=StockTable("deepseek_ocr2.modeling_deepseek_ocr2", "DEEPSEEK_OCR2_SAM_VISION_ATTENTION_CLASSES",
                               "sdpa"), notes=_SAM_TOWER)),
    (("UnlimitedOcrSamVisionSdpaAttention",), ClassEntry(
        stock_table=StockTable("unlimited_ocr.modeling_unlimited_ocr", "UNLIMITED_OCR_SAM_VISION_ATTENTION_CLASSES",
                               "sdpa"), notes=_SAM_TOWER)),
    # ================================================================ BERT-era encoders, run per sample at the encoder
    (("BigBirdEncoder", "MegatronBertEncoder", "RemBertEncoder", "RoFormerEncoder"), ClassEntry(
        mixer="bert_era_encoder")),
    (("IBertEncoder", "MPNetEncoder", "NystromformerEncoder", "TapasEncoder", "ConvBertEncoder", "SqueezeBertEncoder",
      "FNetEncoder"), ClassEntry(mixer="encoder")),
    (("LukeEncoder",), ClassEntry(mixer="luke_encoder")),
    (("LayoutLMSelfAttention",), ClassEntry(mixer="layoutlm_attention")),
    (("DebertaEncoder", "DebertaV2Encoder", "YosoEncoder", "MraEncoder"), ClassEntry(mixer="padding_mask_encoder")),
    # ================================================================ refused at load: no exact per-sample path
    _refused("BigBirdBlockSparseAttention",
             "BigBird's block-sparse attention pads the row to its block size and attends random blocks of the "
             "whole row; load the model with attention_type='original_full'"),
    _refused("FunnelEncoder", "Funnel pools neighbouring tokens of the row into fewer, so outputs are not per token"),
    _refused("PerceiverEncoder",
             "Perceiver's latents cross-attend to the whole row, so outputs are per latent, not per token"),
    _refused("LongformerSelfAttention",
             "Longformer pads the row to a multiple of its attention window and gives global tokens attention "
             "over the whole row"),
    _refused("CpmAntEncoder",
             "CPM-Ant prepends learned prompt tokens to every row and attends bidirectionally over the whole "
             "row, prompt included: each sample alone gets a prompt of its own, a packed row shares one"),
    _refused("ProphetNetNgramSelfAttention",
             "ProphetNet numbers positions from the attention mask over the whole row (position_ids are not "
             "read) and its n-gram predict streams attend to the row's main stream"),
    _refused("XLNetRelativeAttention",
             "XLNet's two-stream relative attention runs sequence-first ([T, B]) with a bidirectional mask, "
             "relative encodings and permutation masks built for the whole row"),
    _refused("LSHSelfAttention",
             "Reformer hashes the whole row into LSH buckets and sorts it, so samples share buckets"),
    _refused("LocalSelfAttention",
             "Reformer's local attention runs in fixed chunks of the row that also see the previous chunk"),
    _refused("DogeCDMoE",
             "Doge's MoE router splits the router logits of all the batch's tokens into two halves (view(2, B "
             "* T, -1)), so each token's experts depend on the other tokens of the batch, even in stock"),
    _refused("WhisperEncoder",
             "Whisper's encoder reads fixed 30-second log-mel windows (input_features) through a conv "
             "front-end, one window per row, not a row of tokens; packfree packs Whisper's decoder alone "
             "(WhisperForCausalLM)"),
    *(_refused(assistant,
               "Gemma 4's speculative-decoding assistant runs on its target model's hidden states (inputs_embeds) "
               "and attends bidirectionally to all of the target's keys and values (shared_kv_states): it has no "
               "row of tokens of its own and no keys and values per sample to keep apart")
      for assistant in ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")),
    # ================================================================ positions computed by the module itself
    (_FAIRSEQ_EMBEDDINGS, ClassEntry(numbering="after_padding_idx",
                                     notes="create_position_ids_from_input_ids: positions from padding_idx + 1")),
    (("MraEmbeddings", "NystromformerEmbeddings", "YosoEmbeddings"),
     ClassEntry(numbering="position_buffer", notes="number from their position_ids buffer, which starts at 2")),
    (_TABLE_EMBEDDINGS, ClassEntry(numbering="by_shape", notes="learned (BART-style, offset 2) and sinusoidal tables "
                                                               "indexed by the position in the input")),
    (("MobileBertEmbeddings", "TrOCRSinusoidalPositionalEmbedding"),
     ClassEntry(numbering="per_sample", notes="MobileBERT's trigram input mixes each token with its neighbours; TrOCR's "
                                              "sinusoidal positions count the non-padding tokens")),
    # ================================================================ seq2seq decoder inputs made by shifting
    (_DENOISING_MODELS, ClassEntry(shifted_decoder_input="input_ids", notes="BART's denoising default")),
    (_GENERATION_HEADS, ClassEntry(shifted_decoder_input="labels")),
    # ================================================================ attention adding a dense mask itself
    (("XGLMAttention", "TrOCRAttention", "MvpAttention"), ClassEntry(dense_mask=DenseMask("key_value_states"))),
    (("BigBirdPegasusEncoderAttention",), ClassEntry(dense_mask=DenseMask(), refused=Refusal(
        "its block-sparse attention (BigBird-Pegasus' choice for rows longer than (5 + 2 * num_random_blocks) "
        "* block_size tokens) attends random blocks anywhere in the row", on="packed_row",
        when=("attention_type", "block_sparse")))),
    (("BigBirdPegasusDecoderLayer",), ClassEntry(causal_self_attention="self_attn")),
    # ================================================================ attention over the whole row by own code
    (("LongT5LocalAttention",), ClassEntry(refused=Refusal(
        "its local attention (LongT5's encoder) scores fixed blocks of the whole row with a bias and mask of its own, "
        "so blocks straddle samples", on="packed_row"))),
    (("LongT5TransientGlobalAttention",), ClassEntry(refused=Refusal(
        "its transient-global attention (LongT5's encoder) lets every token read aggregates of fixed blocks "
        "of the whole row, so samples read each other", on="packed_row"))),
    # ================================================================ what attention layers pass
    (("T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention"), ClassEntry(
        relative_position_bias=True, notes="the bias depends only on the distance between query and key, so a packed "
                                           "sample's block equals the sample's own; zeros in cross-attention")),
    (("T5GemmaSelfAttention", "MuseGlimmerAssistantAttention"), ClassEntry(
        half_width_window=True, notes="stock's sdpa mask (create_bidirectional_sliding_window_mask) allows "
                                      "|i - j| <= w; the others pass flash's w + 1 (ModernBERT's sliding_window + 1)")),
    # ================================================================ what model code does with its masks
    (("MptConfig",), ClassEntry(tensor_mask=True, notes="MPT casts the mask to bool")),
    (("FalconConfig",), ClassEntry(tensor_mask="alibi", notes="Falcon folds its ALiBi bias into the mask")),
    (("Gemma4TextConfig", "Gemma4UnifiedTextConfig"), ClassEntry(
        slices_mask="num_kv_shared_layers",
        notes="mask[:, :, slice(-logits_to_keep, None), :] before its KV-shared layers")),
    # ================================================================ how image tensors are laid out
    (("Idefics2Config", "Idefics3Config", "SmolVLMConfig"), ClassEntry(images_per_row=True)),
    # ================================================================ multimodal RoPE numbered per packed sample
    (("Qwen2VLConfig", "Qwen2_5_VLConfig", "Qwen3VLConfig", "Qwen3VLMoeConfig", "Qwen3_5Config", "Qwen3_5MoeConfig",
      "Glm4vConfig"), ClassEntry(rope_per_sample=True, notes="compute_3d_position_ids calls get_rope_index alone")),
    # ================================================================ cache layers
    (("DummyLayer",), ClassEntry(stores_nothing=True, notes="transformers.cache_utils, transformers >= 5.2x")),
)
"""Class name (qualified by its model folder where shared) -> its entry. Modules and models are looked up by their
exact class (:func:`entry_of`); configs and cache layers along their class's MRO (:func:`inherited_entry`), so a
subclass of a listed config keeps its model's entry."""

_NONE = ClassEntry()
_MODELS = "transformers.models."


_QUALIFIED_NAMES: dict[type, str | None] = {}
"""Class -> its folder-qualified name (None outside transformers' model folders): worked out once per class, since
:func:`entry_of` runs in every layer of every decode step."""


def entry_of(cls: type) -> ClassEntry:
    """The entry of class ``cls``: by its folder-qualified name (``"openai.Attention"``), else its name (an entry with
    every field off where there is none)."""
    try:
        qualified_name = _QUALIFIED_NAMES[cls]
    except KeyError:
        module = cls.__module__
        qualified_name = _QUALIFIED_NAMES[cls] = (f"{module.rsplit('.', 2)[-2]}.{cls.__name__}"
                                                  if module.startswith(_MODELS) else None)
    if qualified_name is not None:
        qualified = CLASSES.get(qualified_name)
        if qualified is not None:
            return qualified
    return CLASSES.get(cls.__name__, _NONE)


def inherited_entry(instance: object) -> ClassEntry:
    """The entry of ``instance``'s class or the nearest of its bases listed in :data:`CLASSES`."""
    for cls in type(instance).__mro__:
        if cls.__name__ in CLASSES:
            return CLASSES[cls.__name__]
    return _NONE


def switched_on(value: bool | str, config: object) -> bool:
    """Whether a :class:`ClassEntry` field that is True, False or a config switch's name holds for ``config``."""
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def classes_with(field_name: str) -> frozenset[str]:
    """The class names whose entry sets ``field_name`` (for coverage checks and tests)."""
    return frozenset(name for name, entry in CLASSES.items()
                     if getattr(entry, field_name) != getattr(_NONE, field_name))


@functools.cache
@functools.cache
def stock_tables() -> dict[str, tuple[str, str]]:
    """Modeling module -> (its table of attention classes by implementation, the entry ``"packfree"`` gets)."""
    return {entry.stock_table.module: (entry.stock_table.table, entry.stock_table.implementation)
            for entry in CLASSES.values() if entry.stock_table is not None}
