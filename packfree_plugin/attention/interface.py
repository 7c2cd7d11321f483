"""The ``"packfree"`` attention function and its mask function, as registered with transformers.

The mask function runs once per forward. While the model hook has published this forward's
:class:`~packfree_plugin.boundaries.Boundaries` (no cache content: training, scoring, prefill), it returns
that object itself instead of a ``[B, 1, T, T]`` mask, so every attention layer receives the boundaries
as its ``attention_mask`` (the way ``flex_attention`` receives a ``BlockMask``) and no N x N mask exists.
Otherwise (decoding from a cache) it defers to transformers' ``sdpa`` mask, and the attention function
matches stock ``sdpa`` (or eager, for softcap/sinks) on that mask.

Backend per call, fastest first: fused varlen kernels on CUDA (:mod:`.varlen`), else the portable
segment path (:mod:`.segments`). ``PACKFREE_ATTENTION_BACKEND`` forces one by name (``segments``,
``torch-varlen``, ``flash-attn``, ``kernels-hub``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import and_masks, sdpa_mask

from .. import backends, opaque
from ..boundaries import Boundaries, Seq2SeqBoundaries
from ..context import boundaries_here, in_prepared_forward, is_prepared
from ..keywords import BOUNDARY_KWARGS
from ..opaque import boundary_function
from ..unpacked import slices_its_mask
from .reference import AttentionOptions, eager_attention
from .segments import cross_segment_attention, segment_attention
from .varlen import VARLEN_BACKENDS

__all__ = [
    "choose_backend",
    "packfree_attention_forward",
    "packfree_attention_mask",
    "run_packed_attention",
]

logger = logging.getLogger(__name__)

_INERT_TENSOR_KWARGS = frozenset({*BOUNDARY_KWARGS, "position_ids", "cache_position", "num_items_in_batch",
                                  "encoder_hidden_states"})
"""Tensors that reach attention calls through transformers' **kwargs without changing what attention computes."""
_PER_SAMPLE_MASK = "_packfree_per_sample"
"""Set on the dense mask packfree builds for a packed row whose model overlays a pattern (Gemma3's image blocks):
stock's mask for the row, cut to each sample, which attention applies as it is."""
_ROW_FREE_MASKS = ("and_masks.", "or_masks.", "causal_mask_function", "bidirectional_mask_function",
                   "sliding_window_overlay.", "sliding_window_causal_mask_function.",
                   "sliding_window_bidirectional_overlay.", "sliding_window_bidirectional_mask_function.",
                   "blockwise_overlay.", "padding_mask_function.", "packed_sequence_mask_function.",
                   "remap_positions_for_packed_sequence.", "add_offsets_to_mask_function.",
                   "_bidirectional_window_overlay.")
"""Qualified names of transformers' mask functions (and Gemma3's window overlay) that read tokens by relative
distance or per-token ids only, so stock's mask for a packed row, cut to each sample, equals each sample's own."""


def choose_backend(query: torch.Tensor, value: torch.Tensor, options: AttentionOptions, *, training: bool) -> str:
    """Name of the backend that will run this call (``query [B, H, T, D]``, ``value [B, Hkv, T, Dv]``): the first
    fused kernel that can, else ``segments``."""
    forced = os.environ.get("PACKFREE_ATTENTION_BACKEND")
    if forced:
        if forced != "segments" and forced not in {backend.name for backend in VARLEN_BACKENDS}:
            raise ValueError(f"PACKFREE_ATTENTION_BACKEND={forced!r} is not a packfree attention backend")
        return forced
    if backends.on_cuda(query):
        for backend in VARLEN_BACKENDS:
            if backend.supports(query, value, options, training) and backend.available():
                return backend.name
    return "segments"


