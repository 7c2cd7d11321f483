"""How sequence mixers (layers that carry information along the sequence outside attention) run on a packed batch.

What runs a class is elsewhere: its entry (:data:`packfree_plugin.classes.CLASSES`) names its family, and one
:class:`~.entry.MixerAdapter` per family (:data:`.entry.ADAPTERS`, filled by :mod:`.families` and :mod:`.encoders`)
says how packed boundaries reach it. :func:`wrap_mixers` gives every covered layer of a model an instance-level forward
that, while a packed batch is in flight, runs the adapter; otherwise the layer's own forward runs
untouched. A layer that looks like a sequence mixer but has no adapter is refused at load
(:func:`check_coverage`): packfree never lets one mix samples silently.

Where does a layer get its boundaries? From :func:`~.forward.context.boundaries_here`, given its input rows:
the ``packfree_boundaries`` keyword when its decoder layer passes its ``**kwargs`` on (most transformers 5
models do), else the per-forward context's stack, which the decoder-layer hook fills around each layer
(and around the recomputation of gradient checkpointing), provided they describe those rows. Native adapters
hand them to packfree's ops (:mod:`.routes`, through the kernel functions their class's entry's ``routes`` name); the
generic tier reads the host offsets.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..boundaries import Boundaries
from ..classes import entry_of
from ..forward.context import boundaries_here
from ..forward.keywords import BOUNDARY_KWARGS, CACHE_ARGUMENTS, PACKFREE_KWARGS
from ..ops._nonfinite import Quarantine
from ..forward.signature import ForwardParameters
from . import encoders, families  # noqa: F401 - they fill the adapters by family
from .registry import MixerAdapter, additive_mask, adapter_for, dense_causal_mask
from .generic import run_unpacked
from .instance import install, own_forward, own_parameters, uninstall
from .routes import may_reach_kernels, native_forward, routed_kernels_of

__all__ = ["check_coverage", "unwrap_mixers", "wrap_mixers"]

# Arguments that make no sense for one sample run on its own: caches, masks and packed boundary inputs.
_CLEARED_PARAMETERS = (*CACHE_ARGUMENTS, "attention_mask", "cache_position", "mask", "conv_mask")
_DROPPED_KWARGS = (*PACKFREE_KWARGS, "position_ids", "use_cache")

_MAX_WASTE = 0.25
"""Padding a group of causal samples may carry (:func:`.generic.length_buckets`)."""
_PER_TOKEN_FIELDS = ("last_hidden_state", "hidden_states")
"""Fields of an encoder's ``ModelOutput`` that are per token (``[n, L, C]`` or a tuple of them) and come back packed;
the others (attention weights ``[n, H, L, L]``) come back None."""


@torch.compiler.disable  # per-sample groups follow the packing: compiled, every new packing would recompile
def _generic(adapter: MixerAdapter, layer: nn.Module, original: Callable, boundaries: Boundaries,
             arguments: dict[str, Any]) -> Any:
    parameters = own_parameters(layer)
    given = arguments.pop("kwargs", {})
    extra = {name: value for name, value in given.items() if name not in _DROPPED_KWARGS}
    token_names = (adapter.hidden_arg, *(name for name in adapter.token_args if arguments.get(name) is not None))
    fixed = {name: value for name, value in arguments.items() if name not in token_names}
    for name in _CLEARED_PARAMETERS:
        if name in parameters.names:
            fixed[name] = None
    if "use_cache" in parameters.names:
        fixed["use_cache"] = False
    indices = (adapter.output_index,) if isinstance(adapter.output_index, int) else adapter.output_index
    causal = adapter.attention is None or (adapter.causal(layer) if callable(adapter.causal) else adapter.causal)
    if adapter.attention is not None and not boundaries.is_packed and (
            not causal or any(arguments.get(name) is not None for name in CACHE_ARGUMENTS)):
        return _whole_batch(adapter, layer, original, boundaries, {**arguments, **given}, causal=causal)
    unsplit = [name for name, value in fixed.items() if isinstance(value, torch.Tensor) and value.ndim >= 2
               and (name == "encoder_hidden_states" or not causal)]
    if unsplit:  # every group would get the whole row's tensor: cross-attention states, LUKE's entities, ...
        raise ValueError(
            f"{type(layer).__name__} got {', '.join(unsplit)} (not per token) with packed boundaries; packfree "
            "cannot tell which sample each of its rows belongs to. Pass one sample per row for this input"
        )
    returned = []  # the layer's own output: its ModelOutput class, or its tuple/list (of the last group run)

    def run(tokens: tuple) -> Any:
        samples = tokens[0]
        call = {**fixed, **extra, **dict(zip(token_names, tokens))}
        if adapter.attention is not None and "attention_mask" not in token_names:
            call["attention_mask"] = dense_causal_mask(
                samples.shape[0], samples.shape[1], samples.device, window=getattr(layer, "sliding_window", None),
                additive_dtype=samples.dtype if adapter.attention == "eager" else None, causal=causal)
        if adapter.per_sample is not None:
            call.update(adapter.per_sample(layer, samples, call))
        out = original(**{k: v for k, v in call.items() if parameters.accepts(k)})
        if adapter.per_sample_output is not None:
            out = adapter.per_sample_output(layer, out)
        if isinstance(out, ModelOutput):  # an encoder's output: its per-token fields
            returned[:] = [type(out)]
            return {name: out.get(name) for name in _PER_TOKEN_FIELDS}
        if indices is None:
            return out
        returned[:] = [out]
        return tuple(out[i] for i in indices)

    tokens = tuple(arguments[name] for name in token_names)
    hidden = run_unpacked(run, tokens, boundaries, max_waste=_MAX_WASTE if causal else 0.0)
    if returned and isinstance(returned[0], type):
        return returned[0](**hidden)
    if indices is None:
        return hidden
    by_index = dict(zip(indices, hidden))
    entries = [by_index[i] if i in by_index else value if isinstance(value, nn.Parameter) else None
               for i, value in enumerate(returned[0])]
    return entries if isinstance(returned[0], list) else tuple(entries)


def _whole_batch(adapter: MixerAdapter, layer: nn.Module, original: Callable, boundaries: Boundaries,
                 arguments: dict[str, Any], *, causal: bool) -> Any:
    """An attention layer's own forward on a batch of one sample per row (``[B, T, ...]``), with its cache, under
    the dense mask stock would give it: padding keys hidden, causal (and windowed) where the layer is. So a prefill
    fills the cache as stock does, and a bidirectional layer that lets padding reach real tokens (ConvBERT's span
    convolutions) computes what stock computes."""
    if "attention_mask" not in adapter.token_args:  # a layer given the model's 4-D mask: stock's, in its form
        hidden = arguments[adapter.hidden_arg]
        arguments["attention_mask"] = dense_causal_mask(
            boundaries.batch_size, boundaries.seq_len, hidden.device, window=getattr(layer, "sliding_window", None),
            additive_dtype=hidden.dtype if adapter.attention == "eager" else None, causal=causal,
            keys=~boundaries.padding_tokens if boundaries.has_padding else None)
    return original(**{k: v for k, v in arguments.items() if k not in PACKFREE_KWARGS and own_parameters(layer).accepts(k)})


class _StockAttention:
    """Within ``with``: ``layer.config`` resolves attention calls to a stock implementation."""

    def __init__(self, layer: nn.Module, implementation: str) -> None:
        self.layer = layer
        self.saved = layer.__dict__.get("config")
        stock = layer.__dict__.get("_packfree_stock_config")
        if getattr(layer, "config", None) is None:  # attention code of its own that reads no config (XLM, GPT)
            stock = None
        elif stock is None or stock._attn_implementation != implementation:
            stock = copy.copy(layer.config)
            stock._attn_implementation_internal = implementation
            layer.__dict__["_packfree_stock_config"] = stock
        self.stock = stock

    def __enter__(self) -> None:
        if self.stock is not None:
            self.layer.__dict__["config"] = self.stock

    def __exit__(self, *exc: object) -> None:
        if self.stock is None:
            return
        if self.saved is None:
            self.layer.__dict__.pop("config", None)
        else:
            self.layer.__dict__["config"] = self.saved


def _rows_mask(boundaries: Boundaries, layer: nn.Module) -> torch.Tensor:
    """transformers' ``sdpa`` mask ``[B, 1, T, T]`` of a batch holding one sample per row (causal, the layer's
    ``sliding_window``, padding from the boundaries)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    window = getattr(layer, "sliding_window", None)
    return sdpa_mask(
        batch_size=boundaries.batch_size, q_length=boundaries.seq_len, kv_length=boundaries.seq_len,
        mask_function=causal_mask_function if window is None else sliding_window_causal_mask_function(window),
        attention_mask=~boundaries.padding_tokens if boundaries.has_padding else None, allow_is_causal_skip=False,
        device=boundaries.padding_tokens.device,
    )


