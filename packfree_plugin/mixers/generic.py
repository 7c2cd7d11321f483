"""The per-sample tier: run any sequence mixer, or an attention layer packfree's attention function cannot reach, on a
packed batch by unpacking, running, repacking (:func:`run_generic`, :func:`attention_forward`).

The samples of a packed batch are regrouped into a small number of right-padded batches of similar
lengths (length bucketing bounds the padding to ``max_waste``), the layer's own forward runs on each
with no cache and no mask, and the outputs are scattered back into packed order. Right padding is safe
for causal mixers: a padding token comes after the real ones and cannot reach them. Bidirectional layers
(encoders) would see it, so they run in groups of samples of one length (``max_waste=0``), unpadded.
Padding segments of the packed batch get zeros. Differentiable end to end. Attention layers run this way get the
dense mask of their batch of samples (:func:`dense_causal_mask`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..boundaries import Boundaries
from ..forward.keywords import CACHE_ARGUMENTS, PACKFREE_KWARGS
from ..forward.signature import tensor_leaves
from ..forward.instance import own_parameters
from .registry import MixerAdapter

__all__ = ["additive_mask", "attention_forward", "dense_causal_mask", "length_buckets", "run_generic",
           "run_unpacked"]

# Arguments that make no sense for one sample run on its own: caches, masks and packed boundary inputs.
_CLEARED_PARAMETERS = (*CACHE_ARGUMENTS, "attention_mask", "cache_position", "mask", "conv_mask")
_DROPPED_KWARGS = (*PACKFREE_KWARGS, "position_ids", "use_cache")

_MAX_WASTE = 0.25
"""Padding a group of causal samples may carry (:func:`length_buckets`)."""
_PER_TOKEN_FIELDS = ("last_hidden_state", "hidden_states")
"""Fields of an encoder's ``ModelOutput`` that are per token (``[n, L, C]`` or a tuple of them) and come back packed;
the others (attention weights ``[n, H, L, L]``) come back None."""





def length_buckets(lengths: list[int], *, max_waste: float = 0.25) -> list[list[int]]:
    """Group segment indices so each group's padded size ``n * max_len <= (1 + max_waste) * sum_len``.

    Longest first; deterministic. Returns lists of indices into ``lengths``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    buckets: list[list[int]] = []
    for index in order:
        if buckets:
            bucket = buckets[-1]
            longest = lengths[bucket[0]]
            total = sum(lengths[i] for i in bucket) + lengths[index]
            if (len(bucket) + 1) * longest <= (1 + max_waste) * total:
                bucket.append(index)
                continue
        buckets.append([index])
    return buckets


