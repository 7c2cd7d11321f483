"""Per-segment positions: every packed sample is numbered the way the model numbers that sample alone (with its own
slice of the caller's ``position_ids``, where the caller passes them).

Most models read their positions from ``position_ids``, which packfree's boundaries restart in every sample.
Some compute positions themselves, and on a packed row they would number the whole row as one sequence. A
small registry of *position adapters*, keyed by the class of the embedding module, makes each such module
number every sample on its own while a packed row is in flight (:func:`packfree_plugin.context.boundaries_here`
with ``packed=True`` returns boundaries with more than one sample in some row). With one sample per row (unpacked, padded,
``generate()``, decoding) the module's own forward runs untouched. The numbering rules:

- ``after_padding_idx``: fairseq-style embeddings (RoBERTa and its copies): a sample's tokens are numbered
  ``padding_idx + 1, padding_idx + 2, ...`` (padding tokens get ``padding_idx``), as
  ``create_position_ids_from_input_ids`` numbers a lone sample (without the rule, positions would run on across
  samples).
- ``position_buffer``: embeddings that number a lone sample from their ``position_ids`` buffer (MRA's starts
  at 2): token ``t`` of a sample gets ``buffer[t]``.
- ``by_shape``: positional embeddings computed from the input's shape alone (BART-style learned tables with an
  offset, sinusoidal tables): the module runs once for the longest sample's shape, and every token takes the
  row of its position inside its sample. Rows longer than the table are fine as long as each sample fits.
- ``per_sample``: embeddings that mix neighbouring tokens (MobileBERT's trigram input concatenates the previous
  and next tokens' embeddings; TrOCR's sinusoidal positions count non-padding tokens): the module runs on each
  group of equal-length samples, so no sample sees another's tokens.

**The caller's ``position_ids`` win.** Where the caller passes ``position_ids``, the module reads them as stock does,
token by token (``per_sample`` embeddings: sample by sample, each with its slice), so every sample gets what it gets
alone called with its own slice of those ids (packed 0-based ids give a RoBERTa-style sample positions ``0, 1, ...``,
as stock does with them, and as transformers' padding-free tests expect). The rules above number a packed sample only
where no ids were passed (boundaries from ``cu_seq_lens`` or ``seq_idx`` alone; the ids packfree then hands the model,
``Boundaries.position_ids``, are its own and do not count as the caller's, nor do ids a model makes itself, such as
BART's decoder's ``0 .. T-1`` over the row: only the very tensor the caller passed,
:attr:`Boundaries.callers_position_ids`, does): each sample is numbered the way the model numbers a lone sample called
without ``position_ids``.

Seq2seq models that make their decoder inputs by shifting ``labels`` (or, BART's denoising default,
``input_ids``) right would shift a packed row as one sequence, so every sample but the first would start from
the previous sample's last token. :data:`SHIFTED_DECODER_INPUTS` lists the models whose forward does that; on a
packed row without ``decoder_input_ids`` packfree passes the model's own shift applied to each sample.

The same families hold eager-only attention layers that add ``attention_mask`` to their scores themselves
(XGLM, TrOCR, MVP, BigBird-Pegasus' encoder, :data:`DENSE_MASK_ATTENTION`): they cannot read packfree's
boundaries as their mask, so they get the block-diagonal additive mask of the packed samples (O(T^2) per row,
as stock's own), or, where the layer attends outside any mask (block-sparse attention), a ``ValueError``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..attention.interface import RELATIVE_POSITION_BIAS
from ..boundaries import Boundaries, Seq2SeqBoundaries
from ..context import boundaries_here
from .generic import run_unpacked
from ..model_entry import add_step
from ..signature import class_forward_parameters
from .instance import install, own_forward, own_parameters, uninstall
from .entry import additive_mask, register_by_class_name
from .numbering import Numbering, check_callers_ids, lone_sample_numbering, mark

__all__ = ["CAUSAL_SELF_ATTENTION", "DENSE_MASK_ATTENTION", "POSITION_ADAPTERS", "REFUSED_ON_PACKED_ROWS",
           "SHIFTED_DECODER_INPUTS", "DenseMaskAttention", "PositionAdapter", "dense_cross_mask",
           "numbering_of", "reads_boundaries_in_layers", "register_position_adapter", "unwrap_positions",
           "wrap_positions"]

_TAG = "position_"
"""Keeps these instance forwards apart from the mixers' (:mod:`.instance`)."""
_STOCK_IS_CAUSAL = "_packfree_stock_is_causal"

