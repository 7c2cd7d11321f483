"""The per-forward context: the one place that reads a batch and decides its :class:`Boundaries`, and the
one per-thread stack from which every consumer that transformers' ``**kwargs`` do not reach reads them.

How boundaries flow through one forward (docs/how-it-works.md draws the same picture)::

    model(**batch) or model.forward(**batch)
      model_entry ............ the model's instance forward: enter_model reads the batch once (_read_batch ->
      |                        boundaries_for_call), pushes the Boundaries, adds packfree_boundaries= to the
      |                        call's **kwargs; then the entry's steps and the model's own forward
      |- mask function ....... attention.interface.packfree_attention_mask returns boundaries_here(rows=(B, T))
      |- attention ........... attention.interface.packfree_attention_forward gets it as attention_mask
      |- decoder layer ....... _layer_pre_hook pushes boundaries_here(kwargs) for the mixers inside
      |   |- mixer ........... adapters.mixers._mixer_forward: boundaries_here(kwargs, rows=hidden)
      |   |   |- native tier . adapters.routes.native_forward pushes a NativeCall; each routed kernel
      |   |                    reads native_call() and runs the packfree op with its boundaries
      |   |- checkpointing ... _carry_through_checkpoint re-pushes them when backward recomputes the layer
      leave_model ............ pops

Nested models (a backbone inside ``...ForCausalLM``) take the enclosing model's boundaries through their
kwargs, or from the stack when they are called with the same tokens and ``use_cache=False``; only the
outermost entry reads the batch, a graph break at the very start of a compiled forward. A nested model
whose inputs are its own (a vision tower, a seq2seq decoder) reads its own boundaries, or has none. An
encoder-decoder's entry also reads the decoder's boundaries (``decoder_position_ids``) and pairs them with the
encoder's (:class:`~packfree_plugin.boundaries.Seq2SeqBoundaries`); its decoder then runs on those. A caller who builds
the boundaries ahead and passes ``packfree_boundaries`` gets no break at all (``fullgraph=True``).

Caches. Boundaries are built only while the cache holds nothing (training, scoring, prefill). A cache
filled from a packed row would mix samples' keys, so for a packed batch packfree turns ``use_cache`` off
(the model returns no cache) and refuses a cache object passed in explicitly. Once a cache holds tokens
(decoding), a packed batch is refused and unpacked calls follow transformers' own masks.

The stack lives on a ``threading.local`` rather than in a ``ContextVar``: Dynamo traces reads and pushes
of the former and breaks the graph on the latter, and these reads happen in every layer.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

from .boundaries import Boundaries, Seq2SeqBoundaries
from .unpacked import PACKING_KWARGS, carries_packing_signal, has_holes, reads_as_one_sample_per_row
from .torch_cp import refuse_packed_rows_under_context_parallel

__all__ = [
    "DECODER_POSITION_IDS",
    "ForwardParameters",
    "NativeCall",
    "VISUAL_TOKEN_KEYS",
    "boundaries_for_call",
    "boundaries_here",
    "class_forward_parameters",
    "enter_model",
    "enter_native",
    "exit_native",
    "hook_layers",
    "in_prepared_forward",
    "is_prepared",
    "leave_model",
    "mark_prepared",
    "native_call",
    "tensor_leaves",
    "unhook_layers",
    "without_cache",
]

_HANDLES_ATTR = "_packfree_layer_hook_handles"
_CARRIES_ATTR = "_packfree_carries_boundaries"
_LAYERS_ATTR = "_packfree_hooked_layers"
_CACHE_NAMES = ("cache", "past_key_values", "cache_params", "state")  # "state": RWKV


class NativeCall:
    """One native-tier mixer call in progress: its boundaries, and how many kernel calls it routed."""

    def __init__(self, boundaries: Boundaries, layer_name: str) -> None:
        self.boundaries = boundaries
        self.layer_name = layer_name
        self.routed = 0


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.items: list[Boundaries | NativeCall | None] = []


_STACK = _PerThread()
"""The one per-thread stack: the boundaries of the model forward, decoder layer or native mixer call in
progress (None: a call that packs nothing, e.g. decoding)."""


def _top() -> Boundaries | NativeCall | None:
    items = _STACK.items
    return items[-1] if items else None


def _push(entry: Boundaries | NativeCall | None) -> None:
    _STACK.items.append(entry)


def _pop() -> None:
    _STACK.items.pop()


def _current() -> Boundaries | None:
    """The boundaries in effect on this thread (None outside a packfree forward, or while decoding)."""
    top = _top()
    return top.boundaries if isinstance(top, NativeCall) else top


def in_prepared_forward() -> bool:
    """Whether a forward of a model prepared by packfree is in progress on this thread (its entry pushed one,
    None included: a decoding step)."""
    return bool(_STACK.items)


_PREPARED_ATTR = "_packfree_prepared"


def mark_prepared(model: nn.Module) -> None:
    """Mark every module of ``model`` as part of a model packfree prepared (copies and pickles keep the mark)."""
    for module in model.modules():
        module.__dict__[_PREPARED_ATTR] = True


def is_prepared(module: nn.Module) -> bool:
    """Whether ``module`` belongs to a model packfree prepared (:func:`mark_prepared`)."""
    return module.__dict__.get(_PREPARED_ATTR, False)


_ANY_ROWS = object()


def boundaries_here(kwargs: dict[str, Any] | None = None, *, rows: Any = _ANY_ROWS, length: int | None = None,
                    packed: bool = False) -> Boundaries | None:
    """The boundaries of the rows a consumer (a layer, head, position module, mask or attention function) works on,
    or None: the one reader of boundaries outside this module.

    They are the ``packfree_boundaries`` transformers forwarded through the consumer's ``**kwargs`` when given,
    else the entry on this thread's stack (the model forward, decoder layer or native call in progress), and they
    count only where they are the consumer's own: ``rows`` (``[B, T, ...]`` token rows, or a ``(B, T)`` pair; never
    a 2-D float tensor, a tower's ``[N, D]`` patches) must be rows they describe, ``length`` their ``T``, and
    with ``packed`` they must hold several samples in some row."""
    given = kwargs.get("packfree_boundaries") if kwargs else None
    boundaries = given if given is not None else _current()
    if boundaries is None or (packed and not boundaries.is_packed):
        return None
    if length is not None and length != boundaries.seq_len:
        return None
    if rows is not _ANY_ROWS and not _fits(boundaries, rows):
        return None
    return boundaries


def native_call() -> NativeCall | None:
    """The native mixer call in progress on this thread, if the innermost entry is one."""
    top = _top()
    return top if isinstance(top, NativeCall) else None


def enter_native(boundaries: Boundaries, layer_name: str) -> NativeCall:
    """Start a native mixer call (pair with :func:`exit_native` in a ``finally``)."""
    call = NativeCall(boundaries, layer_name)
    _push(call)
    return call


def exit_native() -> None:
    _pop()


# ------------------------------------------------------------------------------ reading the batch
@dataclass(frozen=True)
class ForwardParameters:
    """A forward's parameters, read once per class (or instance forward), so that binding a call is plain dict
    work, which torch.compile traces (``inspect`` is not traceable). Used for models here and for mixers in
    :mod:`.adapters.mixers`."""

    names: tuple[str, ...]
    """Named parameters, in order."""
    positional: int
    """How many of ``names`` positional arguments can fill (the rest are keyword-only)."""
    var_keyword: str | None
    """Name of the ``**kwargs`` parameter, None without one."""

    @classmethod
    def of(cls, forward: Callable) -> ForwardParameters:
        parameters = inspect.signature(forward).parameters.values()
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = tuple(p.name for p in parameters if p.kind in by_position)
        keyword_only = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
        var_keyword = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        return cls(positional + keyword_only, len(positional), var_keyword)

    def accepts(self, name: str) -> bool:
        return name in self.names or self.var_keyword is not None

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Like ``inspect.Signature.bind(*args, **kwargs).arguments``: named arguments, and the rest of the keywords
        under the ``**kwargs`` parameter's name."""
        if len(args) > self.positional:
            raise TypeError(f"too many positional arguments: {len(args)} for {list(self.names[:self.positional])}")
        arguments = dict(zip(self.names, args))
        extra = {}
        for name, value in kwargs.items():
            if name in arguments:
                raise TypeError(f"multiple values for argument {name!r}")
            if name in self.names:
                arguments[name] = value
            elif self.var_keyword is not None:
                extra[name] = value
            else:
                raise TypeError(f"unexpected keyword argument {name!r}")
        if extra:
            arguments[self.var_keyword] = extra
        return arguments