def _stock_mask(mask: Any, implementation: str, dtype: torch.dtype) -> Any:
    """Transformers' ``sdpa`` mask (bool or None) in the form ``implementation`` expects."""
    if implementation == "eager" and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return additive_mask(mask, dtype)
    return mask


def _mixer_forward(layer: nn.Module, *args, **kwargs):
    """The forward every covered mixer gets, as ``functools.partial(_mixer_forward, layer)`` in the layer's
    ``__dict__``: picklable, and a deep copy binds to the copy."""
    adapter = adapter_for(type(layer))
    original = own_forward(layer)
    arguments = own_parameters(layer).bind(args, kwargs)
    boundaries = boundaries_here(kwargs, rows=arguments.get(adapter.hidden_arg))
    if adapter.attention is not None:
        return _attention_forward(layer, adapter, original, boundaries, arguments)
    if boundaries is None or not (boundaries.is_packed or boundaries.has_padding):
        # one sample per row, or rows that are not this forward's: the layer's own forward is exact; boundary
        # inputs would only make transformers' kernel fallbacks refuse the call
        return original(*args, **{k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS})
    if not boundaries.is_packed and any(arguments.get(name) is not None for name in CACHE_ARGUMENTS):
        # an ordinary padded batch with the model's cache (default use_cache, a prefill in generate()):
        # one sample per row, so the layer's own forward, which fills the cache as stock does, is exact
        return original(*args, **{k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS})
    if adapter.native is native_forward and not may_reach_kernels(layer, arguments[adapter.hidden_arg]):
        # packfree's torch ops keep a sample's NaN or inf out of the others themselves
        return native_forward(layer, original, boundaries, arguments)
    if adapter.native is not None:
        return _quarantined(adapter, boundaries, arguments, lambda inputs: adapter.native(layer, original, boundaries,
                                                                                             inputs))
    return _generic(adapter, layer, original, boundaries, arguments)