def run_packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    boundaries: Boundaries,
    options: AttentionOptions,
    *,
    training: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Packed self-attention: ``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``[B, T, H, Dv]``.

    While compiling, the call runs inside packfree's opaque custom op, where the backend reads the boundaries
    on the host without breaking the graph or recompiling per packing. With dropout, the graph draws a seed
    that the op's forward and its backward's recomputation both use, so they drop the same weights.
    """
    batch, _, seq_len, _ = query.shape
    if not boundaries.describes(batch, seq_len) or key.shape[2] != seq_len:
        raise ValueError(
            f"packed boundaries describe [B={boundaries.batch_size}, T={boundaries.seq_len}] but attention got "
            f"queries [B={batch}, T={seq_len}] and keys of length {key.shape[2]} (cross-attention or a cache "
            "cannot be combined with a packed batch)"
        )
    query, key, value = _autocast(query, key, value)
    if torch.compiler.is_compiling():
        dropout = options.dropout if training else 0.0
        seed = torch.randint(2**62, (), dtype=torch.int64) if dropout > 0 else None
        return opaque.call("packfree.packed_attention", boundaries, query, key, value, options.sinks, seed,
                           scale=options.scale, causal=options.causal, window=options.window, softcap=options.softcap,
                           dropout=dropout, chunk=options.chunk, training=training, backend=backend,
                           rows=(batch, seq_len))
    return _run_backend(query, key, value, boundaries, options, training=training, backend=backend)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, the autocast dtype for all of q/k/v, as SDPA's autocast policy does: RoPE leaves q and k
    in float32 next to a bfloat16 v, which neither the varlen kernels nor the custom op (inside which autocast
    is off) would cast."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)


def _attention_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    batch, heads, seq_len, _ = query.shape
    return query.new_empty(batch, seq_len, heads, value.shape[-1])


@boundary_function("packfree.packed_attention", output=_attention_output)
def _packed_attention_function(boundaries: Boundaries, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               sinks: torch.Tensor | None, seed: torch.Tensor | None, *, scale: float, causal: bool,
                               window: int | None, softcap: float | None, dropout: float, chunk: int | None,
                               training: bool, backend: str | None) -> torch.Tensor:
    """:func:`run_packed_attention` as compiled graphs call it through the opaque op. ``seed``: ``[]`` int64
    on the CPU when ``dropout > 0``: the random state the dropout is drawn from (None without dropout)."""
    options = AttentionOptions(scale, causal, window, softcap, sinks, dropout, chunk)
    if seed is None:
        return _run_backend(query, key, value, boundaries, options, training=training, backend=backend)
    on_cuda = query.device.type == "cuda"
    with torch.random.fork_rng(devices=[query.device.index or 0] if on_cuda else [], device_type="cuda"):
        torch.manual_seed(int(seed))
        return _run_backend(query, key, value, boundaries, options, training=training, backend=backend)


def _run_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, boundaries: Boundaries,
                 options: AttentionOptions, *, training: bool, backend: str | None) -> torch.Tensor:
    backend = backend or choose_backend(query, value, options, training=training)
    if backend == "segments":
        return segment_attention(query, key, value, boundaries, options, training=training)
    chosen = next(b for b in VARLEN_BACKENDS if b.name == backend)
    if options.chunk is not None:
        raise ValueError(f"attention backend {backend!r} cannot run chunked attention; use the 'segments' backend")
    if not chosen.available():
        raise ValueError(f"attention backend {backend!r} was requested but cannot be loaded on this machine")
    return chosen.run(query, key, value, boundaries, options, training=training)


MASK_HALF_WIDTH_WINDOWS: frozenset[str] = frozenset({"T5GemmaSelfAttention", "MuseGlimmerAssistantAttention"})
"""Bidirectional layers that pass their mask's half-width ``w`` itself as ``sliding_window`` (stock's sdpa mask,
``create_bidirectional_sliding_window_mask``, allows ``|i - j| <= w``; their flash path gets one less). The others
pass flash's ``w + 1`` (ModernBERT's ``config.sliding_window + 1``), transformers' attention-kwarg convention."""


def _window(module: torch.nn.Module, sliding_window: int | None, *, causal: bool) -> int | None:
    """The layer's ``sliding_window`` in the attention-kwarg convention of :class:`AttentionOptions`: the one its
    stock sdpa mask applies."""
    if not sliding_window:
        return None
    if not causal and type(module).__name__ in MASK_HALF_WIDTH_WINDOWS:
        return sliding_window + 1
    return sliding_window


