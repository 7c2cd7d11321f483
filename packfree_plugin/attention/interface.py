"""The ``"packfree"`` attention function, as registered with transformers.

Its mask function (:mod:`.masks`) runs once per forward and, while the model entry has published this forward's
:class:`~packfree_plugin.boundaries.Boundaries` (no cache content: training, scoring, prefill), returns that object
itself, so every attention layer receives the boundaries as its ``attention_mask`` (the way ``flex_attention``
receives a ``BlockMask``) and no N x N mask exists. Otherwise (decoding from a cache) it returns transformers' ``sdpa``
mask, and the attention function matches stock ``sdpa`` (or eager, for softcap/sinks) on that mask.

Backend per call, fastest first: fused varlen kernels on CUDA (:mod:`.varlen`), else the portable
segment path (:mod:`.segments`). ``PACKFREE_ATTENTION_BACKEND`` forces one by name (``segments``,
``torch-varlen``, ``flash-attn``, ``kernels-hub``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..ops import backends, opaque
from ..boundaries import Boundaries, Seq2SeqBoundaries, TwoWayBlocks
from ..classes import entry_of
from ..forward.context import boundaries_here, current, in_prepared_forward, is_prepared, kept_on
from ..forward.keywords import BOUNDARY_KWARGS
from ..ops.opaque import boundary_op
from .masks import is_per_sample_mask
from .reference import AttentionOptions, eager_attention
from .segments import cross_segment_attention, segment_attention
from .two_way import two_way_attention
from .varlen import VARLEN_BACKENDS

__all__ = ["choose_backend", "packfree_attention_forward", "run_packed_attention"]

_INERT_TENSOR_KWARGS = frozenset({*BOUNDARY_KWARGS, "position_ids", "cache_position", "num_items_in_batch",
                                  "encoder_hidden_states", "shift_labels", "labels"})
"""Tensors that reach attention calls through transformers' **kwargs without changing what attention computes
(``shift_labels``: the loss's targets, which ``...ForCausalLM`` passes down with its other kwargs; ``labels``, which
Gemma 4's ``...ForConditionalGeneration`` passes to its model, and on to every layer)."""


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
        return opaque.call("packed_attention", boundaries, query, key, value, options.sinks, seed,
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


@boundary_op("packed_attention", output=_attention_output)
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


class _LayerFacts(NamedTuple):
    """What an attention layer's class and config say about every call it makes, read once per layer
    (:func:`_facts_of`): class-table lookups and config reads cost a decode step's every layer otherwise."""

    relative_position_bias: bool
    """Its entry's ``relative_position_bias``: the ``position_bias`` kwarg is a bias packfree applies."""
    half_width_window: bool
    """Its entry's ``half_width_window`` quirk: bidirectional layers pass their mask's half-width ``w``, not ``w + 1``."""
    chunk: int | None
    """Chunked attention's chunk size (transformers' convention: ``config.layer_types[layer_idx]`` is
    ``"chunked_attention"``, the size ``config.attention_chunk_size``), else None."""


def _facts_of(module: torch.nn.Module) -> _LayerFacts:
    """``module``'s :class:`_LayerFacts`, kept on it after the first call (:func:`~..forward.context.kept_on`)."""
    def read() -> _LayerFacts:
        entry = entry_of(type(module))
        return _LayerFacts(entry.relative_position_bias, entry.half_width_window, _read_chunk(module))

    return kept_on(module, "_packfree_attention_facts", read)


def _window(facts: _LayerFacts, sliding_window: int | None, *, causal: bool) -> int | None:
    """The layer's ``sliding_window`` in the attention-kwarg convention of :class:`AttentionOptions`: the one its
    stock sdpa mask applies (a ``half_width_window`` layer passes its mask's half-width ``w``, not transformers'
    attention-kwarg ``w + 1``)."""
    if not sliding_window:
        return None
    if not causal and facts.half_width_window:
        return sliding_window + 1
    return sliding_window


def _unknown_tensors(kwargs: dict) -> list[str]:
    """Names of tensors in an attention call's ``**kwargs`` that change what it computes (none expected)."""
    unknown = []
    for name, value in kwargs.items():  # a loop, not a comprehension: this runs in every layer of a decode step
        if isinstance(value, torch.Tensor) and name not in _INERT_TENSOR_KWARGS:
            unknown.append(name)
    return sorted(unknown)


def packfree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Boundaries | TwoWayBlocks | torch.Tensor | None,
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
    facts = _facts_of(module)
    position_bias = kwargs.pop("position_bias", None) if facts.relative_position_bias else None
    unknown = _unknown_tensors(kwargs)
    if unknown:
        raise ValueError(
            f"{type(module).__name__} passed {', '.join(unknown)} to the attention function; packfree does not "
            "know how to apply it and will not ignore it silently (use attn_implementation='sdpa'/'eager' for this "
            "model, or register a MixerAdapter with attention='sdpa' for this layer)"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (attention_mask is None or isinstance(attention_mask, torch.Tensor)) and current() is None \
            and in_prepared_forward() and kwargs.get("packfree_boundaries") is None:
        # a decode step (its entry pushed None, and no boundaries came through the kwargs): stock's mask, or none
        return _masked_attention(module, query, key, value, attention_mask,
                                 AttentionOptions(scale, causal, None, softcap or None, sinks, dropout),
                                 training=module.training, position_bias=position_bias, **kwargs)
    options = AttentionOptions(
        scale=scale,
        causal=causal,
        window=_window(facts, sliding_window, causal=causal),
        softcap=softcap or None,
        sinks=sinks,
        dropout=dropout,
        chunk=facts.chunk,
    )
    training = module.training
    if isinstance(attention_mask, Seq2SeqBoundaries) or (position_bias is not None and
                                                         isinstance(attention_mask, Boundaries)):
        return _packed_seq2seq_attention(module, query, key, value, attention_mask, options, position_bias,
                                         training=training), None
    if isinstance(attention_mask, TwoWayBlocks):  # causal with two-way blocks inside samples (Gemma 3's images)
        if attention_mask.boundaries.sequence_shard is not None or torch.compiler.is_compiling():
            raise ValueError(f"{type(module).__name__}: packfree lays out two-way blocks (image tokens attending "
                             "both ways) eagerly on one device only; run without torch.compile or sequence "
                             "parallelism, or pass one sample per row")
        query, key, value = _autocast(query, key, value)
        return two_way_attention(query, key, value, attention_mask, options, training=training,
                                 layer=type(module).__name__), None
    if isinstance(attention_mask, Boundaries):
        if attention_mask.sequence_shard is not None:  # a sequence-parallel shard's: the gathered row's
            attention_mask = attention_mask.sequence_shard.whole_row(query.shape[2])
        return run_packed_attention(query, key, value, attention_mask, options, training=training), None
    if attention_mask is None:
        # a model that made no mask (none of its layers needs one), or Ulysses, which drops it and gathers the row
        boundaries = kwargs.get("packfree_boundaries")
        if boundaries is None:  # a layer that forwards no kwargs (BERT) under Ulysses; never while decoding
            here = boundaries_here()
            boundaries = here if here is not None and _wrapped_by_sequence_parallel() else None
        if boundaries is not None and boundaries.sequence_shard is not None:
            boundaries = boundaries.sequence_shard.whole_row(query.shape[2])
        if boundaries is not None and query.shape[2] == key.shape[2] and position_bias is None:
            return run_packed_attention(query, key, value, boundaries, options, training=training), None
    if is_per_sample_mask(attention_mask):  # packfree's own dense mask for a packed overlay
        return _masked_attention(module, query, key, value, attention_mask, options, training=training, **kwargs)
    here = current()
    if here is not None and here.is_packed and here.seq_len in (query.shape[2], key.shape[2]):
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


def _read_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (:attr:`_LayerFacts.chunk`), else None."""
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


# ------------------------------------------------------------------------------------------ packed seq2seq


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