Rule = Callable[[nn.Module, Callable, Boundaries, dict[str, Any]], Any]
"""``(module, own_forward, boundaries, bound_arguments) -> output`` for a packed row."""


@dataclass(frozen=True)
class PositionAdapter:
    """How one family of embedding modules numbers each packed sample on its own.

    ``class_names``: the transformers embedding classes covered. ``numbering``: one of :data:`RULES`
    (``after_padding_idx``, ``position_buffer``, ``by_shape``, ``per_sample``; see the module docstring).
    """

    family: str
    class_names: tuple[str, ...]
    numbering: str
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.numbering not in RULES:
            raise ValueError(f"numbering must be one of {sorted(RULES)}, not {self.numbering!r}")


POSITION_ADAPTERS: dict[str, PositionAdapter] = {}
"""Embedding class name -> its position adapter."""


def register_position_adapter(adapter: PositionAdapter) -> PositionAdapter:
    return register_by_class_name(POSITION_ADAPTERS, adapter)


# ------------------------------------------------------------------------------------ numbering rules
def _count_in_sample(flags: torch.Tensor, boundaries: Boundaries) -> torch.Tensor:
    """``flags [B, T]`` bool -> ``[B, T]`` int64: how many flagged tokens the token's sample holds up to and
    including it (a cumulative sum that restarts at every segment)."""
    batch = flags.shape[0]
    local = boundaries.position_ids.to(flags.device)
    start = torch.arange(boundaries.seq_len, device=flags.device) - local  # column where each token's segment starts
    running = flags.long().cumsum(1)
    before = torch.cat([running.new_zeros(batch, 1), running], dim=1).gather(1, start)  # flagged before the segment
    return running - before


def _after_padding_idx(module: nn.Module, forward: Callable, boundaries: Boundaries,
                       arguments: dict[str, Any]) -> Any:
    input_ids = arguments.get("input_ids")
    if input_ids is not None:
        counted = input_ids != module.padding_idx
    else:
        counted = torch.ones(arguments["inputs_embeds"].shape[:2], dtype=torch.bool,
                             device=arguments["inputs_embeds"].device)
    arguments["position_ids"] = module.padding_idx + _count_in_sample(counted, boundaries) * counted
    return forward(**arguments)


def _position_buffer(module: nn.Module, forward: Callable, boundaries: Boundaries,
                     arguments: dict[str, Any]) -> Any:
    arguments["position_ids"] = module.position_ids[0][boundaries.position_ids.to(module.position_ids.device)]
    return forward(**arguments)


def _shrink(name: str, value: Any, boundaries: Boundaries, length: int) -> Any:
    """A per-token argument (``[B, T, ...]`` or ``[1, T, ...]`` tensor, ``[T]`` positions, a ``(B, T)`` shape)
    cut to one row of ``length`` tokens, ``position_ids`` made ``0 .. length-1`` (what the model passes for a
    lone sample; a packed row may carry the caller's ids); anything else unchanged."""
    seq_len = boundaries.seq_len
    if isinstance(value, torch.Tensor):
        if value.ndim >= 2 and value.shape[1] == seq_len and value.shape[0] in (1, boundaries.batch_size):
            value = value[:1, :length]
        elif _is_codebook_ids(value) and value.shape[2] == seq_len and value.shape[0] in (1, boundaries.batch_size):
            value = value[:1, :, :length]
        elif value.ndim == 1 and value.shape[0] == seq_len:
            value = value[:length]
        else:
            return value
        if name == "position_ids":
            value = torch.arange(length, device=value.device).view(value.shape)
        return value
    elif isinstance(value, tuple) and len(value) >= 2 and tuple(value[:2]) == (boundaries.batch_size, seq_len):
        return type(value)((1, length, *value[2:]))
    return value


