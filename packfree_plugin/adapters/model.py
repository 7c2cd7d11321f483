"""The model hook: build this forward's :class:`Boundaries` once and hand it to every layer.

A forward pre-hook on each ``PreTrainedModel`` in the tree reads the call's boundary inputs
(``cu_seq_lens_*``, ``seq_idx``, ``position_ids``, ``attention_mask``), builds one ``Boundaries`` and
passes it down twice: as the ``packfree_boundaries`` keyword, which transformers forwards through its
``**kwargs`` to every decoder layer, attention call and most mixers (and which gradient checkpointing
saves with the layer's inputs), and through :data:`~packfree_plugin.active.active_boundaries`, which the
mask function turns into the ``attention_mask`` every attention layer receives. Nested models reuse the
outer model's object. In models with sequence mixers, a hook on each decoder layer pushes the boundaries
it was called with, for mixers that do not receive the layer's ``**kwargs``; that hook is traced by
``torch.compile`` (no graph break per layer). Only the outermost model's hook reads the batch, a graph
break at the very start of the forward, so a compiled ``...ForCausalLM`` forward runs one graph; a caller
who passes ``packfree_boundaries`` built ahead gets no break at all (``fullgraph=True``).

Caches. Boundaries are built only while the cache holds nothing (training, scoring, prefill). A cache
filled from a packed row would mix samples' keys, so for a packed batch packfree turns ``use_cache`` off
(the model returns no cache) and refuses a cache object passed in explicitly. Once a cache holds
tokens (decoding), a packed batch is refused and unpacked calls follow transformers' own masks.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from ..active import active_boundaries
from ..boundaries import Boundaries

__all__ = ["apply_model_hook", "remove_model_hook", "boundaries_for_call"]

_HANDLES_ATTR = "_packfree_model_hook_handles"
_PUBLISHES_ATTR = "_packfree_publishes_boundaries"
_CACHE_NAMES = ("cache", "past_key_values", "cache_params", "state")  # "state": RWKV
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


@cache
def _forward_parameters(cls: type) -> tuple[inspect.Signature, str | None]:
    """Signature of ``cls.forward`` and the name of its ``**kwargs`` parameter (None if it has none)."""
    signature = inspect.signature(cls.forward)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return signature, var_keyword


def _tokens(arguments: dict[str, Any]) -> Any:
    """The call's ``input_ids``, else its ``inputs_embeds`` (``[B, T, ...]``), else None."""
    tokens = arguments.get("input_ids")
    return tokens if tokens is not None else arguments.get("inputs_embeds")


def _cache_holds_tokens(past: Any) -> bool:
    if past is None:
        return False
    try:
        return past.get_seq_length() > 0
    except (AttributeError, ValueError, TypeError, IndexError):
        return bool(getattr(past, "has_previous_state", False))


def boundaries_for_call(arguments: dict[str, Any]) -> Boundaries | None:
    """Boundaries for one forward's bound ``arguments`` (``**kwargs`` merged in), or None when decoding."""
    tokens = _tokens(arguments)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return None
    batch_size, seq_len = tokens.shape[0], tokens.shape[1]
    past = next((arguments[name] for name in _CACHE_NAMES if arguments.get(name) is not None), None)
    if _cache_holds_tokens(past):
        given = [name for name in _PACKED_KWARGS if arguments.get(name) is not None]
        if given:
            raise ValueError(
                f"a packed batch ({', '.join(given)}) was passed together with a cache that already holds tokens; "
                "packed rows cannot continue a cached sequence"
            )
        return None
    attention_mask = arguments.get("attention_mask")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        return None  # a prepared 4-D mask is the caller's own: transformers uses it as is
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
    return boundaries