def _map(tree: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(tree, torch.Tensor):
        return function(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(item, function) for item in tree)
    if isinstance(tree, dict):
        return {key: _map(item, function) for key, item in tree.items()}
    return tree


def run_unpacked(
    run: Callable[[Any], Any],
    hidden_states: Any,
    boundaries: Boundaries,
    *,
    max_waste: float = 0.25,
) -> Any:
    """``run(inputs [n, L, ...]) -> outputs [n, L, ...]`` applied per sample; ``[B, T, ...]`` -> ``[B, T, ...]``.

    ``hidden_states`` is a tensor ``[B, T, C]`` or a tuple/list/dict of them (e.g. hidden states together with
    ``input_ids`` or per-token ``(cos, sin)``); a leaf ``[1, T, ...]`` is shared by every row. ``run`` gets the
    same structure for each right-padded group of samples and returns a tensor or a tuple/list/dict of them
    (nested, entries may be None); the result has that structure with every tensor scattered back into packed order.
    ``max_waste``: padding allowed per group (:func:`length_buckets`); 0 runs only samples of one length together,
    so no sample is padded at all (what bidirectional layers need).
    """
    batch, seq_len = boundaries.batch_size, boundaries.seq_len
    for leaf in tensor_leaves(hidden_states):
        if leaf.ndim < 2 or leaf.shape[1] != seq_len or leaf.shape[0] not in (1, batch):
            raise ValueError(
                f"per-token input of shape {list(leaf.shape)} does not match the packed boundaries "
                f"[B={batch}, T={seq_len}]"
            )
    device = tensor_leaves(hidden_states)[0].device

    def with_zero_row(leaf: torch.Tensor) -> torch.Tensor:
        # one extra zero row that padded positions gather from
        flat = leaf.expand(batch, *leaf.shape[1:]).reshape(batch * seq_len, *leaf.shape[2:])
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])

    sources = _map(hidden_states, with_zero_row)
    samples = [(start, length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    if not samples:
        raise ValueError("the packed batch holds only padding")
    outputs, keeps, destinations = [], [], []
    for bucket in length_buckets([length for _, length in samples], max_waste=max_waste):
        longest = samples[bucket[0]][1]
        index = torch.full((len(bucket), longest), batch * seq_len, dtype=torch.long)
        for row, sample in enumerate(bucket):
            start, length = samples[sample]
            index[row, :length] = torch.arange(start, start + length)
        index = index.to(device)
        out = run(_map(sources, lambda source: source[index]))
        keep = index < batch * seq_len
        outputs.append(out)
        keeps.append(keep)
        destinations.append(index[keep])
    where = torch.cat(destinations)

    def scatter(pieces: list[Any]) -> Any:
        """One output (a tensor, None, or a tuple/list/dict of them) per group -> that structure in packed order."""
        first = pieces[0]
        if isinstance(first, (tuple, list)):
            return type(first)(scatter([piece[i] for piece in pieces]) for i in range(len(first)))
        if isinstance(first, dict):
            return {key: scatter([piece[key] for piece in pieces]) for key in first}
        if any(piece is None for piece in pieces):
            return None
        gathered = torch.cat([piece[keep] for piece, keep in zip(pieces, keeps)])
        result = gathered.new_zeros(batch * seq_len, *gathered.shape[1:]).index_copy(0, where, gathered)
        return result.view(batch, seq_len, *gathered.shape[1:])

    return scatter(outputs)


@torch.compiler.disable  # per-sample groups follow the packing: compiled, every new packing would recompile
def run_generic(adapter: MixerAdapter, layer: nn.Module, original: Callable, boundaries: Boundaries,
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
    parameters = own_parameters(layer)
    return original(**{k: v for k, v in arguments.items() if k not in PACKFREE_KWARGS and parameters.accepts(k)})


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


def attention_forward(layer: nn.Module, adapter: MixerAdapter, original: Callable, boundaries: Boundaries | None,
                       arguments: dict[str, Any]):
    """``boundaries``: those of the layer's own rows (None: it has none)."""
    hidden = arguments[adapter.hidden_arg]
    with _StockAttention(layer, adapter.attention):
        # one sample per row filling the model's cache (a prefill in generate()): the layer's own forward on the
        # whole batch fills the cache as stock does, with the mask stock builds for these rows
        fills_cache = boundaries is not None and not boundaries.is_packed and any(
            arguments.get(name) is not None for name in CACHE_ARGUMENTS)
        if boundaries is not None and not fills_cache:
            return run_generic(adapter, layer, original, boundaries, arguments)
        if fills_cache and isinstance(arguments.get("attention_mask"), Boundaries):
            arguments["attention_mask"] = _rows_mask(boundaries, layer)
        if isinstance(arguments.get("attention_mask"), Boundaries):
            raise ValueError(f"{type(layer).__name__} got packed boundaries that do not match its input")
        if "attention_mask" in arguments:
            arguments["attention_mask"] = _stock_mask(arguments["attention_mask"], adapter.attention, hidden.dtype)
        extra = arguments.pop("kwargs", {})
        return original(**arguments, **extra)


def dense_causal_mask(num_samples: int, length: int, device: torch.device, *, window: int | None = None,
                      additive_dtype: torch.dtype | None = None, causal: bool = True,
                      keys: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, 1, L, L]`` dense mask of a sample batch, causal unless ``causal=False`` (True / 0.0 where a query may
    attend).

    ``window``: transformers' sliding window in its attention-function convention (causal: a query sees the
    ``window`` most recent keys, itself included; bidirectional: keys less than ``window`` away).
    ``additive_dtype``: return the additive float form eager attention adds to its scores instead of bools.
    ``causal=False``: bidirectional (for a layer that would read a missing mask as causal, as transformers' sdpa
    does for a module without ``is_causal``). ``keys``: ``[n, L]`` bool, the keys that are real tokens (None: all);
    a query that then sees no key (left padding) is left so, as in transformers' own masks.
    """
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    allowed = key <= query if causal else torch.ones(length, length, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & ((key > query - window) if causal else ((key - query).abs() < window))
    allowed = allowed.expand(num_samples, 1, length, length)
    if keys is not None:
        allowed = allowed & keys[:, None, None, :]
    return allowed if additive_dtype is None else additive_mask(allowed, additive_dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: may attend) as the additive float mask eager attention adds to its scores: 0 where
    allowed, the dtype's minimum elsewhere (transformers' eager masks)."""
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
