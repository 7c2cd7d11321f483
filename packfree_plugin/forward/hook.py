"""The model entry: how every forward of a prepared model reaches packfree, however it is called.

Each ``PreTrainedModel`` packfree prepares gets one forward of its own on the instance (:class:`ModelForward`, in its
``__dict__``), so ``model(...)``, ``model.forward(...)`` (sentence-transformers, PEFT's tuners) and a parent model's
call all run the same steps, in this order:

1. **enter**: :func:`enter_model` reads the batch (or takes the boundaries given or inherited) and pushes
   them, once per forward (a nested model or decoder layer on the same boundaries pushes nothing): the cache
   switched off for a packed row, the ids injected (an MRoPE model's packed samples with images numbered each by
   its own ``get_rope_index``, or refused), the labels checked, seq2seq pairing, the checks layers above add
   (:func:`add_read_check`: torch's context parallelism refused);
2. **the steps other layers add**, in the order added (:func:`add_step`): the per-sample decoder inputs of
   :mod:`packfree_plugin.quirks.decoder_inputs`, the sequence-parallel shard of :mod:`packfree_plugin.parallel.setup`;
3. **the call**: a head's per-sample pooling where one is set (:func:`set_call`,
   :mod:`packfree_plugin.quirks.task_heads`), else the
   model's own forward (one set on the instance before packfree's, such as accelerate's hooks, else its class's);
4. **leave**: the outermost entry leaves the batch's boundaries and loss weights (taken out of the call before
   enter) on the output for :mod:`packfree_plugin.loss` (:mod:`.loss_inputs`); pop what enter pushed, if anything,
   even when a step or the forward raised.

``inspect.signature(model.forward)`` is the model's own forward's (Trainer's column filter and ``generate`` read
it). The class's ``forward`` is never patched, so a stock model of the same class (the gate's twin) runs untouched;
a deep copy or a pickled model binds its entry to itself. Decoder layers keep module hooks
(:func:`hook_layers`): their models always call them through ``__call__``; a layer's pre-hook puts the boundaries it
was called with in effect for the mixers inside (pushing only where they differ from the forward's), and its
gradient-checkpointing function carries them into the recomputation.

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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..boundaries import Boundaries, Seq2SeqBoundaries, TwoWayBlocks, close_batch
from .context import (boundaries_here, current, enter_layer, fits, in_prepared_forward, leave_layer, mark_prepared,
                      pop, push, push_unless_on_top)
from .keywords import CACHE_ARGUMENTS, PACKFREE_KWARGS
from .loss_inputs import keep_loss_inputs, keep_outside_graph, take_loss_weights
from .reading import boundaries_for_call, tokens_of
from .rope_ids import rope_ids_for_call, rope_reads
from .encoder_decoder import DECODER_POSITION_IDS, pair_seq2seq, paired_decoder
from .instance import earlier_forward, install, installed_as, own_forward, uninstall
from .signature import class_forward_parameters, with_argument, without_cache

__all__ = ["ModelForward", "add_read_check", "add_step", "apply_model_hook", "enter_model", "has_entry", "hook_layers",
           "leave_targets_to_a_step", "remove_model_hook", "set_call", "unhook_layers"]

Step = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
"""``(model, args, kwargs) -> (args, kwargs)`` (None: unchanged), run after enter with the boundaries pushed."""
Call = Callable[..., Any]
"""``(model, own_forward, *args, **kwargs) -> output``: replaces the call of the model's own forward."""
ReadCheck = Callable[[Boundaries], None]
"""``(boundaries) -> None``: raises for boundaries the entry must not run on."""

_TAG = "model_"
"""Keeps the entry's earlier forward apart from the layer adapters' (:mod:`.instance`)."""
_STEPS = "_packfree_model_steps"
_CALL = "_packfree_model_call"
_TARGETS_CHECKED_BY_STEP = "_packfree_targets_checked_by_step"
_HANDLES_ATTR = "_packfree_layer_hook_handles"
_CARRIES_ATTR = "_packfree_carries_boundaries"
_LAYERS_ATTR = "_packfree_hooked_layers"
_READ_CHECKS: list[ReadCheck] = []
"""What every entry runs on the boundaries it reads, before it pushes them (:func:`add_read_check`)."""