def _by_shape(module: nn.Module, forward: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    longest = boundaries.max_seqlen
    table = forward(**{name: _shrink(name, value, boundaries, longest) for name, value in arguments.items()})
    table = table.reshape(longest, table.shape[-1])  # positions 0 .. longest-1 of one sample
    return table[boundaries.position_ids.to(table.device)]  # [B, T, D]


def _per_sample(module: nn.Module, forward: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    if not _callers_ids(arguments.get("position_ids"), boundaries):
        arguments.pop("position_ids", None)  # each sample numbered as the module numbers a lone sample
    # else the caller's ids are cut per sample below, with the tokens
    token_names = tuple(name for name, value in arguments.items()
                        if isinstance(value, torch.Tensor) and value.ndim >= 2)
    fixed = {name: value for name, value in arguments.items() if name not in token_names}

    def run(tokens: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return forward(**fixed, **dict(zip(token_names, tokens)))

    # max_waste=0: every group holds samples of one length, so no sample is padded and none sees padding
    return run_unpacked(run, tuple(arguments[name] for name in token_names), boundaries, max_waste=0.0)


RULES: dict[str, Rule] = {
    "after_padding_idx": _after_padding_idx,
    "position_buffer": _position_buffer,
    "by_shape": _by_shape,
    "per_sample": _per_sample,
}

# ------------------------------------------------------------------------------------------ entries
register_position_adapter(PositionAdapter("fairseq_positions", (
    "RobertaEmbeddings", "XLMRobertaEmbeddings", "CamembertEmbeddings", "Data2VecTextEmbeddings",
    "RobertaPreLayerNormEmbeddings", "XLMRobertaXLEmbeddings", "XmodEmbeddings", "IBertEmbeddings",
    "LukeEmbeddings", "MPNetEmbeddings", "Kosmos2_5TextSinusoidalPositionalEmbedding",
), "after_padding_idx", notes="create_position_ids_from_input_ids: positions from padding_idx + 1"))
register_position_adapter(PositionAdapter("buffer_positions", ("MraEmbeddings", "NystromformerEmbeddings",
                                                               "YosoEmbeddings"), "position_buffer",
                                          notes="MRA, Nystromformer and YOSO number from their position_ids buffer, "
                                                "which starts at 2"))
register_position_adapter(PositionAdapter("shape_positions", (
    "BartLearnedPositionalEmbedding", "MBartLearnedPositionalEmbedding", "PLBartLearnedPositionalEmbedding",
    "MvpLearnedPositionalEmbedding", "TrOCRLearnedPositionalEmbedding", "BigBirdPegasusLearnedPositionalEmbedding",
    "BlenderbotLearnedPositionalEmbedding", "BlenderbotSmallLearnedPositionalEmbedding",
    "MarianSinusoidalPositionalEmbedding", "PegasusSinusoidalPositionalEmbedding",
    "MusicgenSinusoidalPositionalEmbedding", "MusicgenMelodySinusoidalPositionalEmbedding",
    "WhisperPositionalEmbedding",
), "by_shape", notes="learned (BART-style, offset 2) and sinusoidal tables indexed by the position in the input"))
register_position_adapter(PositionAdapter("token_shift", ("MobileBertEmbeddings", "TrOCRSinusoidalPositionalEmbedding"),
                                          "per_sample",
                                          notes="MobileBERT's trigram input mixes each token with its neighbours; "
                                                "TrOCR's sinusoidal positions count the non-padding tokens"))

# ---------------------------------------------------------------------------------------- the wrapper
def _is_codebook_ids(value: torch.Tensor) -> bool:
    """``[B, codebooks, T]`` token ids (MusicGen's parallel audio-code streams)."""
    return value.ndim == 3 and not value.is_floating_point()


def _row_length(arguments: dict[str, Any]) -> int | None:
    """``T`` of the module's input: its first ``[B, T, ...]`` tensor, ``[B, codebooks, T]`` ids, ``(B, T)`` shape or
    ``[T]`` positions."""
    for value in arguments.values():
        if isinstance(value, torch.Tensor) and _is_codebook_ids(value):
            return int(value.shape[2])
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[1] if value.ndim >= 2 else value.shape[0])
        if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, int) for v in value[:2]):
            return int(value[1])
    return None


def _callers_ids(position_ids: Any, boundaries: Boundaries) -> bool:
    """Whether a module got the very ``position_ids`` tensor the caller passed (:attr:`Boundaries.callers_position_ids`):
    not the per-sample ids packfree's model hook passes when the batch carries none, and not ids the model makes
    itself (BART's decoder counts ``0 .. T-1`` over the row, whatever the caller passed), which stock reads for a lone
    sample too."""
    given = boundaries.callers_position_ids
    return isinstance(given, torch.Tensor) and position_ids is given