def without_cache(parameters: ForwardParameters, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A call's ``args`` (``self`` not among them) and ``kwargs`` with ``use_cache=False``, where the caller passed it
    (positionally or by keyword); unchanged for a forward with neither a ``use_cache`` parameter nor ``**kwargs``."""
    if "use_cache" in parameters.names:
        index = parameters.names.index("use_cache") - 1  # without self
        if index < len(args):
            return (*args[:index], False, *args[index + 1:]), kwargs
    if "use_cache" in parameters.names or parameters.var_keyword is not None:
        return args, {**kwargs, "use_cache": False}
    return args, kwargs


@cache
def class_forward_parameters(cls: type) -> ForwardParameters:
    """Parameters of ``cls.forward``, ``self`` included; read once per class."""
    return ForwardParameters.of(cls.forward)


def _tokens(arguments: dict[str, Any]) -> Any:
    """The call's ``input_ids``, else its ``inputs_embeds`` (``[B, T, ...]``), else None."""
    tokens = arguments.get("input_ids")
    return tokens if tokens is not None else arguments.get("inputs_embeds")


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a tree of tuples, lists and dicts, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in tensor_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tensor_leaves(item)]
    return []


def _cache_holds_tokens(past: Any) -> bool:
    """Whether a cache object already holds state from earlier tokens, read from its layers' real state
    (attention layers: a sequence length; linear-attention layers: their conv/recurrent states)."""
    if past is None:
        return False
    from transformers import cache_utils
    from transformers.cache_utils import Cache, EncoderDecoderCache, LinearAttentionCacheLayerMixin

    # a layer that stores nothing (MLP / MoE-only layers of hybrids such as NemotronH; transformers >= 5.2x)
    stateless = getattr(cache_utils, "DummyLayer", ())
    if isinstance(past, EncoderDecoderCache):  # a seq2seq decoder: its own self-attention cache is what it continues
        past = past.self_attention_cache
    if isinstance(past, Cache):
        for layer in past.layers:
            if isinstance(layer, stateless):
                continue
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                if any(layer.has_previous_state.values()):
                    return True
            elif layer.get_seq_length() > 0:
                return True
        return False
    if isinstance(past, (list, tuple)):  # legacy tuples, RWKV's state list
        return any(t.numel() > 0 for t in tensor_leaves(past))
    seq_length = getattr(past, "get_seq_length", None)
    if callable(seq_length):
        return seq_length() > 0
    return True  # an unknown cache type: assume it holds tokens, so a packed batch is refused, never mixed