class ModelForward(functools.partial):
    """``ModelForward(model_forward, model)``: a prepared model's instance forward. A partial (picklable; a deep copy
    binds to the copy; torch.compile traces it like any partial) whose signature is the model's own forward's."""

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__wrapped__)

    @property
    def __wrapped__(self) -> Callable:
        """The model's own forward, bound (what ``typing.get_type_hints`` and ``functools`` unwrapping read)."""
        model = self.args[0]
        return earlier_forward(model, tag=_TAG) or type(model).forward.__get__(model)

    @property
    def __annotations__(self) -> dict[str, Any]:  # sentence-transformers reads the return type's fields
        return self.__wrapped__.__annotations__


def model_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of every prepared model (the steps of the module docstring); the outermost one takes the batch's
    loss weights out of the call and leaves them, with its boundaries, on the output (:mod:`.loss_inputs`)."""
    outermost = not in_prepared_forward()
    weights = take_loss_weights(kwargs) if outermost else {}
    args, kwargs, pushed = enter_model(model, args, kwargs)
    try:
        for step in model.__dict__.get(_STEPS, ()):
            changed = step(model, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        call = model.__dict__.get(_CALL)
        own = own_forward(model, tag=_TAG)
        output = call(model, own, *args, **kwargs) if call is not None else own(*args, **kwargs)
        if outermost and not torch.compiler.is_compiling():
            keep_loss_inputs(output, current(), _call_tokens(args, kwargs), weights, kwargs)
        elif outermost and weights:  # compiled: only for weights, which would be lost (a graph break)
            keep_outside_graph(output, current(), _call_tokens(args, kwargs), weights, kwargs)
        return output
    finally:
        if pushed:
            pop()
        if outermost:
            close_batch()


def has_entry(model: nn.Module) -> bool:
    """Whether ``model``'s forward is packfree's entry (directly, or under a wrapper set on the instance later)."""
    return installed_as(model, model_forward) is not None


def _install(model: nn.Module) -> bool:
    return install(model, model_forward, tag=_TAG, partial=ModelForward)


def add_step(model: nn.Module, step: Step) -> None:
    """Run ``step`` in ``model``'s entry, after the steps added before it (idempotent)."""
    steps = model.__dict__.get(_STEPS, ())
    if step not in steps:
        model.__dict__[_STEPS] = (*steps, step)


def add_read_check(check: ReadCheck) -> None:
    """Run ``check`` on the boundaries of every batch an entry reads, before they are pushed (idempotent): refusals
    that layers above the entry own, such as :mod:`.parallel.torch_cp`'s, which :func:`packfree_plugin.apply` adds."""
    if check not in _READ_CHECKS:
        _READ_CHECKS.append(check)


def leave_targets_to_a_step(model: nn.Module) -> None:
    """Let a step added to ``model`` check its packed rows' ``labels`` / ``shift_labels`` instead of the entry: a
    sequence-parallel shard's step reads the whole row on every rank alike, where the entry's check of one shard would
    refuse on one rank only and leave the others waiting in a collective."""
    model.__dict__[_TARGETS_CHECKED_BY_STEP] = True


def set_call(model: nn.Module, call: Call) -> None:
    """Make ``call(model, own_forward, *args, **kwargs)`` what ``model``'s entry runs in place of its own forward."""
    model.__dict__[_CALL] = call


def apply_model_hook(model: nn.Module, *, layer_hooks: bool = True) -> int:
    """Give every ``PreTrainedModel`` in ``model`` packfree's entry and, with ``layer_hooks``, hook every decoder
    layer (which only models with sequence mixers or layer-level position biases need); idempotent. Returns how many
    modules were newly prepared."""
    from transformers import PreTrainedModel  # here: registration imports this module while transformers imports

    entered = sum(_install(module) for module in model.modules() if isinstance(module, PreTrainedModel))
    mark_prepared(model)
    return entered + (hook_layers(model) if layer_hooks else 0)