def _position_forward(module: nn.Module, *args, **kwargs):
    """The forward every covered embedding module gets, as ``functools.partial(_position_forward, module)``
    in its ``__dict__`` (picklable; a deep copy binds to the copy)."""
    forward = own_forward(module, tag=_TAG)
    parameters = own_parameters(module, tag=_TAG)
    arguments = parameters.bind(args, kwargs)
    length = _row_length(arguments)
    boundaries = boundaries_here(packed=True, length=length) if length is not None else None
    if boundaries is None:
        # one sample per row (the module numbers it as stock does), or not this forward's packed row (a nested
        # model's own inputs)
        return forward(*args, **kwargs)
    numbering = POSITION_ADAPTERS[type(module).__name__].numbering
    extra = arguments.pop(parameters.var_keyword, {}) if parameters.var_keyword else {}
    return _number(numbering, module, functools.partial(forward, **extra), boundaries, arguments)


@torch.compiler.disable  # the numbering follows the packing: compiled, every new packing would recompile
def _number(numbering: str, module: nn.Module, forward: Callable, boundaries: Boundaries,
            arguments: dict[str, Any]) -> Any:
    if numbering != "per_sample" and _callers_ids(arguments.get("position_ids"), boundaries):
        check_callers_ids(module, numbering, arguments["position_ids"], boundaries)  # 0-based ids on RoBERTa: said
        return forward(**arguments)  # read token by token: each sample takes its own slice of the caller's ids
    return RULES[numbering](module, forward, boundaries, arguments)


# ------------------------------------------------------------------------------- seq2seq decoder inputs
SHIFTED_DECODER_INPUTS: dict[str, str] = {
    **dict.fromkeys(("BartModel", "MBartModel", "PLBartModel", "MvpModel", "BigBirdPegasusModel"), "input_ids"),
    **dict.fromkeys(("BartForConditionalGeneration", "MBartForConditionalGeneration", "PLBartForConditionalGeneration",
                     "MvpForConditionalGeneration", "BigBirdPegasusForConditionalGeneration", "MarianMTModel",
                     "PegasusForConditionalGeneration", "BlenderbotForConditionalGeneration",
                     "BlenderbotSmallForConditionalGeneration", "T5ForConditionalGeneration",
                     "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration",
                     "LongT5ForConditionalGeneration"), "labels"),
}
"""Seq2seq models whose forward makes the decoder inputs by shifting an argument right (with their modeling
module's ``shift_tokens_right``, the T5 family with its ``_shift_right`` method) when no decoder inputs are given:
the base models shift ``input_ids`` (BART's denoising default), the generation heads their ``labels``."""