def packfree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Boundaries | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: ``query [B, H, T, D]``, ``key/value [B, Hkv, S, D]`` -> ``([B, T, H, Dv], None)``."""
    sinks = s_aux if s_aux is not None else kwargs.pop("sinks", None)
    position_bias = kwargs.pop("position_bias", None) if type(module).__name__ in RELATIVE_POSITION_BIAS else None
    unknown = sorted(name for name, value in kwargs.items()
                     if isinstance(value, torch.Tensor) and name not in _INERT_TENSOR_KWARGS)
    if unknown:
        raise ValueError(
            f"{type(module).__name__} passed {', '.join(unknown)} to the attention function; packfree does not "
            "know how to apply it and will not ignore it silently (use attn_implementation='sdpa'/'eager' for this "
            "model, or register a MixerAdapter with attention='sdpa' for this layer)"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = AttentionOptions(
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        causal=causal,
        window=_window(module, sliding_window, causal=causal),
        softcap=softcap or None,
        sinks=sinks,
        dropout=dropout,
        chunk=_chunk_of(module),
    )
    training = module.training
    if isinstance(attention_mask, Seq2SeqBoundaries) or (position_bias is not None and
                                                         isinstance(attention_mask, Boundaries)):
        return _packed_seq2seq_attention(module, query, key, value, attention_mask, options, position_bias,
                                         training=training), None
    if isinstance(attention_mask, Boundaries):
        if attention_mask.sequence_shard is not None:  # a sequence-parallel shard's: the gathered row's
            attention_mask = attention_mask.sequence_shard.whole_row(query.shape[2])
        return run_packed_attention(query, key, value, attention_mask, options, training=training), None
    if attention_mask is None:
        # a model that made no mask (none of its layers needs one), or Ulysses, which drops it and gathers the row
        boundaries = kwargs.get("packfree_boundaries")
        if boundaries is None and _wrapped_by_sequence_parallel():  # a layer that forwards no kwargs (BERT)
            boundaries = boundaries_here()
        if boundaries is not None and boundaries.sequence_shard is not None:
            boundaries = boundaries.sequence_shard.whole_row(query.shape[2])
        if boundaries is not None and query.shape[2] == key.shape[2] and position_bias is None:
            return run_packed_attention(query, key, value, boundaries, options, training=training), None
    if getattr(attention_mask, _PER_SAMPLE_MASK, False):  # packfree's own dense mask for a packed overlay
        return _masked_attention(module, query, key, value, attention_mask, options, training=training, **kwargs)
    if any(boundaries_here(packed=True, length=length) is not None for length in (query.shape[2], key.shape[2])):
        # attention along the packed row with a mask of its own (attention over other axes, e.g. Inkling2's
        # per-token attention over earlier layers' states, mixes no samples)
        raise ValueError(
            f"{type(module).__name__} attends with a mask of its own (cross-attention, or a mask its model builds "
            "outside transformers' mask interface) inside a packed forward; packfree cannot keep that attention "
            "inside each sample. Pass one sample per row for this model"
        )
    # Backward's recomputation of a checkpointed layer runs outside the model's forward: a vision tower's layer
    # (no boundaries: its forward took this same path) recomputes as it ran. (The engine's graph task id is -1
    # outside backward.)
    if not in_prepared_forward() and torch._C._current_graph_task_id() == -1:
        name = type(module).__name__
        if is_prepared(module):
            raise ValueError(
                f"{name} runs packfree attention outside its model's forward (a layer or a module below the model "
                "called on its own), so nothing reads its batch's boundaries. Call the model itself: model(...) or "
                "model.forward(...)"
            )
        raise ValueError(
            f"{name} runs packfree attention in a model packfree has not prepared (its attention implementation "
            "was set to 'packfree' without transformers' set_attn_implementation, or packfree was unregistered), so "
            "nothing reads its batch's boundaries. Call packfree_plugin.apply(model) once, or load it with "
            "attn_implementation='packfree'"
        )
    return _masked_attention(module, query, key, value, attention_mask, options, training=training,
                             position_bias=position_bias, **kwargs)


def _wrapped_by_sequence_parallel() -> bool:
    """Whether something (DeepSpeed's Ulysses) replaced packfree's entry in transformers' attention registry with
    a wrapper that gathers the row and calls packfree's function without a mask."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get("packfree") not in (None, packfree_attention_forward)


def _chunk_of(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (transformers' convention: ``config.layer_types[layer_idx]`` is
    ``"chunked_attention"``, the size ``config.attention_chunk_size``), else None. Read once per layer (config reads
    cost a short row's every layer) and kept on it, outside compiled graphs."""
    known = module.__dict__.get(_CHUNK_ATTR)
    if known is not None:
        return known[0]
    chunk = _read_chunk(module)
    if not torch.compiler.is_compiling():
        module.__dict__[_CHUNK_ATTR] = (chunk,)
    return chunk


_CHUNK_ATTR = "_packfree_attention_chunk"


def _read_chunk(module: torch.nn.Module) -> int | None:
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is None or layer_idx is None or layer_types[layer_idx] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _masked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    options: AttentionOptions,
    *,
    training: bool,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Unpacked call with transformers' own mask (decoding from a cache): stock ``sdpa``, or eager for softcap/sinks."""
    if not options.needs_eager:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=options.dropout, scaling=options.scale,
            is_causal=options.causal, position_bias=position_bias,
        )
    if position_bias is not None:
        raise ValueError(f"{type(module).__name__}: packfree applies a position bias only without softcap or sinks")
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = eager_attention(
        query, key, value, AttentionOptions(options.scale, options.causal and attention_mask is None, None,
                                            options.softcap, options.sinks, options.dropout),
        mask=attention_mask, training=training,
    )
    return out.transpose(1, 2).contiguous(), None


@cache
def _pattern_codes() -> dict:
    """Code object of each of transformers' mask-function building blocks -> how packfree serves it: ``None`` (the
    boundaries, or the layer's own arguments, give the same pattern) or the closure variable holding the
    function(s) it wraps."""
    from transformers import masking_utils as masks

    probe = masks.causal_mask_function
    codes = {probe.__code__: None, masks.bidirectional_mask_function.__code__: None,
             masks.and_masks(probe).__code__: "mask_functions",
             # the layer passes its sliding_window to the attention function; chunked layers say so in their config
             masks.sliding_window_overlay(1).__code__: None,
             masks.chunked_overlay(1, torch.zeros(1, dtype=torch.long)).__code__: None,
             masks.padding_mask_function(torch.ones(1, 1, dtype=torch.bool)).__code__: None,  # padding spans
             masks.packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)).__code__: None}  # the samples
    for name, wrapped in (("sliding_window_bidirectional_overlay", None), ("remap_positions_for_packed_sequence",
                          "mask_function"), ("add_offsets_to_mask_function", "mask_function")):
        factory = getattr(masks, name, None)  # not in every supported release
        if factory is not None:
            built = factory(1) if wrapped is None else factory(probe, *((torch.zeros(1, 1, dtype=torch.long),)
                                                                         if name.startswith("remap") else (0, 0)))
            codes[built.__code__] = wrapped
    return codes