def _packing_signs(arguments: dict[str, Any]) -> list[str]:
    """What in a call says its rows are packed: boundary kwargs, or 2-D ``position_ids`` that restart at 0 after
    a row's first token (read before the boundaries, where they cannot be built: a filled cache, a 4-D mask)."""
    signs = [name for name in PACKING_KWARGS if arguments.get(name) is not None]
    position_ids = arguments.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2 and bool((position_ids[:, 1:] == 0).any()):
        signs.append("position_ids restarting at 0")
    return signs


def boundaries_for_call(arguments: dict[str, Any], *, causal_labels: bool = True) -> Boundaries | None:
    """Boundaries for one forward's bound ``arguments`` (``**kwargs`` merged in), or None when decoding.
    ``causal_labels``: ``labels`` are the row's own tokens shifted inside the loss (a causal LM), so a packed row's
    must be -100 at every sample's first token; a seq2seq model's labels are its decoder's targets instead."""
    tokens = _tokens(arguments)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return None
    batch_size, seq_len = tokens.shape[0], tokens.shape[1]
    if batch_size == 0 or seq_len == 0:
        return None  # no tokens, nothing to keep apart: the model runs as stock
    past = next((arguments[name] for name in _CACHE_NAMES if arguments.get(name) is not None), None)
    if _cache_holds_tokens(past):
        given = _packing_signs(arguments)
        if given:
            raise ValueError(
                f"a packed batch ({', '.join(given)}) was passed together with a cache that already holds tokens; "
                "packed rows cannot continue a cached sequence"
            )
        return None
    attention_mask = arguments.get("attention_mask")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        packing = _packing_signs(arguments)
        if packing:
            raise ValueError(
                f"a {attention_mask.ndim}-D attention_mask was passed with a packed batch ({', '.join(packing)}); "
                "packfree reads boundaries from a 2-D padding mask or none. Drop the mask (the packed boundaries "
                "already keep samples apart) or pass the [B, T] padding mask"
            )
        return None  # an unpacked call with a prepared mask of the caller's own: transformers uses it as is
    if reads_as_one_sample_per_row(arguments):
        if has_holes(attention_mask):
            return None  # one sample per row with zeros inside it: stock's own mask, in attention and every mixer
        arguments = {**arguments, "position_ids": None}  # ids that never restart only number positions, as in stock
    boundaries = Boundaries.from_model_inputs(
        batch_size=batch_size,
        seq_len=seq_len,
        device=tokens.device,
        cu_seq_lens_q=arguments.get("cu_seq_lens_q"),
        cu_seq_lens_k=arguments.get("cu_seq_lens_k"),
        max_length_q=arguments.get("max_length_q"),
        max_length_k=arguments.get("max_length_k"),
        seq_idx=arguments.get("seq_idx"),
        position_ids=arguments.get("position_ids"),
        attention_mask=attention_mask,
    )
    if boundaries.is_packed and past is not None:
        raise ValueError(
            "a cache object was passed with a packed batch; a cache built from a packed row would mix samples. "
            "Call the model without `cache`/`past_key_values` for packed rows"
        )
    if boundaries.is_packed and causal_labels:
        _check_labels(arguments.get("labels"), boundaries)
    return boundaries


