"""The native tier: a mixer's own forward on the packed rows, with the kernel functions it calls routed to its
family's ops.

transformers builds its Mamba, Mamba2, Gated DeltaNet, KDA and short-conv layers around a fixed set of module-level
kernel functions (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ...). Each family
names them, with their routes, in its op folder (``ops/<family>/family.py``, :class:`~packfree_plugin.ops.family.
MixerFamily`); :func:`install_routes` routes them in the modeling module of every class whose entry names that
family: through ``kernels.kernelize`` and a kernel mapping where transformers declares the function as a kernel seam
(:func:`packfree_plugin.compat.kernel_seam`), else by wrapping the module function. Outside :func:`native_forward` a
routed function is transparent (it calls the original). Inside one, it runs its route on the boundaries in effect
(the stack's top: :func:`packfree_plugin.forward.context.current`, the one channel), which calls the family's op; the
op picks the CUDA kernel (causal-conv1d, mamba-ssm, fla) where one can run.

Rules that keep this from ever being silently wrong: fused whole-layer kernels decline under packing, so the layer
takes its split path where each step is routed; decoding kernels and any cache state raise; a native call in which
the layer routed none of its mixing raises (the layer mixes tokens some other way and needs the per-sample tier).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .. import compat
from ..boundaries import Boundaries
from ..classes import CLASSES
from ..forward.context import current, stack_depth
from ..forward.keywords import CACHE_ARGUMENTS, PACKFREE_KWARGS
from ..ops.family import KernelRoute, MixerFamily, families

__all__ = ["PackfreeRoutes", "install_routes", "is_routed", "native_forward", "native_tier", "routed_functions",
           "routed_kernels_of", "running_layer", "uninstall_routes"]

_PREFIX = "transformers.models."
_ROUTED_ATTR = "_packfree_routed_original"


@functools.cache
def routed_functions() -> dict[str, dict[str, KernelRoute]]:
    """Modeling module (under ``transformers.models``) -> {function: its route}: the routes of the family of every
    class entry that names its modeling module (two families routing one module raise)."""
    routed: dict[str, dict[str, KernelRoute]] = {}
    owner: dict[str, str] = {}
    for name, entry in CLASSES.items():
        if entry.modeling is None:
            continue
        family = families()[entry.mixer]
        if owner.setdefault(entry.modeling, family.name) != family.name:
            raise ValueError(f"{name}: {entry.modeling} is routed by {owner[entry.modeling]} already")
        routed[entry.modeling] = dict(family.routes)
    return routed


class _NativeCall(threading.local):
    """The native call in progress on this thread: its layer, the stack depth its boundaries sit at, and how many of
    its kernel calls took a route that mixes (a tally, not a carrier: the boundaries are the stack's)."""

    def __init__(self) -> None:
        self.layer: str | None = None
        self.depth = -1
        self.mixed = 0


_CALL = _NativeCall()


def running_layer() -> str | None:
    """The class name of the layer whose native call is in progress on this thread (None: none is)."""
    return _CALL.layer


def _route(route: KernelRoute, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` outside a native call (or inside something it started on other boundaries);
    inside one, ``route`` on the boundaries in effect."""
    if _CALL.layer is None or stack_depth() != _CALL.depth:
        return original(*args, **kwargs)
    _CALL.mixed += route.mixes
    return route.run(current(), _CALL.layer, *args, **kwargs)


def native_forward(layer: nn.Module, original: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    """Run ``layer``'s own forward on the packed rows ``boundaries`` describe (the stack's top: the mixer entry puts
    them there), its kernel calls routed to its family's ops; ``arguments``: the forward's bound arguments."""
    arguments = dict(arguments)
    extra = {k: v for k, v in arguments.pop("kwargs", {}).items() if k not in PACKFREE_KWARGS}
    if any(arguments.get(name) is not None for name in CACHE_ARGUMENTS):
        raise ValueError(f"{type(layer).__name__}: a cache was passed with a packed batch")
    if arguments.get("attention_mask") is not None:
        arguments["attention_mask"] = None  # padding lives in the boundaries (padding segments)
    if type(layer).__module__ not in _INSTALLED:  # routes were removed (unregister) since the model was prepared
        routed_kernels_of(layer)
    outer = (_CALL.layer, _CALL.depth, _CALL.mixed)
    _CALL.layer, _CALL.depth, _CALL.mixed = type(layer).__name__, stack_depth(), 0
    try:
        out = original(**arguments, **extra)
        mixed = _CALL.mixed
    finally:
        _CALL.layer, _CALL.depth, _CALL.mixed = outer
    if mixed <= 0:
        raise ValueError(f"{type(layer).__name__} routed none of its sequence mixing through a known kernel "
                         "function; it needs the generic tier")
    return out


def native_tier(family: MixerFamily) -> Callable[[nn.Module, Callable, Boundaries, dict[str, Any]], Any]:
    """How a layer of ``family`` runs on packed rows, ``(layer, original, boundaries, arguments) -> output``: its own
    forward with the family's kernel functions routed (:func:`native_forward`), or the family's forward."""
    if family.forward is None:
        return native_forward
    return functools.partial(_family_forward, family.forward)


def _family_forward(forward: Callable, layer: nn.Module, original: Callable, boundaries: Boundaries,
                    arguments: dict[str, Any]) -> Any:
    return forward(layer, boundaries, arguments)


def _router(route: KernelRoute, original: Callable) -> Callable:
    """A plain module function's router (a release without the kernel seam)."""

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any):
        return _route(route, original, *args, **kwargs)

    setattr(routed, _ROUTED_ATTR, original)
    return routed


_INSTALLED: set[str] = set()
"""Names of the modeling modules whose kernel functions are routed now."""
_SEAMED: dict[nn.Module, dict[str, Any]] = {}
"""Kernel-function modules packfree kernelized -> the instance attributes ``kernelize`` changed on them, as they were
before (absent ones as :data:`_ABSENT`), so :func:`uninstall_routes` puts back exactly what was there."""
_ABSENT = object()


def install_routes(module: ModuleType) -> list[str]:
    """Route every kernel function of ``module``'s family (idempotent); returns their kernel names. Raises
    ``ValueError`` when a function that mixes tokens is missing (a transformers release packfree does not know)."""
    installed = []
    for function, route in routed_functions().get(module.__name__.removeprefix(_PREFIX), {}).items():
        present = getattr(module, function, None)
        if present is None and route.optional:
            continue
        if present is None:
            raise ValueError(compat.unroutable_message(module.__name__, function, route.kernel, "is missing"))
        if compat.kernel_seam(present):
            _kernelize(module.__name__, function, present, route)
        elif not hasattr(present, _ROUTED_ATTR):
            setattr(module, function, _router(route, present))
        installed.append(route.kernel)
    _INSTALLED.add(module.__name__)
    return installed


def _kernelize(module_name: str, function: str, kernel_function: nn.Module, route: KernelRoute) -> None:
    """Give the kernel-function module ``kernel_function`` packfree's route through ``kernels``' own mapping and
    ``kernelize``: outside a native call the route runs the function's forward as before."""
    from kernels import Mode, kernelize, use_kernel_mapping

    if kernel_function in _SEAMED:
        return
    before = dict(kernel_function.__dict__)
    mapping = {route.kernel: {"cpu": PackfreeRoutes(module_name, function, route)}}
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(kernel_function, device="cpu", mode=Mode.TRAINING | Mode.TORCH_COMPILE, use_fallback=False)
    except (ValueError, TypeError) as error:  # the seam names another kernel, or its signature changed
        why = f"is a kernels layer that refused packfree's route ({error})"
        raise ValueError(compat.unroutable_message(module_name, function, route.kernel, why)) from error
    after = kernel_function.__dict__
    _SEAMED[kernel_function] = {name: before.get(name, _ABSENT) for name in {*before, *after}
                                if before.get(name, _ABSENT) is not after.get(name, _ABSENT)}


class PackfreeRoutes:
    """A ``kernels`` repository (``load()`` -> layer class) holding packfree's route of one transformers kernel
    function: a layer with the function's signature whose forward, inside a native call, runs the route, and outside
    one the function's own forward (so the model's per-layer kernels, hub kernels a user chose included, run as
    before)."""

    def __init__(self, module_name: str, function: str, route: KernelRoute) -> None:
        self.module_name, self.function, self.route = module_name, function, route

    def load(self) -> type[nn.Module]:
        route, function_type = self.route, type(getattr(sys.modules[self.module_name], self.function))

        class Routed(nn.Module):
            can_torch_compile = True
            has_backward = True

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return _route(route, functools.partial(function_type.forward, self), *args, **kwargs)

        Routed.forward.__signature__ = inspect.signature(function_type.forward)
        Routed.__name__ = Routed.__qualname__ = f"Packfree_{route.kernel}"
        return Routed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackfreeRoutes) and (self.module_name, self.function) == (other.module_name,
                                                                                            other.function)

    def __hash__(self) -> int:
        return hash((self.module_name, self.function))

    def __str__(self) -> str:
        return f"packfree's route of {self.module_name}.{self.function} ({self.route.kernel})"


def is_routed(module: ModuleType, function: str) -> bool:
    """Whether ``module.function`` runs packfree's route now (wrapped in a router, or kernelized by packfree)."""
    present = getattr(module, function, None)
    return hasattr(present, _ROUTED_ATTR) or (isinstance(present, nn.Module) and present in _SEAMED)


def uninstall_routes() -> None:
    """Restore every routed function in every loaded modeling module."""
    for name, functions in routed_functions().items():
        module = sys.modules.get(_PREFIX + name)
        if module is None:
            continue
        for function in functions:
            present = getattr(module, function, None)
            if present is not None and hasattr(present, _ROUTED_ATTR):
                setattr(module, function, getattr(present, _ROUTED_ATTR))
    for kernel_function, changed in _SEAMED.items():
        for name, value in changed.items():
            if value is _ABSENT:
                kernel_function.__dict__.pop(name, None)
            else:
                kernel_function.__dict__[name] = value
    _SEAMED.clear()
    _INSTALLED.clear()


@torch.compiler.disable  # patches module globals: runs when a model is prepared, so compiled code never gets here
def routed_kernels_of(layer: nn.Module) -> list[str]:
    """Kernel names the layer's modeling module routes to packfree (installing the routes)."""
    module = sys.modules.get(type(layer).__module__)
    return install_routes(module) if module is not None else []
