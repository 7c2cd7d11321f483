"""The per-thread stack of boundaries: the one channel to every consumer that transformers' ``**kwargs`` do not
reach (a mixer, a position module, a mask or attention function, a routed kernel), read through
:func:`boundaries_here` (or :func:`current`). The entries that fill it (a model forward, a decoder layer, its
gradient-checkpoint recomputation) live in :mod:`.hook`; a native mixer call pushes the boundaries it runs on where
they differ from the top (:mod:`packfree_plugin.mixers.seam`).

The stack lives on a ``threading.local`` rather than in a ``ContextVar``: Dynamo traces reads and pushes
of the former and breaks the graph on the latter, and these reads happen in every layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..boundaries import Boundaries

__all__ = [
    "boundaries_here",
    "current",
    "enter_layer",
    "enter_mixer",
    "fits",
    "in_prepared_forward",
    "is_prepared",
    "kept_on",
    "leave_layer",
    "mark_prepared",
    "pop",
    "push",
    "push_unless_on_top",
    "stack_depth",
]


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.items: list[Boundaries | None] = []
        self.layers_pushed: list[bool] = []


_STACK = _PerThread()
"""The one per-thread stack: the boundaries of the model forward (or of a decoder layer or nested model whose
boundaries differ from the enclosing one's) in progress (None: a call that packs nothing, e.g. decoding); beside it,
which hooked layers pushed."""


def push(entry: Boundaries | None) -> None:
    """Push an entry (pair with :func:`pop` in a ``finally``)."""
    _STACK.items.append(entry)


def pop() -> None:
    """Pop the innermost entry."""
    _STACK.items.pop()


def push_unless_on_top(entry: Boundaries | None) -> bool:
    """Push ``entry`` unless it is already in effect (the top of a non-empty stack); returns whether it pushed. A
    forward pushes its boundaries once: the layers and nested models that run on the same ones push nothing."""
    items = _STACK.items
    if items and items[-1] is entry:
        return False
    items.append(entry)
    return True


def enter_layer(boundaries: Boundaries | None) -> None:
    """A hooked decoder layer starts on ``boundaries`` (pair with :func:`leave_layer`, which module hooks call even
    when the layer raised)."""
    _STACK.layers_pushed.append(push_unless_on_top(boundaries))


def leave_layer() -> None:
    if _STACK.layers_pushed.pop():
        pop()


def stack_depth() -> int:
    """How many entries the stack holds on this thread."""
    return len(_STACK.items)


def current() -> Boundaries | None:
    """The boundaries in effect on this thread (None outside a packfree forward, or while decoding)."""
    items = _STACK.items
    return items[-1] if items else None


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


_Fact = TypeVar("_Fact")


def kept_on(module: nn.Module, name: str, read: Callable[[], _Fact]) -> _Fact:
    """``read()``, kept in ``module.__dict__[name]`` after its first call outside compiled graphs: a fact of the
    module's class or config (fixed once the model is built) that would otherwise be read in every call of a layer
    or forward. ``read`` must not return None (None means not kept yet)."""
    known = module.__dict__.get(name)
    if known is not None:
        return known
    fact = read()
    if not torch.compiler.is_compiling():
        module.__dict__[name] = fact
    return fact


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
    boundaries = given if given is not None else current()
    if boundaries is None or (packed and not boundaries.is_packed):
        return None
    if length is not None and length != boundaries.seq_len:
        return None
    if rows is not _ANY_ROWS and not fits(boundaries, rows):
        return None
    return boundaries


def enter_mixer(kwargs: dict[str, Any], *, rows: Any) -> tuple[Boundaries | None, bool]:
    """A covered mixer starts: its boundaries (:func:`boundaries_here` of its ``kwargs`` and input ``rows``), put in
    effect on the stack for what it calls (its routed kernel functions read the top), and whether that pushed them
    (pair a True with :func:`pop` in a ``finally``)."""
    boundaries = boundaries_here(kwargs, rows=rows)
    return boundaries, boundaries is not None and push_unless_on_top(boundaries)


def fits(boundaries: Boundaries, tokens: Any) -> bool:
    """Whether ``tokens`` is a row of tokens that ``boundaries`` describe: a ``(B, T)`` pair, ``[B, T]`` ids or
    ``[B, T, D]`` embeddings. A 2-D float tensor is a tower's ``[N, D]`` patches or frames, never a row, even where its
    shape happens to equal the text rows' (16 Qwen-VL patches of 1176 values against 16 rows of 1176 tokens)."""
    if isinstance(tokens, tuple) and len(tokens) == 2:
        return boundaries.describes(*tokens)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2 or (tokens.ndim == 2 and tokens.is_floating_point()):
        return False
    return boundaries.describes(*tokens.shape[:2])