def _cells(function: Callable) -> dict[str, object]:
    """The closure variables of ``function`` by name."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__)))


@cache
def _or_code() -> object:
    from transformers import masking_utils as masks

    return masks.or_masks(masks.causal_mask_function).__code__


def _check_pattern(mask_function: Callable) -> None:
    """Raise unless ``mask_function`` is built only from patterns packfree computes (causal, bidirectional, sliding
    window, chunked, padding, packed samples, combined with ``and_masks``): anything else (``or_masks``, block
    overlays, a custom function) would be dropped silently when the mask is replaced by the boundaries."""
    code = getattr(mask_function, "__code__", None)
    codes = _pattern_codes()
    if code is _or_code():
        # transformers' blockwise overlay (bidirectional image tokens) with no block at all (text only) adds nothing
        inner = _cells(mask_function)["mask_functions"]
        others = [function for function in inner if not _adds_no_block(function)]
        if len(others) == 1:
            return _check_pattern(others[0])
    if code not in codes:
        raise ValueError(
            f"the attention mask of this model is built with {getattr(mask_function, '__qualname__', mask_function)!r}, "
            "a pattern packfree's attention does not compute; it will not drop it silently. Use "
            "attn_implementation='sdpa' for this model, or pass one sample per row"
        )
    if codes[code] is None:
        return
    inner = _cells(mask_function)[codes[code]]
    for function in inner if isinstance(inner, (tuple, list)) else (inner,):
        _check_pattern(function)


TENSOR_MASK_MODELS: dict[str, str | None] = {"mpt": None, "falcon": "alibi"}
"""Model type -> the config switch (None: always) under which its model code works on the attention mask as a tensor
before its layers (MPT casts it to bool; Falcon folds its ALiBi bias into it), where the boundaries object would
crash. These models get the dense mask of the packed samples instead (transformers' eager form, O(T^2) as on
stock); their attention layers run per sample (:mod:`..adapters.families`) and build their own."""


def _wants_tensor_mask(config: object) -> bool:
    """Whether a model with ``config`` needs its attention mask as a tensor (:data:`TENSOR_MASK_MODELS`)."""
    if config is None:
        return False
    model_type = getattr(config, "model_type", None)
    if model_type not in TENSOR_MASK_MODELS:
        return False
    switch = TENSOR_MASK_MODELS[model_type]
    return switch is None or bool(getattr(config, switch, False))


def _packed_dense_mask(boundaries: Boundaries, mask_function: Callable | None, dtype: torch.dtype) -> torch.Tensor:
    """transformers' eager mask ``[B, 1, T, T]`` (0 where visible, the dtype's minimum elsewhere) of ``mask_function``
    restricted to each segment of ``boundaries``, for models whose code needs the mask as a tensor."""
    from transformers.masking_utils import and_masks, causal_mask_function, eager_mask, packed_sequence_mask_function

    return eager_mask(
        batch_size=boundaries.batch_size, q_length=boundaries.seq_len, kv_length=boundaries.seq_len,
        mask_function=and_masks(mask_function or causal_mask_function, packed_sequence_mask_function(boundaries.seq_idx)),
        dtype=dtype, device=boundaries.seq_idx.device,
    )


def packfree_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> Boundaries | torch.Tensor | None:
    """transformers' mask-function contract. Returns this forward's boundaries when there are any, for a
    ``mask_function`` whose pattern packfree's attention computes (:func:`_check_pattern`). A mask with an overlay of
    the model's own (``use_vmap``: or/and mask functions; or an ``or_masks`` union such as Gemma3's bidirectional
    image blocks) is stock's ``sdpa_mask``: for a packed row cut to each sample (dense, O(T^2)), and refused where
    transformers renumbered positions under the overlay. While compiling (closures cannot be traced, so only a union
    at the top is seen) every overlay is refused. A call whose 2-D mask is not the boundaries' padding (a seq2seq
    cross-attention given the encoder's mask) gets stock's mask. A packed seq2seq decoder's cross-attention gets
    the pairing of its samples with the encoder's (:func:`_cross_attention_mask`)."""
    pairing = _cross_attention_mask(boundaries_here(), batch_size, q_length, kv_length, mask_function)
    if pairing is not None:
        return pairing
    boundaries = boundaries_here(rows=(batch_size, q_length)) if q_length == kv_length else None
    if boundaries is not None and _marks_their_padding(boundaries, attention_mask) \
            and (boundaries.is_packed or not slices_its_mask(kwargs.get("config"))):
        compiling = torch.compiler.is_compiling()
        if not (use_vmap or _widens(mask_function, look_inside=not compiling)):
            if mask_function is not None and not compiling:
                # compiled forwards skip the check: their model passed it eagerly, in the sweep or the proof at load
                _check_pattern(mask_function)
            if _wants_tensor_mask(kwargs.get("config")):
                return _packed_dense_mask(boundaries, mask_function, kwargs.get("dtype", torch.float32))
            return boundaries
        if compiling:
            model_type = getattr(kwargs.get("config"), "model_type", "this model")
            raise ValueError(
                f"{model_type!r} overlays a pattern of its own on the causal mask (or_mask_function / "
                "and_mask_function / block_sequence_ids, e.g. Gemma3's bidirectional image tokens), which packfree "
                "cannot see whole while compiling. Run it without torch.compile, or use attn_implementation='sdpa'"
            )
        if boundaries.is_packed:  # stock's dense mask, cut to each sample
            model_type = getattr(kwargs.get("config"), "model_type", "this model")
            unknown = sorted({name for name in _qualnames(mask_function) if not name.startswith(_ROW_FREE_MASKS)})
            if unknown:
                raise ValueError(
                    f"{model_type!r} overlays a pattern of its own on the causal mask ({', '.join(unknown)}) that may "
                    "depend on a token's place in the row (e.g. Llama 4's attention chunks), so packfree cannot cut "
                    "it to each packed sample. Pass one sample per row, or use attn_implementation='sdpa'"
                )
            if _renumbers_overlay(mask_function):
                raise ValueError(
                    f"{model_type!r} overlays a pattern of its own on the causal mask, and transformers renumbered "
                    "the packed row's positions per sample before applying it (packed position_ids without an "
                    "attention_mask), so the pattern reads the wrong tokens. Pass attention_mask (ones, [B, T]) "
                    "with the packed row, as packfree_plugin.packing.VisionPackedCollator does"
                )
            segments = boundaries.seq_idx

            def same_sample(batch_idx, head_idx, q_idx, kv_idx):
                return segments[batch_idx, q_idx] == segments[batch_idx, kv_idx]

            mask_function = and_masks(mask_function, same_sample)
            kwargs["allow_is_causal_skip"] = False
            mask = sdpa_mask(
                batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap,
                **kwargs,
            )
            setattr(mask, _PER_SAMPLE_MASK, True)
            return mask
    if slices_its_mask(kwargs.get("config")):
        # a tensor for the model to cut even where stock sdpa would skip it as causal (a cut mask is no longer causal
        # from the top left: stock leaves its cut out when a mask is None, packfree's implementation name does not)
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap, **kwargs,
    )


