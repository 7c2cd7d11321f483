"""A module's forward replaced on the instance, the one way packfree does it: the model entry (:mod:`.hook`) and the
layer adapters (:mod:`packfree_plugin.mixers`, :mod:`packfree_plugin.quirks`) install ``partial(function, module)`` (``functools.partial`` or a
subclass of it: picklable; a deep copy binds to the copy) in the module's ``__dict__``, keep a forward that was set on
the instance before (accelerate's hooks) as the module's own, and put that back on :func:`uninstall`, also where
accelerate's hooks wrapped the installed forward later (they keep it as ``_old_forward``).

``tag`` keeps the attributes of one kind of replacement apart from another's, so that two kinds never read each
other's earlier forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from .signature import ForwardParameters

__all__ = ["earlier_forward", "install", "installed_as", "own_forward", "own_parameters", "uninstall"]

_PARAMETERS: dict[type, ForwardParameters] = {}
"""Module class -> parameters of its class's ``forward``."""
_WRAPPED = "_old_forward"
"""Where accelerate's hooks keep the forward they wrap."""


def _earlier(tag: str) -> tuple[str, str]:
    return f"_packfree_earlier_{tag}forward", f"_packfree_earlier_{tag}forward_parameters"


def _binds(forward: object, module: nn.Module, function: Callable) -> bool:
    """Whether ``forward`` is a partial of ``function`` bound to ``module`` alone."""
    return isinstance(forward, functools.partial) and forward.func is function and forward.args == (module,)


def installed_as(module: nn.Module, function: Callable) -> str | None:
    """The attribute of ``module``'s ``__dict__`` that holds ``function``'s installed forward: ``"forward"``, or
    ``"_old_forward"`` where accelerate's hooks wrapped it later; None where ``function`` is not installed."""
    for name in ("forward", _WRAPPED):
        if _binds(module.__dict__.get(name), module, function):
            return name
    return None


def install(module: nn.Module, function: Callable, *, tag: str = "",
            partial: type[functools.partial] = functools.partial) -> bool:
    """Make ``partial(function, module)`` the module's forward, so that a call runs ``function(module, *args,
    **kwargs)``; idempotent. Returns whether it was installed now."""
    if installed_as(module, function) is not None:
        return False
    forward_attr, parameters_attr = _earlier(tag)
    if "forward" in module.__dict__:
        module.__dict__[forward_attr] = module.__dict__["forward"]
        module.__dict__[parameters_attr] = ForwardParameters.of(module.__dict__["forward"])
    own_parameters(module, tag=tag)  # read the forward's parameters now, outside any compiled region
    module.__dict__["forward"] = partial(function, module)
    return True


def uninstall(module: nn.Module, function: Callable, *, tag: str = "") -> None:
    """Undo :func:`install` of ``function``: the forward the module had before comes back (none: its class's)."""
    name = installed_as(module, function)
    if name is None:
        return
    forward_attr, parameters_attr = _earlier(tag)
    earlier = module.__dict__.pop(forward_attr, None)
    module.__dict__.pop(parameters_attr, None)
    if earlier is not None:
        module.__dict__[name] = earlier
    elif name == "forward":
        del module.__dict__["forward"]
    else:  # accelerate's wrapper calls its _old_forward: the class's forward, bound, as accelerate keeps it
        module.__dict__[name] = functools.partial(type(module).forward, module)


def earlier_forward(module: nn.Module, *, tag: str = "") -> Callable | None:
    """The forward set on the instance before :func:`install`, None where there was none."""
    return module.__dict__.get(_earlier(tag)[0])


def own_forward(module: nn.Module, *, tag: str = "") -> Callable:
    """The module's forward as it was before :func:`install`: one set on the instance earlier, else its class's."""
    earlier = earlier_forward(module, tag=tag)
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
