"""Sequence-classification and reward heads on packed rows: one pooled output per sample.

Stock heads pool one token per row: decoders their row's last non-padding token, encoders its first token
(``[CLS]``). On a packed row that would be one output for several samples, pooled from the last sample (or
from the first). Packfree pools per sample instead, so ``logits`` are ``[n, num_labels]`` for the ``n`` samples
of the batch (row-major, padding spans skipped) and ``labels`` are ``[n]``:

- **last-token heads** (a per-token ``score`` linear layer over the base model, the decoder heads of
  transformers): the base model runs on the packed rows, and ``score`` is applied to each sample's rightmost
  token that is not ``pad_token_id`` (its first token if all are), as stock does for a sample alone;
- **first-token heads** (encoders): the head's own forward runs, and the sequence output it pools from (the
  base model's pooler input and its ``last_hidden_state``) holds one token per sample, ``[n, 1, H]``.

Unpacked calls (one sample per row, padded or not) run the head's own forward untouched. Whether a head
pools exactly this way is not assumed: the sweep and the load-time proof (:mod:`packfree_plugin.gate`) check
every head class against each sample alone on stock, and refuse those that do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..boundaries import Boundaries
from ..forward.context import boundaries_here
from ..forward.hook import set_call
from ..forward.signature import class_forward_parameters

__all__ = ["first_token_index", "last_token_index", "unwrap_heads", "wrap_heads"]

_HOOKED = "_packfree_head_hooks"


def _sample_starts(boundaries: Boundaries) -> list[int]:
    return [start for start, pad in zip(boundaries.offsets[:-1], boundaries.padding) if not pad]


def first_token_index(boundaries: Boundaries, device: torch.device) -> torch.Tensor:
    """``[n]`` flat token index (over ``B * T``) of every sample's first token."""
    return torch.tensor(_sample_starts(boundaries), dtype=torch.long, device=device)