def _marks_their_padding(boundaries: Boundaries, attention_mask: torch.Tensor | None) -> bool:
    """Whether a mask call's 2-D ``attention_mask`` (True/1 = a key to attend) hides exactly the boundaries'
    padding. It does for self-attention; a seq2seq decoder's cross-attention of the same length is given the
    encoder's mask instead, and then stock's mask is the right one (the decoder's boundaries are not the encoder's)."""
    if attention_mask is None or attention_mask.ndim != 2 or torch.compiler.is_compiling():
        return True
    return torch.equal(attention_mask.bool(), ~boundaries.padding_tokens.to(attention_mask.device))


def _widens(mask_function: Callable | None, *, look_inside: bool) -> bool:
    """Whether transformers' ``or_masks`` composed ``mask_function`` with something that widens causal attention,
    such as ``block_sequence_ids`` (which transformers passes without ``use_vmap``). Inside its closures (not
    traceable by torch.compile, so only with ``look_inside``) a block overlay without any block (all ids -1, as
    Gemma 4 builds for text) adds nothing; without ``look_inside`` any union at the top counts."""
    if getattr(mask_function, "__name__", "") != "or_mask":  # or_masks' inner function (Dynamo hides __qualname__)
        return look_inside and any(_widens(part, look_inside=True) for part in _closure_functions(mask_function))
    if not look_inside:
        return True
    base, *added = _closure_functions(mask_function)
    return _widens(base, look_inside=True) or not all(map(_adds_no_block, added))


