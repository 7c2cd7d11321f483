"""What packfree knows about single transformers classes: one table, :data:`QUIRKS`, keyed by class name.

An entry names a class whose stock code does something on a packed row that packfree's generic path (boundaries as
the attention mask, per-sample ``position_ids``, routed mixers) would get wrong, and says what packfree does instead.
The class is a module (an embedding, an attention layer, a decoder layer), a model, or, for what a model decides from
its config, the config class. This file holds data only; each field is read by the layer that acts on it:

- ``numbering``: an embedding module that computes positions itself (:mod:`.adapters.positions`);
- ``shifted_decoder_input``: a seq2seq model that shifts this argument right into decoder inputs
  (:mod:`.adapters.decoder_inputs`);
- ``dense_mask``, ``causal_self_attention``: attention that adds ``attention_mask`` to its scores itself, and decoder
  layers whose self-attention does not say it is causal (:mod:`.adapters.dense_masks`);
- ``refused``: a layer that attends over the whole row by code of its own (:mod:`.adapters.whole_row`);
- ``relative_position_bias``, ``half_width_window``: attention layers that pass T5's relative bias, or their window as
  a half-width (:mod:`.attention.interface`; the bias is cut to the longest sample in :mod:`.adapters.whole_row`);
- ``tensor_mask``, ``slices_mask``: config classes whose model code works on the attention mask as a tensor, or
  indexes it (:mod:`.attention.masks`, :mod:`.unpacked`);
- ``images_per_row``: config classes whose image tensors are ``[B, images, ...]`` (:mod:`.packing.vision`).

A new quirk is one entry here (or one more field on an entry), and, for a new kind of quirk, one field read where
it acts. Sequence mixers are not quirks: they are the mixer registry (:mod:`.adapters.families`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["QUIRKS", "DenseMask", "Quirk", "classes_with", "config_quirk", "quirk_of",
           "switched_on"]

@dataclass(frozen=True)
class DenseMask:
    """An attention layer that adds ``attention_mask`` to its scores itself. ``cross_input``: the name of its
    cross-attention input (None: self-attention only). ``refused_when``: ``(attribute, value)`` under which the
    layer attends outside the mask (a packed row then raises ``ValueError`` with ``reason``)."""

    cross_input: str | None = None
    refused_when: tuple[str, Any] | None = None
    reason: str = ""


@dataclass(frozen=True)
class Quirk:
    """What one class does on a packed row that packfree must handle (every field but ``notes`` defaults to: no)."""

    numbering: str | None = None
    """Embedding module: the name of its rule in :data:`.adapters.positions.RULES` (``after_padding_idx``,
    ``position_buffer``, ``by_shape``, ``per_sample``)."""
    shifted_decoder_input: str | None = None
    """Seq2seq model: the argument its forward shifts right into ``decoder_input_ids`` when none are given."""
    dense_mask: DenseMask | None = None
    """Eager-only attention layer that adds ``attention_mask`` to its scores itself."""
    causal_self_attention: str | None = None
    """Decoder layer: the attribute holding its self-attention, which does not declare ``is_causal``."""
    refused: str | None = None
    """Layer that computes attention over the whole row by code of its own: why a packed row raises."""
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
    notes: str = ""


def _entries(*groups: tuple[Iterable[str], Quirk]) -> dict[str, Quirk]:
    """``(class names, quirk)`` groups as one table; a class named twice raises (one entry per class)."""
    table: dict[str, Quirk] = {}
    for names, quirk in groups:
        for name in names:
            if name in table:
                raise ValueError(f"{name} has two quirk entries; give it one with every field it needs")
            table[name] = quirk
    return table


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

QUIRKS: dict[str, Quirk] = _entries(
    # ---------------------------------------------------------------- positions computed by the module itself
    (_FAIRSEQ_EMBEDDINGS, Quirk(numbering="after_padding_idx",
                                notes="create_position_ids_from_input_ids: positions from padding_idx + 1")),
    (("MraEmbeddings", "NystromformerEmbeddings", "YosoEmbeddings"),
     Quirk(numbering="position_buffer", notes="number from their position_ids buffer, which starts at 2")),
    (_TABLE_EMBEDDINGS, Quirk(numbering="by_shape", notes="learned (BART-style, offset 2) and sinusoidal tables "
                                                          "indexed by the position in the input")),
    (("MobileBertEmbeddings", "TrOCRSinusoidalPositionalEmbedding"),
     Quirk(numbering="per_sample", notes="MobileBERT's trigram input mixes each token with its neighbours; TrOCR's "
                                         "sinusoidal positions count the non-padding tokens")),
    # ---------------------------------------------------------------- seq2seq decoder inputs made by shifting
    (_DENOISING_MODELS, Quirk(shifted_decoder_input="input_ids", notes="BART's denoising default")),
    (_GENERATION_HEADS, Quirk(shifted_decoder_input="labels")),
    # ---------------------------------------------------------------- attention adding a dense mask itself
    (("XGLMAttention", "TrOCRAttention", "MvpAttention"), Quirk(dense_mask=DenseMask("key_value_states"))),
    (("BigBirdPegasusEncoderAttention",), Quirk(dense_mask=DenseMask(
        refused_when=("attention_type", "block_sparse"),
        reason="its block-sparse attention (BigBird-Pegasus' choice for rows longer than (5 + 2 * num_random_blocks) "
               "* block_size tokens) attends random blocks anywhere in the row"))),
    (("BigBirdPegasusDecoderLayer",), Quirk(causal_self_attention="self_attn")),
    # ---------------------------------------------------------------- attention over the whole row by own code
    (("LongT5LocalAttention",), Quirk(refused="its local attention (LongT5's encoder) scores fixed blocks of the whole "
                                              "row with a bias and mask of its own, so blocks straddle samples")),
    (("LongT5TransientGlobalAttention",), Quirk(
        refused="its transient-global attention (LongT5's encoder) lets every token read aggregates of fixed blocks "
                "of the whole row, so samples read each other")),
    # ---------------------------------------------------------------- what attention layers pass
    (("T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention"), Quirk(
        relative_position_bias=True, notes="the bias depends only on the distance between query and key, so a packed "
                                           "sample's block equals the sample's own; zeros in cross-attention")),
    (("T5GemmaSelfAttention", "MuseGlimmerAssistantAttention"), Quirk(
        half_width_window=True, notes="stock's sdpa mask (create_bidirectional_sliding_window_mask) allows "
                                      "|i - j| <= w; the others pass flash's w + 1 (ModernBERT's sliding_window + 1)")),
    # ---------------------------------------------------------------- what model code does with its masks
    (("MptConfig",), Quirk(tensor_mask=True, notes="MPT casts the mask to bool")),
    (("FalconConfig",), Quirk(tensor_mask="alibi", notes="Falcon folds its ALiBi bias into the mask")),
    (("Gemma4TextConfig", "Gemma4UnifiedTextConfig"), Quirk(
        slices_mask="num_kv_shared_layers",
        notes="mask[:, :, slice(-logits_to_keep, None), :] before its KV-shared layers")),
    # ---------------------------------------------------------------- how image tensors are laid out
    (("Idefics2Config", "Idefics3Config", "SmolVLMConfig"), Quirk(images_per_row=True)),
)
"""Class name -> its quirk. Modules and models are looked up by their exact class; configs along their class's MRO
(:func:`config_quirk`), so a subclass of a listed config keeps its model's quirk."""

_NONE = Quirk()


def quirk_of(name: str) -> Quirk:
    """The quirk of the class called ``name`` (a quirk with every field off where there is none)."""
    return QUIRKS.get(name, _NONE)


def config_quirk(config: object) -> Quirk:
    """The quirk of ``config``'s class or the nearest of its bases listed in :data:`QUIRKS`."""
    for cls in type(config).__mro__:
        if cls.__name__ in QUIRKS:
            return QUIRKS[cls.__name__]
    return _NONE


def switched_on(value: bool | str, config: object) -> bool:
    """Whether a :class:`Quirk` field that is True, False or a config switch's name holds for ``config``."""
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def classes_with(field: str) -> frozenset[str]:
    """The class names whose quirk sets ``field`` (for coverage checks and tests)."""
    return frozenset(name for name, quirk in QUIRKS.items() if getattr(quirk, field) != getattr(_NONE, field))
