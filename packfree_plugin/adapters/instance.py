"""A module's forward replaced on the instance: packfree's mixer and position adapters install
``functools.partial(function, module)`` in the module's ``__dict__`` (picklable; a deep copy binds to the copy), and
keep a forward that was set on the instance before (accelerate's hooks) as the module's own.

``tag`` keeps the attributes of one kind of replacement apart from another's, so that two kinds never read each
other's earlier forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from ..forward.signature import ForwardParameters

__all__ = ["install", "own_forward", "own_parameters", "replaced_by", "uninstall"]

_PARAMETERS: dict[type, ForwardParameters] = {}
"""Module class -> parameters of its class's ``forward``."""


def _earlier(tag: str) -> tuple[str, str]:
    return f"_packfree_earlier_{tag}forward", f"_packfree_earlier_{tag}forward_parameters"


def replaced_by(module: nn.Module) -> Callable | None:
    """The function installed as ``module``'s forward by :func:`install`, None if there is none."""
    forward = module.__dict__.get("forward")
    return forward.func if isinstance(forward, functools.partial) and forward.args == (module,) else None


def install(module: nn.Module, function: Callable, *, tag: str = "") -> None:
    """Make ``function(module, *args, **kwargs)`` the module's forward (idempotent)."""
    if replaced_by(module) is function:
        return
    forward_attr, parameters_attr = _earlier(tag)
    if "forward" in module.__dict__:
        module.__dict__[forward_attr] = module.__dict__["forward"]
        module.__dict__[parameters_attr] = ForwardParameters.of(module.__dict__["forward"])
    own_parameters(module, tag=tag)  # read the forward's parameters now, outside any compiled region
    module.forward = functools.partial(function, module)


def uninstall(module: nn.Module, function: Callable, *, tag: str = "") -> None:
    """Undo :func:`install` of ``function``: the forward the module had before comes back (none: its class's)."""
    if replaced_by(module) is not function:
        return
    forward_attr, parameters_attr = _earlier(tag)
    earlier = module.__dict__.pop(forward_attr, None)
    module.__dict__.pop(parameters_attr, None)
    if earlier is not None:
        module.__dict__["forward"] = earlier
    else:
        del module.__dict__["forward"]


def own_forward(module: nn.Module, *, tag: str = "") -> Callable:
    """The module's forward as it was before :func:`install`: one set on the instance earlier, else its class's."""
    earlier = module.__dict__.get(_earlier(tag)[0])
    return earlier if earlier is not None else functools.partial(type(module).forward, module)


def own_parameters(module: nn.Module, *, tag: str = "") -> ForwardParameters:
    """Parameters of :func:`own_forward`, read once per class (or per instance forward)."""
    earlier = module.__dict__.get(_earlier(tag)[1])
    if earlier is not None:
        return earlier
    parameters = _PARAMETERS.get(type(module))
    if parameters is None:  # also a model unpickled in a new process: its classes were never prepared here
        parameters = _PARAMETERS[type(module)] = ForwardParameters.of(functools.partial(type(module).forward, module))
    return parameters