def _qualnames(mask_function: Callable | None) -> list[str]:
    """Qualified names of ``mask_function`` and of every function in its closures."""
    names = [getattr(mask_function, "__qualname__", repr(mask_function))]
    for part in _closure_functions(mask_function):
        names += _qualnames(part)
    return names


def _renumbers_overlay(mask_function: Callable | None) -> bool:
    """Whether transformers' ``remap_positions_for_packed_sequence`` (packed position_ids without an attention mask)
    wraps a widening overlay inside ``mask_function``: that overlay then indexes its ids by in-sample positions."""
    if getattr(mask_function, "__qualname__", "").startswith("remap_positions_for_packed_sequence."):
        return any(_widens(part, look_inside=True) for part in _closure_functions(mask_function))
    return any(_renumbers_overlay(part) for part in _closure_functions(mask_function))


def _closure_functions(function: Callable | None) -> list[Callable]:
    """The functions a mask function closes over (``or_masks``/``and_masks`` hold theirs in a tuple), in order."""
    found: list[Callable] = []
    for cell in getattr(function, "__closure__", None) or ():
        contents = cell.cell_contents
        found += [item for item in (contents if isinstance(contents, tuple) else (contents,)) if callable(item)]
    return found


def _adds_no_block(function: Callable) -> bool:
    """Whether ``function`` is transformers' ``blockwise_overlay`` over ids that are all -1 (no block at all)."""
    if not getattr(function, "__qualname__", "").startswith("blockwise_overlay."):
        return False
    ids = [cell.cell_contents for cell in function.__closure__ or () if isinstance(cell.cell_contents, torch.Tensor)]
    return len(ids) == 1 and bool((ids[0] < 0).all())