def _check_labels(labels: Any, boundaries: Boundaries) -> None:
    """The label contract of a packed row: ``labels [B, T]`` hold -100 at every sample's first token, because the
    loss predicts token t from token t-1, which for a sample's first token is the previous sample's last."""
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or tuple(labels.shape) != (boundaries.batch_size,
                                                                                           boundaries.seq_len):
        return
    starts = [start for start, pad in zip(boundaries.offsets[:-1], boundaries.padding)
              if not pad and start % boundaries.seq_len]
    if not starts:
        return
    at_starts = labels.reshape(-1)[torch.tensor(starts, device=labels.device)].tolist()
    crossing = [start for start, label in zip(starts, at_starts) if label != -100]
    if crossing:
        token = crossing[0]
        raise ValueError(
            f"labels at the first token of a packed sample (row {token // boundaries.seq_len}, token "
            f"{token % boundaries.seq_len}) are {at_starts[starts.index(token)]}, not -100: the loss would train the "
            "previous sample's last token to predict this sample's first. Set -100 there, as "
            "DataCollatorWithFlattening and TRL's padding-free collator do"
        )


# ------------------------------------------------------------------------------------ model entry
def enter_model(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Push this forward's boundaries (exactly one entry when it returns, none when it raises; pair it with
    :func:`leave_model`) and return the call's arguments as the model's forward must see them. Run by every prepared
    model's forward (:mod:`.model_entry`). Traced by torch.compile, without reading the batch: boundaries passed
    as ``packfree_boundaries`` (by a parent model through its ``**kwargs``, or built ahead by the caller),
    or the parent's, for a backbone called with the same tokens and ``use_cache=False`` but no kwargs
    (Mamba's heads). Anything else reads the batch (:func:`_read_batch`, one graph break when compiled)."""
    if isinstance(kwargs.get("attention_mask"), Boundaries):
        # an outer model built packfree's mask and hands it to its inner model (PaliGemma to its Gemma): the inner
        # model takes it as its boundaries and makes its own mask from them (transformers' mask helpers read an
        # attention_mask as a tensor)
        mask = kwargs["attention_mask"]
        kwargs = {**kwargs, "attention_mask": None}
        if class_forward_parameters(type(module)).var_keyword is None:
            _check_given(mask, _call_tokens(args, kwargs))
            _push(mask)
            return args, kwargs
        kwargs.setdefault("packfree_boundaries", mask)
    boundaries = kwargs.get("packfree_boundaries")
    if boundaries is not None:
        tokens = _call_tokens(args, kwargs)
        if _STACK.items and isinstance(boundaries, Boundaries) and not _inherits(boundaries, tokens, kwargs):
            # a nested model with inputs of its own (a vision tower, a seq2seq decoder) got its parent's
            # boundaries through the **kwargs: it gets boundaries from its own inputs, or none
            kwargs = {name: value for name, value in kwargs.items() if name != "packfree_boundaries"}
            return _read_batch(module, args, kwargs)
        _check_given(boundaries, tokens)
        if not _STACK.items:  # built ahead by the caller, whose ids these are
            boundaries.callers_position_ids = kwargs.get("position_ids")
        _push(boundaries)
        return args, kwargs
    boundaries = _parent_boundaries(args, kwargs)
    if boundaries is None:
        return _read_batch(module, args, kwargs)
    _push(boundaries)
    return args, kwargs


def leave_model() -> None:
    """Pop what :func:`enter_model` pushed."""
    _pop()


def _call_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The call's ``input_ids``, else ``inputs_embeds``, else its first positional argument, if ``[B, T, ...]``."""
    tokens = _tokens(kwargs)
    if tokens is None and args:
        tokens = args[0]
    return tokens if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 else None


def _fits(boundaries: Boundaries, tokens: Any) -> bool:
    """Whether ``tokens`` is a row of tokens that ``boundaries`` describe: a ``(B, T)`` pair, ``[B, T]`` ids or ``[B, T, D]``
    embeddings. A 2-D float tensor is a tower's ``[N, D]`` patches or frames, never a row, even where its shape
    happens to equal the text rows' (16 Qwen-VL patches of 1176 values against 16 rows of 1176 tokens)."""
    if isinstance(tokens, tuple) and len(tokens) == 2:
        return boundaries.describes(*tokens)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2 or (tokens.ndim == 2 and tokens.is_floating_point()):
        return False
    return boundaries.describes(*tokens.shape[:2])


def _inherits(boundaries: Boundaries, tokens: Any, arguments: dict[str, Any]) -> bool:
    """Whether a nested model called with ``tokens`` and ``arguments`` runs on its enclosing model's ``boundaries``:
    they must fit its tokens, and a seq2seq decoder (called with ``encoder_hidden_states``) takes them only when they
    pack samples. The encoder's padding is not the decoder's: stock decoders mask by their own
    ``decoder_attention_mask``, or causally alone."""
    if not _fits(boundaries, tokens):
        return False
    if arguments.get("encoder_hidden_states") is not None and Seq2SeqBoundaries.of(boundaries) is not None:
        return False  # the decoder of a seq2seq forward whose decoder rows have boundaries of their own
    return boundaries.is_packed or arguments.get("encoder_hidden_states") is None


def _check_given(boundaries: Any, tokens: torch.Tensor | None) -> None:
    """``packfree_boundaries`` passed to a model (by its parent, or by a caller who built them ahead, e.g. for
    ``torch.compile(fullgraph=True)``) must be a :class:`Boundaries` for the call's tokens."""
    if not isinstance(boundaries, Boundaries):
        raise ValueError(f"packfree_boundaries must be a packfree_plugin.Boundaries, got {type(boundaries).__name__}")
    if tokens is not None and not boundaries.describes(*tokens.shape[:2]):
        raise ValueError(
            f"packfree_boundaries describe [B={boundaries.batch_size}, T={boundaries.seq_len}] but the call's tokens "
            f"are {list(tokens.shape[:2])}"
        )


def _parent_boundaries(args: tuple, kwargs: dict) -> Boundaries | None:
    """The enclosing model's boundaries when this call is for the same tokens with the cache off, else None."""
    parent = _current()
    if parent is None or kwargs.get("use_cache") is not False:
        return None
    return parent if _inherits(parent, _call_tokens(args, kwargs), kwargs) else None


@torch.compiler.disable  # host-side reading of the batch: at most one graph break per forward, no guards on it
def _read_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Build the boundaries from the call's inputs and push them (nothing is pushed when the inputs are refused)."""
    outer = _current()
    if module.training and torch.is_grad_enabled():
        _carry_in_layers(module)
    seq2seq = bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))
    decoder_position_ids = kwargs.pop(DECODER_POSITION_IDS, None) if seq2seq else None
    parameters = class_forward_parameters(type(module))
    takes_kwargs = parameters.var_keyword is not None
    bound = parameters.bind((module, *args), kwargs)
    arguments = {**bound.pop(parameters.var_keyword, {}), **bound} if takes_kwargs else dict(bound)
    _check_rope_ids(module, arguments)
    # A nested model whose parent did not forward its kwargs reuses the parent's boundaries.
    inherited = outer is not None and _inherits(outer, _tokens(arguments), arguments)
    boundaries = outer if inherited else _paired_decoder(outer, arguments, kwargs)
    if boundaries is None:
        boundaries = boundaries_for_call(arguments, causal_labels=not seq2seq)
        if boundaries is not None and outer is None:  # the outermost call's ids are the caller's
            boundaries.callers_position_ids = arguments.get("position_ids")
    if seq2seq:
        _pair_seq2seq(module, arguments, boundaries, decoder_position_ids)
    if boundaries is not None:
        if boundaries.is_packed:
            args, kwargs = without_cache(parameters, args, kwargs)
        if takes_kwargs:
            kwargs["packfree_boundaries"] = boundaries
        if boundaries.is_packed and arguments.get("position_ids") is None and "position_ids" in parameters.names:
            # boundaries from cu_seq_lens / seq_idx alone: positions restart in every sample, as each sample alone
            # would number them (the model would otherwise count 0..T-1 across the row)
            kwargs["position_ids"] = boundaries.position_ids
    if boundaries is not None:
        refuse_packed_rows_under_context_parallel(boundaries.is_packed)
    _push(boundaries)
    return args, kwargs