def last_token_index(boundaries: Boundaries, input_ids: torch.Tensor | None, pad_token_id: int | None) -> torch.Tensor:
    """``[n]`` flat index of every sample's rightmost token that is not ``pad_token_id`` (the sample's first
    token when all are; its last token without ``input_ids`` or ``pad_token_id``), on ``input_ids``' device."""
    samples = [(start, start + length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    device = input_ids.device if input_ids is not None else boundaries.device
    ends = torch.tensor([end - 1 for _, end in samples], dtype=torch.long, device=device)
    if input_ids is None or pad_token_id is None:
        return ends
    starts = torch.tensor([start for start, _ in samples], dtype=torch.long, device=device)
    flat = input_ids.reshape(-1)
    segment = boundaries.seq_idx.reshape(-1).to(device=device, dtype=torch.long)
    keep = ~boundaries.host_padding.to(device)
    token_index = torch.arange(flat.numel(), device=device)
    real = (flat != pad_token_id) & keep[segment]
    rightmost = torch.full((boundaries.num_segments,), -1, dtype=torch.long, device=device)
    rightmost = rightmost.scatter_reduce(0, segment[real], token_index[real], reduce="amax")
    found = rightmost[keep]
    return torch.where(found >= 0, found, starts)


def _pool(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[n, 1, ...]``: the tokens at flat ``index``."""
    return hidden.reshape(-1, *hidden.shape[2:])[index].unsqueeze(1)


def _packed(hidden: Any) -> Boundaries | None:
    """The forward's boundaries when they pack several samples into a row of ``hidden [B, T, ...]``."""
    if not isinstance(hidden, torch.Tensor) or hidden.ndim < 3:
        return None
    return boundaries_here(rows=hidden, packed=True)


def _pooler_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A pooler that reads ``hidden_states[:, 0]`` reads every sample's first token instead."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    boundaries = _packed(hidden)
    if boundaries is None:
        return None
    pooled = _pool(hidden, first_token_index(boundaries, hidden.device))
    return ((pooled, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": pooled})


def _sequence_output_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """The sequence output a head pools from holds every sample's first token, ``[n, 1, H]``."""
    hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", None)
    boundaries = _packed(hidden)
    if boundaries is None:
        return None
    pooled = _pool(hidden, first_token_index(boundaries, hidden.device))
    if isinstance(output, tuple):
        return (pooled, *output[1:])
    output.last_hidden_state = pooled
    return output


def _unwrapped(module: nn.Module | None) -> nn.Module | None:
    """The layer under a PEFT wrapper (LoRA's ``get_base_layer()``, ``modules_to_save``'s ``original_module``), which
    is no ``nn.Linear`` itself; any other module as it is."""
    get_base_layer = getattr(module, "get_base_layer", None)
    if callable(get_base_layer):
        return get_base_layer()
    original = getattr(module, "original_module", None)
    return original if isinstance(original, nn.Module) else module


def _is_last_token_head(model: nn.Module) -> bool:
    """Whether ``model`` pools the last token into ``model.score`` (a linear layer, PEFT-wrapped or not: a wrapped one
    taken for another head would pool once per packed row, one score for every sample)."""
    return isinstance(_unwrapped(getattr(model, "score", None)), nn.Linear) and model.base_model is not model


def _hook_first_token_head(model: nn.Module) -> None:
    base = model.base_model
    pooler = getattr(base, "pooler", None)
    handles = []
    if isinstance(pooler, nn.Linear):  # it is given hidden[:, 0] (ALBERT): the encoder's output must hold the tokens
        encoder = getattr(base, "encoder", None)
        if encoder is None:
            return
        handles.append(encoder.register_forward_hook(_sequence_output_hook, with_kwargs=True))
    elif isinstance(pooler, nn.Module):
        handles.append(pooler.register_forward_pre_hook(_pooler_pre_hook, with_kwargs=True))
    handles.append(base.register_forward_hook(_sequence_output_hook, with_kwargs=True))
    setattr(model, _HOOKED, tuple(handles))


def _labels_per_sample(labels: Any, boundaries: Boundaries, name: str) -> None:
    samples = boundaries.num_segments - sum(boundaries.padding)
    if isinstance(labels, torch.Tensor) and (labels.ndim == 0 or labels.shape[0] != samples):
        raise ValueError(
            f"{name} pools one output per packed sample: the batch holds {samples} samples, so labels must be "
            f"[{samples}] (or [{samples}, num_labels]), got {list(labels.shape)}"
        )


def _head_forward(model: nn.Module, forward: Callable, *args, **kwargs):
    """A wrapped head's call in its model entry (:func:`packfree_plugin.forward.hook.set_call`; ``forward``: the
    head's own)."""
    boundaries = boundaries_here(kwargs, packed=True)
    if boundaries is None:
        return forward(*args, **kwargs)
    parameters = class_forward_parameters(type(model))
    arguments = parameters.bind((model, *args), kwargs)
    arguments.pop("self", None)
    _labels_per_sample(arguments.get("labels"), boundaries, type(model).__name__)
    if not _is_last_token_head(model):
        return forward(*args, **kwargs)
    return _last_token_forward(model, boundaries, arguments, parameters.var_keyword)


def _last_token_forward(model: nn.Module, boundaries: Boundaries, arguments: dict[str, Any],
                        var_keyword: str | None) -> Any:
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    extra = arguments.pop(var_keyword, {}) if var_keyword else {}
    labels = arguments.pop("labels", None)
    return_dict = arguments.pop("return_dict", None)
    outputs = model.base_model(**arguments, **extra)
    hidden = outputs[0]
    input_ids = arguments.get("input_ids")
    pad_token_id = model.config.get_text_config().pad_token_id
    index = last_token_index(boundaries, input_ids, pad_token_id).to(hidden.device)
    logits = model.score(hidden.reshape(-1, hidden.shape[-1])[index])
    loss = None
    if labels is not None:
        loss = model.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=model.config)
    result = SequenceClassifierOutputWithPast(
        loss=loss, logits=logits, hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return result.to_tuple() if return_dict is False else result


def _is_sequence_head(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def wrap_heads(model: nn.Module) -> int:
    """Give every sequence-classification head in ``model`` per-sample pooling (idempotent); returns how many."""
    wrapped = 0
    for module in model.modules():
        if not _is_sequence_head(module) or getattr(module, "base_model", module) is module:
            continue
        if not _is_last_token_head(module) and not hasattr(module, _HOOKED):
            _hook_first_token_head(module)
        set_call(module, _head_forward)
        wrapped += 1
    return wrapped


def unwrap_heads(model: nn.Module) -> None:
    """Remove the hooks :func:`wrap_heads` added (the calls go with the model entries)."""
    for module in model.modules():
        for handle in module.__dict__.pop(_HOOKED, ()):
            handle.remove()