def _quarantined(adapter: MixerAdapter, boundaries: Boundaries, arguments: dict[str, Any],
                 run: Callable[[dict[str, Any]], Any]) -> Any:
    """``run(arguments)`` with a sample whose input hidden states hold NaN/inf taken out of the mixing (zeros in, NaN
    out: :class:`packfree_plugin.ops._nonfinite.Quarantine`), whichever kernel the native tier reaches (fla,
    mamba-ssm and causal-conv1d do not isolate samples; packfree's torch ops do, so routed layers that reach only
    those skip this: :func:`.routes.may_reach_kernels`). Finite inputs pass unchanged.
    Compiled graphs skip it: its per-token sample index follows the packing, which graphs take as data only inside
    packfree's opaque op (whose torch ops quarantine on their own)."""
    if torch.compiler.is_compiling():
        return run(arguments)
    hidden = arguments[adapter.hidden_arg]
    quarantine = Quarantine(boundaries.seq_idx.to(hidden.device), [(hidden, 1)])
    (arguments[adapter.hidden_arg],) = quarantine.clean()
    out = run(arguments)
    if adapter.output_index is None:
        return quarantine.mark(out)
    indices = {adapter.output_index} if isinstance(adapter.output_index, int) else set(adapter.output_index)
    marked = [quarantine.mark(value) if i in indices and isinstance(value, torch.Tensor) else value
              for i, value in enumerate(out)]
    return marked if isinstance(out, list) else tuple(marked)


def _attention_forward(layer: nn.Module, adapter: MixerAdapter, original: Callable, boundaries: Boundaries | None,
                       arguments: dict[str, Any]):
    """``boundaries``: those of the layer's own rows (None: it has none)."""
    hidden = arguments[adapter.hidden_arg]
    with _StockAttention(layer, adapter.attention):
        # one sample per row filling the model's cache (a prefill in generate()): the layer's own forward on the
        # whole batch fills the cache as stock does, with the mask stock builds for these rows
        fills_cache = boundaries is not None and not boundaries.is_packed and any(
            arguments.get(name) is not None for name in CACHE_ARGUMENTS)
        if boundaries is not None and not fills_cache:
            return _generic(adapter, layer, original, boundaries, arguments)
        if fills_cache and isinstance(arguments.get("attention_mask"), Boundaries):
            arguments["attention_mask"] = _rows_mask(boundaries, layer)
        if isinstance(arguments.get("attention_mask"), Boundaries):
            raise ValueError(f"{type(layer).__name__} got packed boundaries that do not match its input")
        if "attention_mask" in arguments:
            arguments["attention_mask"] = _stock_mask(arguments["attention_mask"], adapter.attention, hidden.dtype)
        extra = arguments.pop("kwargs", {})
        return original(**arguments, **extra)