# ------------------------------------------------------------------------------------------ packed seq2seq
RELATIVE_POSITION_BIAS: frozenset[str] = frozenset({"T5Attention", "MT5Attention", "UMT5Attention", "LongT5Attention"})
"""Attention layers that pass a ``position_bias`` ``[1, H, Tq, Tk]`` to the attention function: T5's relative bias,
which depends only on the distance between query and key (so a packed sample's block equals the sample's own), in
self-attention; zeros in cross-attention (``has_relative_attention_bias`` False)."""


def _cross_attention_mask(boundaries: Boundaries | None, batch_size: int, q_length: int, kv_length: int,
                          mask_function: Callable | None) -> Seq2SeqBoundaries | None:
    """The mask of a paired seq2seq decoder's cross-attention (a bidirectional mask asked for while the decoder's
    boundaries are in effect, from its rows to the encoder's): the :class:`Seq2SeqBoundaries` themselves (layers that
    add the mask to their scores themselves, MVP's, turn it into its dense form: ``adapters.positions``). None
    otherwise."""
    pairing = Seq2SeqBoundaries.of(boundaries)
    if pairing is None or boundaries is not pairing.decoder or getattr(mask_function, "__name__", "") != \
            "bidirectional_mask_function" or not pairing.encoder.describes(batch_size, kv_length) \
            or not pairing.decoder.describes(batch_size, q_length):
        return None
    return pairing


def _packed_seq2seq_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              mask: Boundaries | Seq2SeqBoundaries, options: AttentionOptions,
                              position_bias: torch.Tensor | None, *, training: bool) -> torch.Tensor:
    """A packed seq2seq call: cross-attention over a :class:`Seq2SeqBoundaries` (each decoder sample reads its own
    encoder sample), or self-attention with T5's relative ``position_bias``, per segment -> ``[B, T, H, Dv]``."""
    name = type(module).__name__
    if torch.compiler.is_compiling():
        raise ValueError(f"{name}: packfree runs packed seq2seq cross-attention and relative position biases eagerly "
                         "only; run this model without torch.compile, or pass one sample per row")
    if isinstance(mask, Boundaries):
        if not mask.describes(query.shape[0], query.shape[2]) or key.shape[2] != query.shape[2]:
            raise ValueError(f"{name}: packed boundaries describe [B={mask.batch_size}, T={mask.seq_len}] but "
                             f"attention got queries {[query.shape[0], query.shape[2]]} and keys of length {key.shape[2]}")
        if position_bias.ndim != 4 or position_bias.shape[0] != 1 or min(position_bias.shape[-2:]) < mask.max_seqlen:
            raise ValueError(f"{name} passed a position_bias of shape {list(position_bias.shape)}; packfree applies "
                             f"a relative bias [1, H, L, L] covering the longest packed sample ({mask.max_seqlen} "
                             "tokens)")
        query, key, value = _autocast(query, key, value)
        return segment_attention(query, key, value, mask, options, training=training, bias=position_bias)
    if position_bias is not None and getattr(module, "has_relative_attention_bias", True):
        raise ValueError(f"{name} adds a position bias to its cross-attention; packfree cannot cut it to each "
                         "packed sample. Pass one sample per row for this model")
    if not mask.encoder.describes(key.shape[0], key.shape[2]) or not mask.decoder.describes(*query.shape[:3:2]):
        raise ValueError(
            f"{name}: cross-attention from [B={query.shape[0]}, T={query.shape[2]}] to keys of length {key.shape[2]}, "
            f"but the packed seq2seq batch has decoder rows {[mask.decoder.batch_size, mask.decoder.seq_len]} and "
            f"encoder rows {[mask.encoder.batch_size, mask.encoder.seq_len]}"
        )
    query, key, value = _autocast(query, key, value)
    return cross_segment_attention(query, key, value, mask, options, training=training)