def _shift_per_sample(shift: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, boundaries: Boundaries,
                      pad_token_id: int) -> torch.Tensor:
    """``input_ids [B, T]`` -> ``[B, T]``: ``shift`` applied to each sample on its own. The packed row's shift is
    right everywhere but at each sample's first token, which gets column 0 of ``shift`` run on the samples
    right-padded with ``pad_token_id`` (what ``shift`` ignores when it looks for a sample's last token)."""
    shifted = shift(input_ids).reshape(-1).clone()
    samples = [(start, length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    total = boundaries.batch_size * boundaries.seq_len
    index = torch.full((len(samples), max(length for _, length in samples)), total, dtype=torch.long)
    for row, (start, length) in enumerate(samples):
        index[row, :length] = torch.arange(start, start + length)
    flat = torch.cat([input_ids.reshape(-1), input_ids.new_full((1,), pad_token_id)])
    firsts = shift(flat[index.to(flat.device)])[:, 0]
    shifted[torch.tensor([start for start, _ in samples], device=shifted.device)] = firsts
    return shifted.view_as(input_ids)


@torch.compiler.disable  # reads the packing on the host: a graph break, not a recompile per packing
def _decoder_inputs_step(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """On a packed row without decoder inputs, pass the per-sample shift of the argument the model would shift
    (:data:`SHIFTED_DECODER_INPUTS`) as ``decoder_input_ids`` (a step of the model's entry, run after it has pushed
    this forward's boundaries). ``labels`` are cut by the decoder's own boundaries where the batch has them
    (``decoder_position_ids``), else by the encoder's."""
    source_name = SHIFTED_DECODER_INPUTS[type(module).__name__]
    parameters = class_forward_parameters(type(module))
    arguments = parameters.bind((module, *args), kwargs)
    source = arguments.get(source_name)
    if (not isinstance(source, torch.Tensor) or source.ndim != 2
            or any(arguments.get(name) is not None for name in ("decoder_input_ids", "decoder_inputs_embeds"))):
        return None
    pairing = Seq2SeqBoundaries.of(boundaries_here())
    if pairing is not None and source_name == "labels":  # labels are the decoder's rows, cut by its own boundaries
        decoder = pairing.decoder
        boundaries = decoder if decoder.is_packed and decoder.describes(*source.shape) else None
    else:
        boundaries = boundaries_here(rows=source, packed=True)
    if boundaries is None:
        return None
    decoder_input_ids = _shift_per_sample(_model_shift(module), source, boundaries, module.config.pad_token_id)
    index = parameters.names.index("decoder_input_ids") - 1  # without self
    if index < len(args):
        args = (*args[:index], decoder_input_ids, *args[index + 1:])
    else:
        kwargs = {**kwargs, "decoder_input_ids": decoder_input_ids}
    return args, kwargs


def _model_shift(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids [B, T] -> [B, T]``: the shift right ``module``'s forward applies to make its decoder inputs."""
    shift = getattr(sys.modules[type(module).__module__], "shift_tokens_right", None)
    if shift is None:  # the T5 family: a method reading its config
        return module._shift_right
    config = module.config
    options = {"decoder_start_token_id": config.decoder_start_token_id} if _takes_start_token(shift) else {}
    return functools.partial(shift, pad_token_id=config.pad_token_id, **options)


@functools.cache
def _takes_start_token(shift: Callable) -> bool:
    """Whether a modeling module's ``shift_tokens_right`` takes ``decoder_start_token_id`` (read once per module)."""
    return "decoder_start_token_id" in inspect.signature(shift).parameters


# ------------------------------------------------------------------ attention that adds a dense mask itself
@dataclass(frozen=True)
class DenseMaskAttention:
    """An attention layer that adds ``attention_mask`` to its scores itself. ``cross_input``: the name of its
    cross-attention input (None: self-attention only). ``refused_when``: ``(attribute, value)`` under which the
    layer attends outside the mask (a packed row then raises ``ValueError`` with ``reason``)."""

    cross_input: str | None = None
    refused_when: tuple[str, Any] | None = None
    reason: str = ""


DENSE_MASK_ATTENTION: dict[str, DenseMaskAttention] = {
    "XGLMAttention": DenseMaskAttention("key_value_states"),
    "TrOCRAttention": DenseMaskAttention("key_value_states"),
    "MvpAttention": DenseMaskAttention("key_value_states"),
    "BigBirdPegasusEncoderAttention": DenseMaskAttention(
        refused_when=("attention_type", "block_sparse"),
        reason="its block-sparse attention (BigBird-Pegasus' choice for rows longer than (5 + 2 * num_random_blocks) "
               "* block_size tokens) attends random blocks anywhere in the row"),
}
"""Eager-only attention layers of these families (they never call transformers' attention interface), so they
cannot take packfree's boundaries as their mask."""

CAUSAL_SELF_ATTENTION: dict[str, str] = {"BigBirdPegasusDecoderLayer": "self_attn"}
"""Decoder layers whose self-attention does not declare ``is_causal`` (stock relies on the causal mask, which
packfree's boundaries replace): the attribute holding it, marked causal."""


@torch.compiler.disable  # built from the host offsets of each packing
def dense_additive_mask(boundaries: Boundaries, *, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, T, T]`` additive mask of ``boundaries``: 0 where a query may attend (same segment; and not a later
    key when ``causal``), the dtype's minimum elsewhere, as transformers' eager masks. O(T^2) per row."""
    segment = boundaries.seq_idx
    allowed = segment[:, :, None] == segment[:, None, :]
    if causal:
        allowed = allowed & torch.ones_like(allowed[0], dtype=torch.bool).tril()
    return additive_mask(allowed, dtype)[:, None]


@torch.compiler.disable  # built from the host offsets of each packing
def dense_cross_mask(pairing: Seq2SeqBoundaries, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, Td, Te]`` additive mask: 0 where a decoder token's own encoder sample is, the dtype's minimum elsewhere
    (a padding query sees nothing). O(Td x Te) per row: for models that add the mask to their scores themselves."""
    decoder, encoder = pairing.decoder, pairing.encoder
    reads = torch.full((decoder.batch_size * decoder.seq_len,), -1, dtype=torch.long)
    source = torch.full((encoder.batch_size * encoder.seq_len,), -2, dtype=torch.long)
    for index, (decoder_start, decoder_length, encoder_start, encoder_length) in enumerate(pairing.pairs):
        reads[decoder_start:decoder_start + decoder_length] = index
        source[encoder_start:encoder_start + encoder_length] = index
    allowed = reads.view(decoder.batch_size, decoder.seq_len, 1) == source.view(encoder.batch_size, 1, encoder.seq_len)
    return additive_mask(allowed, dtype)[:, None].to(decoder.device)


def _dense_mask_forward(module: nn.Module, *args, **kwargs):
    """Such a layer's forward with the mask it expects: packfree's boundaries (training, scoring, prefill) as the
    block-diagonal additive mask of their segments; transformers' boolean ``sdpa`` mask (decoding) as additive."""
    entry = DENSE_MASK_ATTENTION[type(module).__name__]
    parameters = own_parameters(module, tag=_TAG)
    arguments = parameters.bind(args, kwargs)
    hidden = arguments["hidden_states"]
    encoder = arguments.get(entry.cross_input) if entry.cross_input else None
    mask_name = "encoder_attention_mask" if encoder is not None and "encoder_attention_mask" in parameters.names \
        else "attention_mask"
    mask = arguments.get(mask_name)
    enclosing = boundaries_here(rows=hidden, packed=True)
    packed = enclosing is not None
    if packed and entry.refused_when is not None and getattr(module, entry.refused_when[0]) == entry.refused_when[1]:
        raise ValueError(f"packfree cannot run {type(module).__name__} on a packed row: {entry.reason}. Pass one "
                         "sample per row for this model, or shorter packed rows")
    if mask is None and packed:
        # these models pass no mask where a lone sample needs none (an encoder without padding, cross-attention
        # without an encoder mask): on a packed row the boundaries are the mask
        if encoder is not None and encoder.shape[1] != hidden.shape[1]:
            raise ValueError(
                f"{type(module).__name__}: cross-attention from a packed row of {hidden.shape[1]} tokens to encoder "
                f"states of {encoder.shape[1]}; packfree cannot tell which encoder sample each decoder sample reads. "
                "Pass one sample per row for this model"
            )
        mask = enclosing
    if isinstance(mask, Seq2SeqBoundaries):
        arguments[mask_name] = dense_cross_mask(mask, hidden.dtype)
    elif isinstance(mask, Boundaries):
        causal = bool(getattr(module, "is_decoder", False)) and encoder is None
        arguments[mask_name] = dense_additive_mask(mask, causal=causal, dtype=hidden.dtype)
    elif isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        arguments[mask_name] = additive_mask(mask, hidden.dtype)
    extra = arguments.pop(parameters.var_keyword, {}) if parameters.var_keyword else {}
    return own_forward(module, tag=_TAG)(**arguments, **extra)


REFUSED_ON_PACKED_ROWS: dict[str, str] = {
    "LongT5LocalAttention": "its local attention (LongT5's encoder) scores fixed blocks of the whole row with a bias "
                            "and mask of its own, so blocks straddle samples",
    "LongT5TransientGlobalAttention": "its transient-global attention (LongT5's encoder) lets every token read "
                                      "aggregates of fixed blocks of the whole row, so samples read each other",
}
"""Layers that compute attention over the whole row by code of their own, which packfree cannot cut into samples:
a packed row raises ``ValueError`` with the reason; one sample per row runs them untouched."""


def _refused_forward(module: nn.Module, *args, **kwargs):
    """A :data:`REFUSED_ON_PACKED_ROWS` layer's forward: its own, unless a packed row is in flight."""
    if boundaries_here(packed=True) is not None:
        name = type(module).__name__
        raise ValueError(f"packfree cannot run {name} on a packed row: {REFUSED_ON_PACKED_ROWS[name]}. Pass one sample "
                         "per row for this model")
    return own_forward(module, tag=_TAG)(*args, **kwargs)


def _sample_bias(module: nn.Module, query_length: int, key_length: int, device: torch.device | None = None,
                 past_seen_tokens: int = 0) -> torch.Tensor:
    """T5's ``compute_bias`` (installed on the instance of every layer of
    :data:`~packfree_plugin.attention.interface.RELATIVE_POSITION_BIAS` that owns a bias): on a packed row, the bias of
    the longest sample, ``[1, H, L, L]`` instead of ``[1, H, T, T]``; the bias is relative, so every sample's is its
    top-left corner, which packfree's attention takes. Elsewhere the class's own."""
    boundaries = boundaries_here(packed=True, length=query_length) if past_seen_tokens == 0 else None
    if boundaries is not None and key_length == query_length:
        query_length = key_length = boundaries.max_seqlen
    return type(module).compute_bias(module, query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)


def reads_boundaries_in_layers(model: nn.Module) -> bool:
    """Whether a layer of ``model`` computes a T5-style relative bias (:func:`_sample_bias`), which reads this forward's
    boundaries inside the decoder layer: the layer then needs packfree's layer hooks, whose checkpoint wrapper hands
    the same boundaries to backward's recomputation."""
    return any(type(module).__name__ in RELATIVE_POSITION_BIAS and getattr(module, "has_relative_attention_bias", False)
               for module in model.modules())


def _replacement(name: str) -> Callable | None:
    """The instance forward packfree gives a module of class ``name`` (None: its own), read from the tables when
    a model is prepared, so adapters registered later count."""
    if name in POSITION_ADAPTERS:
        return _position_forward
    if name in REFUSED_ON_PACKED_ROWS:
        return _refused_forward
    return _dense_mask_forward if name in DENSE_MASK_ATTENTION else None


def wrap_positions(model: nn.Module) -> list[str]:
    """Give every covered embedding module of ``model`` its per-sample numbering, every layer of
    :data:`DENSE_MASK_ATTENTION` the mask it can read (or a refusal), every self-attention of
    :data:`CAUSAL_SELF_ATTENTION` ``is_causal``, every model of :data:`SHIFTED_DECODER_INPUTS` its
    per-sample decoder inputs, and every T5-style layer that owns a relative bias its per-sample bias
    (idempotent). Returns the wrapped paths."""
    wrapped = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in CAUSAL_SELF_ATTENTION:
            attention = module.get_submodule(CAUSAL_SELF_ATTENTION[name])
            if _STOCK_IS_CAUSAL not in attention.__dict__:
                attention.__dict__[_STOCK_IS_CAUSAL] = attention.__dict__.get("is_causal")
            attention.is_causal = True
        if name in RELATIVE_POSITION_BIAS and getattr(module, "has_relative_attention_bias", False):
            module.compute_bias = functools.partial(_sample_bias, module)
        if name in SHIFTED_DECODER_INPUTS:
            add_step(module, _decoder_inputs_step)
        replacement = _replacement(name)
        if replacement is None:
            continue
        install(module, replacement, tag=_TAG)
        if name in POSITION_ADAPTERS:
            mark(module, model, path)
        wrapped.append(path)
    return wrapped


def numbering_of(model: nn.Module) -> Numbering:
    """How ``model`` numbers a lone sample called without ``position_ids``: from where its first position module
    of :data:`POSITION_ADAPTERS` that does not start at 0 starts (RoBERTa: ``padding_idx + 1``), else from 0 where
    the model takes ``position_ids``, else not by ids."""
    for path, module in model.named_modules():
        adapter = POSITION_ADAPTERS.get(type(module).__name__)
        if adapter is not None:
            numbering = lone_sample_numbering(module, adapter.numbering, path)
            if numbering.start:
                return numbering
    return Numbering(0 if "position_ids" in inspect.signature(type(model).forward).parameters else None)


def unwrap_positions(model: nn.Module) -> None:
    """Undo :func:`wrap_positions` on ``model`` (the decoder-input steps go with the model entries)."""
    for module in model.modules():
        replacement = _replacement(type(module).__name__)
        if replacement is not None:
            uninstall(module, replacement, tag=_TAG)
        compute_bias = module.__dict__.get("compute_bias")
        if isinstance(compute_bias, functools.partial) and compute_bias.func is _sample_bias:
            del module.__dict__["compute_bias"]
        if _STOCK_IS_CAUSAL in module.__dict__:
            stock = module.__dict__.pop(_STOCK_IS_CAUSAL)
            if stock is None:
                del module.__dict__["is_causal"]
            else:
                module.is_causal = stock