def wrap_mixers(model: nn.Module) -> list[tuple[str, str]]:
    """Give every covered mixer in ``model`` its packed forward (idempotent); returns ``(path, tier)`` pairs."""
    wrapped = []
    for path, module in model.named_modules():
        adapter = adapter_for(type(module))
        if adapter is None:
            continue
        install(module, _mixer_forward)
        if adapter.native is not None:
            try:
                routed_kernels_of(module)
            except ValueError as error:
                raise ValueError(f"{type(model).__name__} ({path}): {error}") from error
        wrapped.append((path, adapter.tier))
    return wrapped


def unwrap_mixers(model: nn.Module) -> None:
    """Undo :func:`wrap_mixers`: every mixer runs its own forward again (the kernel routes stay: they run stock's
    kernels outside a packed call)."""
    for module in model.modules():
        uninstall(module, _mixer_forward)


_RECURRENT_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_first", "recurrent_param", "a_param"})
_MIXER_NAME = re.compile(r"(Rwkv|RWKV|Lstm|LSTM|Lightning|Indexer|Compressor|ShortConv|DeltaNet|Mamba.*Mixer)")


def _looks_like_a_mixer(module: nn.Module) -> bool:
    """A layer that carries information along the sequence: owns a Conv1d, a recurrent parameter, or a mixer name."""
    if any(isinstance(child, nn.Conv1d) for child in module.children()):
        return True
    if _RECURRENT_PARAMETERS & {name for name, _ in module.named_parameters(recurse=False)}:
        return True
    return bool(_MIXER_NAME.search(type(module).__name__))


def _takes_no_tokens(module: nn.Module) -> bool:
    """A model whose forward takes neither ``input_ids`` nor ``inputs_embeds`` (an audio or vision tower, on its own
    or inside a multimodal model): its forward builds no boundaries and never takes its parent's
    (``model_entry._read_batch`` reads tokens), so its layers only ever mix along its own inputs (audio frames,
    patches), never along a packed text row."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return False
    names = ForwardParameters.of(module.forward).names
    return "input_ids" not in names and "inputs_embeds" not in names


def check_coverage(model: nn.Module) -> None:
    """Raise if ``model`` holds a layer that looks like a sequence mixer and no entry covers it, or a layer
    packfree knows it cannot run exactly (an entry refused at load)."""
    covered: set[str] = set()
    unknown: set[str] = set()
    for path, module in model.named_modules():
        if any(not prefix or path == prefix or path.startswith(prefix + ".") for prefix in covered):
            continue
        entry = entry_of(type(module))
        if entry.mixer is not None or entry.refused_at_load or _takes_no_tokens(module):
            covered.add(path)
        elif not entry.mixes_nothing and _looks_like_a_mixer(module):
            unknown.add(type(module).__name__)
    entries = {type(module).__name__: entry_of(type(module)) for module in model.modules()}  # towers' too
    refused = {name: entry.refused.reason for name, entry in entries.items() if entry.refused_at_load}
    if refused:
        raise ValueError(
            "packfree cannot run these layers exactly on packed rows: "
            + "; ".join(f"{name} ({refused[name]})" for name in sorted(refused))
            + ". Load the model without packfree, or pass one sample per row"
        )
    if unknown:
        raise ValueError(
            f"packfree has no boundary adapter for {', '.join(sorted(unknown))}: these layers carry information "
            "along the sequence and would mix packed samples. " + _shadowed_class_note(model)
            + "Give them an entry naming their family (packfree_plugin.classes) or load the model without packfree"
        )


def _shadowed_class_note(model: nn.Module) -> str:
    """Why a model of a transformers type may not be transformers' own: another library registered its class for
    that type with the Auto classes (importing fla does so for ``mamba``, ``mamba2`` and ``bitnet``)."""
    import transformers

    cls = type(model)
    library = cls.__module__.split(".")[0]
    if library == "transformers" or not hasattr(transformers, cls.__name__):
        return ""
    stem = cls.__name__.removesuffix("Model")
    head = f" or, for the causal LM, transformers.{stem}ForCausalLM" if stem != cls.__name__ else ""
    return (f"This {cls.__name__} is {library}'s ({cls.__module__}), not transformers': {library} registered its "
            f"classes for this model type with transformers' Auto classes when it was imported, and packfree adapts "
            f"transformers' own. Build the model with transformers.{cls.__name__}{head} directly "
            f"(its from_pretrained takes the same arguments). ")