# ----------------------------------------------------------------------------------- packed seq2seq
DECODER_POSITION_IDS = "decoder_position_ids"
"""The decoder's boundary input of a packed seq2seq batch: ``[B, Td]`` ids restarting at 0 where each decoder sample
starts (read by the position-ids rule of :mod:`.boundaries`); packfree pops it from the call."""
_ENCODER_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_DECODER_TOKENS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def _pair_seq2seq(module: nn.Module, arguments: dict[str, Any], encoder: Boundaries | None,
                  decoder_position_ids: torch.Tensor | None) -> None:
    """An encoder-decoder forward: build the decoder's boundaries from ``decoder_position_ids`` (and
    ``decoder_attention_mask``) and pair them with the ``encoder``'s (:class:`Seq2SeqBoundaries`, attached to both).
    Without ``decoder_position_ids`` a packed encoder row needs decoder rows laid out like it (the decoder then
    runs on the encoder's boundaries); decoder rows of another length raise."""
    tokens = next((arguments[name] for name in _DECODER_TOKENS
                   if isinstance(arguments.get(name), torch.Tensor) and arguments[name].ndim >= 2), None)
    name = type(module).__name__
    if decoder_position_ids is None:
        if encoder is not None and encoder.is_packed and tokens is not None and not _fits(encoder, tokens):
            raise ValueError(
                f"{name} got packed encoder rows {[encoder.batch_size, encoder.seq_len]} and decoder rows "
                f"{list(tokens.shape[:2])} of another length without decoder_position_ids; packfree cannot tell where "
                "each decoder sample starts. Pass decoder_position_ids restarting at 0 in every decoder sample "
                "(packfree_plugin.packing_seq2seq.Seq2SeqPackedCollator builds them)"
            )
        return
    if tokens is None or encoder is None:
        missing = "decoder inputs or labels" if tokens is None else "encoder rows"
        raise ValueError(
            f"{name} got decoder_position_ids without {missing} to describe"
            " (a packed seq2seq batch passes input_ids and decoder_input_ids or labels, and no cache)"
        )
    decoder = Boundaries.from_model_inputs(batch_size=tokens.shape[0], seq_len=tokens.shape[1], device=tokens.device,
                                           position_ids=decoder_position_ids,
                                           attention_mask=arguments.get("decoder_attention_mask"))
    Seq2SeqBoundaries(encoder, decoder).attach()


