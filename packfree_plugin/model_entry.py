"""The model entry: how every forward of a prepared model reaches packfree, however it is called.

Each ``PreTrainedModel`` packfree prepares gets one forward of its own on the instance (:class:`ModelForward`, in its
``__dict__``), so ``model(...)``, ``model.forward(...)`` (sentence-transformers, PEFT's tuners) and a parent model's
call all run the same steps, in this order:

1. **enter**: :func:`.context.enter_model` reads the batch (or takes the boundaries given or inherited) and pushes
   them: the cache switched off for a packed row, the ids injected, the labels checked, seq2seq pairing, the MRoPE
   refusal;
2. **the steps other layers add**, in the order added (:func:`add_step`): the per-sample decoder inputs of
   :mod:`.adapters.positions`, the sequence-parallel shard of :mod:`.parallel.prepare`;
3. **the call**: a head's per-sample pooling where one is set (:func:`set_call`, :mod:`.adapters.heads`), else the
   model's own forward (one set on the instance before packfree's, such as accelerate's hooks, else its class's);
4. **leave**: pop what enter pushed, even when a step or the forward raised.

``inspect.signature(model.forward)`` is the model's own forward's (Trainer's column filter and ``generate`` read
it). The class's ``forward`` is never patched, so a stock model of the same class (the gate's twin) runs untouched;
a deep copy or a pickled model binds its entry to itself. Decoder layers keep module hooks
(:func:`.context.hook_layers`): their models always call them through ``__call__``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from .context import enter_model, hook_layers, leave_model, mark_prepared, unhook_layers

__all__ = ["ModelForward", "add_step", "apply_model_hook", "has_entry", "remove_model_hook", "set_call"]

Step = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
"""``(model, args, kwargs) -> (args, kwargs)`` (None: unchanged), run after enter with the boundaries pushed."""
Call = Callable[..., Any]
"""``(model, own_forward, *args, **kwargs) -> output``: replaces the call of the model's own forward."""

_EARLIER = "_packfree_earlier_model_forward"
_STEPS = "_packfree_model_steps"
_CALL = "_packfree_model_call"


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
        return model.__dict__.get(_EARLIER) or type(model).forward.__get__(model)

    @property
    def __annotations__(self) -> dict[str, Any]:  # sentence-transformers reads the return type's fields
        return self.__wrapped__.__annotations__


def _own_forward(model: nn.Module) -> Callable:
    """The forward the model had before packfree's entry: one set on the instance earlier, else its class's."""
    earlier = model.__dict__.get(_EARLIER)
    return earlier if earlier is not None else functools.partial(type(model).forward, model)


def model_forward(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of every prepared model (the steps of the module docstring)."""
    args, kwargs = enter_model(model, args, kwargs)
    try:
        for step in model.__dict__.get(_STEPS, ()):
            changed = step(model, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        call = model.__dict__.get(_CALL)
        if call is not None:
            return call(model, _own_forward(model), *args, **kwargs)
        return _own_forward(model)(*args, **kwargs)
    finally:
        leave_model()


def has_entry(model: nn.Module) -> bool:
    """Whether ``model``'s forward is packfree's entry (directly, or under a wrapper set on the instance later)."""
    return _entry_holder(model) is not None


def _entry_holder(model: nn.Module) -> tuple[Any, str] | None:
    """``(object, attribute)`` holding ``model``'s entry: the model's ``__dict__["forward"]``, or, where accelerate's
    hooks wrapped it later, their ``_old_forward``; None without an entry."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, ModelForward):
        return model.__dict__, "forward"
    if isinstance(model.__dict__.get("_old_forward"), ModelForward):
        return model.__dict__, "_old_forward"
    return None


def _install(model: nn.Module) -> bool:
    if has_entry(model):
        return False
    if "forward" in model.__dict__:
        model.__dict__[_EARLIER] = model.__dict__["forward"]
    model.__dict__["forward"] = ModelForward(model_forward, model)
    return True


def add_step(model: nn.Module, step: Step) -> None:
    """Run ``step`` in ``model``'s entry, after the steps added before it (idempotent)."""
    steps = model.__dict__.get(_STEPS, ())
    if step not in steps:
        model.__dict__[_STEPS] = (*steps, step)


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
        holder = _entry_holder(module)
        earlier = module.__dict__.pop(_EARLIER, None)
        if holder is not None:
            owner, name = holder
            if earlier is not None:
                owner[name] = earlier
            elif name == "forward":
                del owner[name]
            else:  # accelerate's wrapper calls its _old_forward: the class's forward, bound, as accelerate keeps it
                owner[name] = functools.partial(type(module).forward, module)
        module.__dict__.pop(_STEPS, None)
        module.__dict__.pop(_CALL, None)
    unhook_layers(model)