def remove_model_hook(model: nn.Module) -> None:
    """Undo :func:`apply_model_hook` on ``model``: every entry, step, call and layer hook removed, the forwards set on
    instances before packfree's restored."""
    for module in model.modules():
        uninstall(module, model_forward, tag=_TAG)
        module.__dict__.pop(_STEPS, None)
        module.__dict__.pop(_CALL, None)
        module.__dict__.pop(_TARGETS_CHECKED_BY_STEP, None)
    unhook_layers(model)


# ------------------------------------------------------------------------------------ model entry
def enter_model(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Put this forward's boundaries in effect and return the call's arguments as the model's forward must see them,
    and whether it pushed them (a nested model on its parent's boundaries pushes nothing; pop what it pushed after
    the call; it pushes nothing when it raises). Run by every prepared
    model's forward (:func:`model_forward`). Traced by torch.compile, without reading the batch: boundaries passed
    as ``packfree_boundaries`` (by a parent model through its ``**kwargs``, or built ahead by the caller),
    or the parent's, for a backbone called with the same tokens and ``use_cache=False`` but no kwargs
    (Mamba's heads). Anything else reads the batch (:func:`_read_batch`, one graph break when compiled); a decode
    step (:func:`_decode_step`) reads nothing and pushes None."""
    if len(args) <= 1 and not torch.compiler.is_compiling() and _decode_step(args, kwargs):
        return args, kwargs, push_unless_on_top(None)
    if isinstance(kwargs.get("attention_mask"), TwoWayBlocks):
        # an outer model's two-way mask handed to its inner model (PaliGemma's to its Gemma), whose mask helpers read
        # a tensor: its dense form, already cut to each sample, which the inner model passes on as it is
        kwargs = {**kwargs, "attention_mask": kwargs["attention_mask"].dense_mask()}
    if isinstance(kwargs.get("attention_mask"), Boundaries):
        # an outer model built packfree's mask and hands it to its inner model (PaliGemma to its Gemma): the inner
        # model takes it as its boundaries and makes its own mask from them (transformers' mask helpers read an
        # attention_mask as a tensor)
        mask = kwargs["attention_mask"]
        kwargs = {**kwargs, "attention_mask": None}
        if class_forward_parameters(type(module)).var_keyword is None:
            _check_given(mask, _call_tokens(args, kwargs))
            return args, kwargs, push_unless_on_top(mask)
        kwargs.setdefault("packfree_boundaries", mask)
    boundaries = kwargs.get("packfree_boundaries")
    if boundaries is not None:
        tokens = _call_tokens(args, kwargs)
        if in_prepared_forward() and isinstance(boundaries, Boundaries) and not _inherits(boundaries, tokens, kwargs):
            # a nested model with inputs of its own (a vision tower, a seq2seq decoder) got its parent's
            # boundaries through the **kwargs: it gets boundaries from its own inputs, or none
            kwargs = {name: value for name, value in kwargs.items() if name != "packfree_boundaries"}
            return _read_batch(module, args, kwargs)
        _check_given(boundaries, tokens)
        if not in_prepared_forward():  # built ahead by the caller, whose ids these are
            boundaries.callers_position_ids = kwargs.get("position_ids")
        return args, kwargs, push_unless_on_top(boundaries)
    boundaries = _parent_boundaries(args, kwargs)
    if boundaries is None:
        return _read_batch(module, args, kwargs)
    return args, kwargs, push_unless_on_top(boundaries)


def _decode_step(args: tuple, kwargs: dict) -> bool:
    """Whether a call is a decode step: one token per row (``input_ids`` or ``inputs_embeds`` ``[B, 1, ...]``, by
    keyword or first positional argument, as Mamba's heads call their backbone), a cache given by keyword, no
    boundary keyword. A row of one token is one sample: there is nothing to pack,
    so the step builds, reads and checks no boundaries and runs on transformers' own masks, as stock (which is what
    reading the batch concludes for it, at the cost of binding the call and walking the cache's layers). Not asked
    while compiling: its shape test would add a graph of its own to every compiled forward."""
    tokens = _call_tokens(args, kwargs)
    if tokens is None or tokens.shape[1] != 1 or isinstance(kwargs.get("attention_mask"), Boundaries):
        return False
    for name in PACKFREE_KWARGS:  # loops, not any()/all(): this runs twice per generated token
        if kwargs.get(name) is not None:
            return False
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return True
    return False


def _call_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The call's ``input_ids``, else ``inputs_embeds``, else its first positional argument, if ``[B, T, ...]``."""
    tokens = tokens_of(kwargs)
    if tokens is None and args:
        tokens = args[0]
    return tokens if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 else None


def _inherits(boundaries: Boundaries, tokens: Any, arguments: dict[str, Any]) -> bool:
    """Whether a nested model called with ``tokens`` and ``arguments`` runs on its enclosing model's ``boundaries``:
    they must fit its tokens, and a seq2seq decoder (called with ``encoder_hidden_states``) takes them only when they
    pack samples. The encoder's padding is not the decoder's: stock decoders mask by their own
    ``decoder_attention_mask``, or causally alone."""
    if not fits(boundaries, tokens):
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
    parent = current()
    if parent is None or kwargs.get("use_cache") is not False:
        return None
    return parent if _inherits(parent, _call_tokens(args, kwargs), kwargs) else None


@torch.compiler.disable  # host-side reading of the batch: at most one graph break per forward, no guards on it
def _read_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """Build the boundaries from the call's inputs and put them in effect (nothing is pushed when the inputs are
    refused); returns the arguments and whether it pushed."""
    outer = current()
    if module.training and torch.is_grad_enabled():
        _carry_in_layers(module)
    seq2seq = bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))
    decoder_position_ids = kwargs.pop(DECODER_POSITION_IDS, None) if seq2seq else None
    parameters = class_forward_parameters(type(module))
    takes_kwargs = parameters.var_keyword is not None
    bound = parameters.bind((module, *args), kwargs)
    arguments = {**bound.pop(parameters.var_keyword, {}), **bound} if takes_kwargs else dict(bound)
    # A nested model whose parent did not forward its kwargs reuses the parent's boundaries.
    inherited = outer is not None and _inherits(outer, tokens_of(arguments), arguments)
    boundaries = outer if inherited else paired_decoder(outer, arguments, kwargs)
    if boundaries is None:
        checks_targets = not seq2seq and not module.__dict__.get(_TARGETS_CHECKED_BY_STEP)
        boundaries = boundaries_for_call(arguments, causal_labels=checks_targets,
                                         reads_position_ids="position_ids" in parameters.names,
                                         also_read=rope_reads(module, arguments))
        if boundaries is not None and outer is None:  # the outermost call's ids are the caller's
            boundaries.callers_position_ids = arguments.get("position_ids")
    rope_ids = rope_ids_for_call(module, arguments, boundaries)  # after the shapes were checked, and the one read
    if seq2seq:
        pair_seq2seq(module, arguments, boundaries, decoder_position_ids)
    if boundaries is not None:
        if boundaries.is_packed:
            args, kwargs = without_cache(parameters, args, kwargs)
        if takes_kwargs:
            kwargs["packfree_boundaries"] = boundaries
        if rope_ids is not None:  # each packed sample's own multimodal positions, in place of the batch's
            args, kwargs = with_argument(parameters, args, kwargs, "position_ids", rope_ids)
        elif boundaries.is_packed and arguments.get("position_ids") is None and "position_ids" in parameters.names:
            # boundaries from cu_seq_lens / seq_idx alone: positions restart in every sample, as each sample alone
            # would number them (the model would otherwise count 0..T-1 across the row)
            kwargs["position_ids"] = boundaries.position_ids
    if boundaries is not None:
        for check in _READ_CHECKS:
            check(boundaries)
    return args, kwargs, push_unless_on_top(boundaries)


# ------------------------------------------------------------------------------------ layer hooks
def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Pop what the decoder-layer pre-hook pushed, if anything (runs even when the forward raised)."""
    leave_layer()


def _layer_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Decoder layers put the boundaries they were called with in effect for the mixers inside (pushed only where
    they differ from the forward's), and make their gradient-checkpointing function carry them into the
    recomputation that backward runs. Traced by torch.compile: nothing here reads tensors or breaks the graph."""
    enter_layer(boundaries_here(kwargs))
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
        boundaries = current()

        def run(*inner_args, **inner_kwargs):
            push(boundaries)
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                pop()

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