def _paired_decoder(outer: Boundaries | None, arguments: dict[str, Any], kwargs: dict) -> Boundaries | None:
    """The decoder's own boundaries when this call is the decoder of a seq2seq forward whose sides are paired
    (else None); the encoder's boundary keywords its parent forwarded through ``**kwargs`` give way to them."""
    pairing = Seq2SeqBoundaries.of(outer)
    if pairing is None or arguments.get("encoder_hidden_states") is None or \
            not _fits(pairing.decoder, _tokens(arguments)):
        return None
    for name in _ENCODER_BOUNDARY_KWARGS:
        kwargs.pop(name, None)
    if "position_ids" in kwargs:
        kwargs["position_ids"] = pairing.decoder.position_ids
    return pairing.decoder


_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs")
"""Arguments that say a call carries images or videos (precomputed vision outputs included)."""
VISUAL_TOKEN_KEYS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
"""Config attributes that hold a model's image / video placeholder token id."""


def _carries_images(config: Any, arguments: dict[str, Any]) -> bool:
    """Whether a call has images or videos: a visual input (:data:`_VISUAL_INPUTS`; an empty ``mm_encoder_outputs``
    dict carries none), nonzero ``mm_token_type_ids``, or the config's image/video placeholder tokens in
    ``input_ids``."""
    for name in _VISUAL_INPUTS:
        value = arguments.get(name)
        if value is not None and not (isinstance(value, dict) and not any(v is not None for v in value.values())):
            return True
    token_types = arguments.get("mm_token_type_ids")
    if isinstance(token_types, torch.Tensor) and bool(token_types.any()):
        return True
    tokens = arguments.get("input_ids")
    if not isinstance(tokens, torch.Tensor):
        return False
    placeholders = [getattr(config, name, None) for name in VISUAL_TOKEN_KEYS]
    placeholders = [token for token in placeholders if isinstance(token, int)]
    return bool(placeholders) and bool(torch.isin(tokens, torch.tensor(placeholders, device=tokens.device)).any())