def _same_tokens(boundaries: Boundaries, arguments: dict[str, Any]) -> bool:
    tokens = _tokens(arguments)
    return isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 and boundaries.describes(*tokens.shape[:2])


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Push this forward's boundaries. Traced by torch.compile, without reading the batch: boundaries passed
    as ``packfree_boundaries`` (by a parent model through its ``**kwargs``, or built ahead by the caller),
    or the parent's, for a backbone called with the same tokens and ``use_cache=False`` but no kwargs
    (Mamba's heads). Anything else reads the batch (:func:`_read_batch`, one graph break when compiled)."""
    boundaries = kwargs.get("packfree_boundaries")
    if boundaries is not None:
        active_boundaries.push(boundaries)  # first: the post-hook pops even when the check raises
        _check_given(boundaries, _call_tokens(args, kwargs))
        return args, kwargs
    boundaries = _parent_boundaries(args, kwargs)
    if boundaries is None:
        return _read_batch(module, args, kwargs)
    active_boundaries.push(boundaries)
    return args, kwargs


def _call_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The call's ``input_ids``, else ``inputs_embeds``, else its first positional argument, if ``[B, T, ...]``."""
    tokens = _tokens(kwargs)
    if tokens is None and args:
        tokens = args[0]
    return tokens if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 else None


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
    parent = active_boundaries.top()
    if parent is None or kwargs.get("use_cache") is not False:
        return None
    tokens = _call_tokens(args, kwargs)
    return parent if tokens is not None and parent.describes(*tokens.shape[:2]) else None


@torch.compiler.disable  # host-side reading of the batch: at most one graph break per forward, no guards on it
def _read_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Build the boundaries from the call's inputs and push them (pushes first: the post-hook pops even when
    the inputs are refused)."""
    active_boundaries.push(None)
    signature, var_keyword = _forward_parameters(type(module))
    takes_kwargs = var_keyword is not None
    bound = signature.bind_partial(module, *args, **kwargs).arguments
    arguments = {**bound.pop(var_keyword, {}), **bound} if takes_kwargs else dict(bound)
    outer = active_boundaries.below_top()
    # A nested model whose parent did not forward its kwargs reuses the parent's boundaries.
    boundaries = outer if outer is not None and _same_tokens(outer, arguments) else boundaries_for_call(arguments)
    if boundaries is not None:
        given_positionally = "use_cache" in bound and "use_cache" not in kwargs
        if boundaries.is_packed and not given_positionally and ("use_cache" in signature.parameters or takes_kwargs):
            kwargs["use_cache"] = False
        if takes_kwargs:
            kwargs["packfree_boundaries"] = boundaries
    active_boundaries.replace_top(boundaries)
    return args, kwargs


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Pop what the model or decoder-layer pre-hook pushed (runs even when the forward raised)."""
    active_boundaries.pop()


def _layer_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Decoder layers push the boundaries they were called with for the mixers inside, and make their
    gradient-checkpointing function carry them into the recomputation that backward runs. Traced by
    torch.compile: nothing here reads tensors or breaks the graph."""
    boundaries = kwargs.get("packfree_boundaries")
    active_boundaries.push(boundaries if boundaries is not None else active_boundaries.top())
    checkpoint = getattr(module, "_gradient_checkpointing_func", None)
    if checkpoint is not None and not hasattr(checkpoint, _PUBLISHES_ATTR):
        _wrap_checkpoint(module)


@torch.compiler.disable  # once per layer, when gradient checkpointing is first seen
def _wrap_checkpoint(module: nn.Module) -> None:
    module._gradient_checkpointing_func = _publishing_checkpoint(module._gradient_checkpointing_func)


def _publishing_checkpoint(checkpoint: Any) -> Any:
    """Wrap a checkpoint function so the checkpointed layer runs, and re-runs in backward, with the boundaries
    that were active when it was first called. (transformers checkpoints a layer's ``forward``, which module
    hooks do not see, so without this the recomputation would run the mixers on the packed row unprotected.)"""

    def publishing(function, *args, **kwargs):
        boundaries = active_boundaries.top()

        def run(*inner_args, **inner_kwargs):
            active_boundaries.push(boundaries)
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                active_boundaries.pop()

        return checkpoint(run, *args, **kwargs)

    setattr(publishing, _PUBLISHES_ATTR, True)
    return publishing


def apply_model_hook(model: nn.Module, *, layer_hooks: bool = True) -> int:
    """Hook every ``PreTrainedModel`` in ``model`` and, with ``layer_hooks``, every decoder layer (which only
    models with sequence mixers need); idempotent.
    Returns how many modules were newly hooked."""
    hooked = 0
    for module in model.modules():
        if hasattr(module, _HANDLES_ATTR):
            continue
        if isinstance(module, PreTrainedModel):
            pre_hook, post_hook = _pre_hook, _post_hook
        elif layer_hooks and isinstance(module, GradientCheckpointingLayer):
            pre_hook, post_hook = _layer_pre_hook, _post_hook
        else:
            continue
        handles = (
            module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
        )
        setattr(module, _HANDLES_ATTR, handles)
        hooked += 1
    return hooked


def remove_model_hook(model: nn.Module) -> None:
    """Undo :func:`apply_model_hook` on every module of ``model``."""
    for module in model.modules():
        for handle in module.__dict__.pop(_HANDLES_ATTR, ()):
            handle.remove()
