"""Binding a forward's call to its parameters without ``inspect`` at call time (which torch.compile cannot trace),
and the tensors in a call's arguments. The bottom floor: models (:mod:`.hook`), mixers (:mod:`packfree_plugin.mixers`) and
sequence parallelism (:mod:`.parallel`) read their calls with it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

__all__ = ["ForwardParameters", "class_forward_parameters", "tensor_leaves", "with_argument", "without_cache"]


@dataclass(frozen=True)
class ForwardParameters:
    """A forward's parameters, read once per class (or instance forward), so that binding a call is plain dict
    work, which torch.compile traces (``inspect`` is not traceable). Used for models here and for mixers in
    :mod:`.mixers.entry`."""

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


def with_argument(parameters: ForwardParameters, args: tuple, kwargs: dict[str, Any], name: str,
                  value: Any) -> tuple[tuple, dict[str, Any]]:
    """A call's ``args`` (``self`` not among them) and ``kwargs`` with argument ``name`` set to ``value``: in its place
    where the caller passed it positionally, else by keyword; unchanged for a forward with neither such a parameter
    nor ``**kwargs``."""
    if name in parameters.names:
        index = parameters.names.index(name) - 1  # without self
        if index < len(args):
            return (*args[:index], value, *args[index + 1:]), kwargs
    if name in parameters.names or parameters.var_keyword is not None:
        return args, {**kwargs, name: value}
    return args, kwargs


def without_cache(parameters: ForwardParameters, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A call's ``args`` and ``kwargs`` with ``use_cache=False`` (:func:`with_argument`)."""
    return with_argument(parameters, args, kwargs, "use_cache", False)


@cache
def class_forward_parameters(cls: type) -> ForwardParameters:
    """Parameters of ``cls.forward``, ``self`` included; read once per class."""
    return ForwardParameters.of(cls.forward)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a tree of tuples, lists and dicts, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in tensor_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tensor_leaves(item)]
    return []