def _uses_mrope(config: Any) -> bool:
    """Whether a model's rotary positions are multimodal (MRoPE: separate t/h/w position planes)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for part in (config, text):
        rope = getattr(part, "rope_parameters", None) or getattr(part, "rope_scaling", None)
        if isinstance(rope, dict) and any("mrope" in str(item) for item in (*rope, *rope.values())):
            return True
    return False


def _check_rope_ids(module: nn.Module, arguments: dict[str, Any]) -> None:
    """Refuse position ids whose form does not fit the model's rotary scheme: 3-D ids on a model without MRoPE
    (transformers fails deep inside); on an MRoPE model with images, 2-D ids on a packed row (the model would copy
    them into its three planes, and image tokens would lose their (t, h, w) positions in every sample, the first
    too; with one sample per row that is what stock does, and packfree does the same), and
    packed rows (``cu_seq_lens`` / ``seq_idx``) without ids (packfree would number each sample 0, 1, ... on every
    plane). Images are present when any of :func:`_carries_images`'s signals says so: pixel values, grids,
    precomputed vision outputs, or placeholder tokens."""
    position_ids = arguments.get("position_ids")
    config = getattr(module, "config", None)
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 3 and not _uses_mrope(config):
        raise ValueError(
            f"{type(module).__name__} got position_ids of shape {list(position_ids.shape)}: [R, B, T] ids are for "
            "multimodal RoPE, which this model does not use. Pass [B, T] ids"
        )
    if not _uses_mrope(config) or not _carries_images(config, arguments):
        return
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2:
        if not carries_packing_signal(arguments):
            return  # one sample per row: the model reads its 2-D ids as stock does
        given = "2-D position_ids"
    elif position_ids is None and _packing_signs(arguments):
        given = f"a packed batch ({', '.join(_packing_signs(arguments))}) without position_ids"
    else:
        return
    raise ValueError(
        f"{type(module).__name__} got {given} together with images or videos; its multimodal RoPE needs each "
        "token's (t, h, w) position. Pass no position_ids for one sample per row (the model computes them), or the "
        "[3, B, T] (or [4, B, T]) ids of each sample's own get_rope_index, concatenated along T "
        "(packfree_plugin.packing_vision.VisionPackedCollator builds them)"
    )


# ------------------------------------------------------------------------------------ layer hooks
def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Pop what the decoder-layer pre-hook pushed (runs even when the forward raised)."""
    _pop()


def _layer_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Decoder layers push the boundaries they were called with for the mixers inside, and make their
    gradient-checkpointing function carry them into the recomputation that backward runs. Traced by
    torch.compile: nothing here reads tensors or breaks the graph."""
    _push(boundaries_here(kwargs))
    # transformers sets it on the instance; a missing attribute through nn.Module.__getattr__ costs every layer
    checkpoint = module.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and not hasattr(checkpoint, _CARRIES_ATTR):
        _wrap_checkpoint(module)


def _carry_in_layers(model: nn.Module) -> None:
    """Wrap the checkpoint function of every checkpointing decoder layer of ``model`` before its first call.
    (transformers < 5.24 checkpoints a layer's ``__call__``, so the checkpoint function is taken before the
    layer's own pre-hook could wrap it, and the first step's recomputation would run without boundaries.)
    The hooked decoder layers are listed once per model (:func:`hook_layers`), not found per forward."""
    layers = model.__dict__.get(_LAYERS_ATTR)
    if layers is None:  # a model prepared by an earlier packfree, or a nested model called on its own
        layers = model.__dict__[_LAYERS_ATTR] = _hooked_layers(model)
    for layer in layers:
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if checkpoint is not None and not hasattr(checkpoint, _CARRIES_ATTR):
            _wrap_checkpoint(layer)


def _hooked_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The decoder layers of ``model`` that carry packfree's layer hooks."""
    return tuple(module for module in model.modules() if _HANDLES_ATTR in module.__dict__)


@torch.compiler.disable  # once per layer, when gradient checkpointing is first seen
def _wrap_checkpoint(module: nn.Module) -> None:
    module._gradient_checkpointing_func = _carry_through_checkpoint(module._gradient_checkpointing_func)


def _carry_through_checkpoint(checkpoint: Any) -> Any:
    """Wrap a checkpoint function so the checkpointed layer runs, and re-runs in backward, with the boundaries
    that were in effect when it was first called. (transformers checkpoints a layer's ``forward``, which module
    hooks do not see, so without this the recomputation would run the mixers on the packed row unprotected.)"""

    def carrying(function, *args, **kwargs):
        boundaries = _current()

        def run(*inner_args, **inner_kwargs):
            _push(boundaries)
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                _pop()

        return checkpoint(run, *args, **kwargs)

    setattr(carrying, _CARRIES_ATTR, checkpoint)  # the function it wraps, restored by unhook_layers
    return carrying


def hook_layers(model: nn.Module) -> int:
    """Hook every decoder layer (``GradientCheckpointingLayer``) of ``model``, which only models with sequence mixers
    or layer-level position biases need, and list them on every ``PreTrainedModel`` inside; idempotent. Returns how
    many layers were newly hooked."""
    # here, not at the top: registration (which imports this module) runs while transformers.modeling_layers
    # may still be importing
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    hooked = 0
    for module in model.modules():
        if _HANDLES_ATTR in module.__dict__ or not isinstance(module, GradientCheckpointingLayer):
            continue
        module.__dict__[_HANDLES_ATTR] = (
            module.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True),
            module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
        )
        hooked += 1
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.__dict__[_LAYERS_ATTR] = _hooked_layers(module)
    return hooked


def unhook_layers(model: nn.Module) -> None:
    """Undo :func:`hook_layers` on ``model``: the layer hooks removed, their checkpoint functions restored."""
    for module in model.modules():
        for handle in module.__dict__.pop(_HANDLES_ATTR, ()):
            handle.remove()
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        if checkpoint is not None and hasattr(checkpoint, _CARRIES_ATTR):
            module._gradient_checkpointing_func = getattr(checkpoint, _CARRIES_ATTR)
        module.__dict__.pop(_LAYERS_ATTR, None)
