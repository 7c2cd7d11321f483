"""A mixer family: everything packfree knows about one kind of sequence mixer, declared once in its op folder.

Each family folder under ``ops/`` that runs transformers' layers natively has a ``family.py`` declaring its
:class:`MixerFamily`: the transformers kernel functions its layers call and the route each one takes to the
folder's boundary-aware op (:class:`KernelRoute`), or a forward of its own for layers whose recurrence is inline.
Classes name their family in :data:`packfree_plugin.classes.CLASSES`; :func:`families` finds every declared one, so a
new family is one folder and its class entries.

A route receives the boundaries of the call explicitly, as its first argument: the mixer tier that runs the layer
reads them once (:mod:`packfree_plugin.mixers.entry`) and the kernel seam hands them on
(:mod:`packfree_plugin.mixers.seam`).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..boundaries import Boundaries

__all__ = ["KernelRoute", "MixerFamily", "NativeForward", "declines", "decoding_only", "families", "flat_rows",
           "like_value", "positions_per_sample", "refuse_state"]

Route = Callable[..., Any]
"""``(boundaries, layer_name, *args, **kwargs) -> what the transformers kernel returns``."""
NativeForward = Callable[[nn.Module, Boundaries, dict[str, Any]], Any]
"""``(layer, boundaries, bound_arguments) -> output``: a layer's forward on packed rows, written here."""


@dataclass(frozen=True)
class KernelRoute:
    """One transformers kernel function's route. ``kernel``: the name transformers' kernel seam knows it by (the
    ``use_kernel_func_from_hub_with_fallback`` name); ``run``: packfree's route with that function's call convention.
    ``optional``: a modeling module may lack it (fused whole-layer and decoding kernels)."""

    kernel: str
    run: Route
    optional: bool = False

    @property
    def mixes(self) -> bool:
        """Whether taking this route runs packfree's op (a fused kernel that declines, or a decoding kernel that
        refuses, mixes nothing)."""
        return not getattr(self.run, "mixes_nothing", False)


@dataclass(frozen=True)
class MixerFamily:
    """A family of mixers run natively on packed rows (the classes whose entry names ``name``).

    ``routes``: transformers function name -> its route; the layer's own forward runs with these routed (the seam).
    ``forward``: instead, a forward of packfree's own (the recurrence is inline in transformers' code).
    ``hidden_arg``, ``output_index``: the forward's input argument and where the per-token output sits in what it
    returns (None: the output itself), for the per-sample tier that can run the same layers.
    """

    name: str
    routes: Mapping[str, KernelRoute] = field(default_factory=dict)
    forward: NativeForward | None = None
    hidden_arg: str = "hidden_states"
    output_index: int | tuple[int, ...] | None = None
    per_sample: Callable[..., dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if (self.forward is None) == (not self.routes):
            raise ValueError(f"{self.name}: a family routes kernel functions or has a forward of its own, not both")


def declines(boundaries: Boundaries, layer_name: str, *args: Any, **kwargs: Any) -> None:
    """A fused whole-layer kernel's route: decline (return None), so the layer runs its split path, every step routed."""
    return None


declines.mixes_nothing = True  # type: ignore[attr-defined]


def decoding_only(kernel: str) -> Route:
    """The route of a decoding kernel: a packed call never decodes."""

    def refuse(boundaries: Boundaries, layer_name: str, *args: Any, **kwargs: Any) -> None:
        raise ValueError(f"{layer_name} called the decoding kernel {kernel} on a packed batch")

    refuse.mixes_nothing = True  # type: ignore[attr-defined]
    return refuse


def refuse_state(layer_name: str, kernel: str, **states: Any) -> None:
    """Raise if a kernel was given a cache state on a packed batch."""
    given = [name for name, value in states.items() if value not in (None, False)]
    if given:
        raise ValueError(f"{layer_name}: {kernel} got {', '.join(given)} in a packed batch (no cache allowed)")


@functools.cache
def families() -> dict[str, MixerFamily]:
    """Every family declared in an op folder's ``family.py``, by name (a name declared twice raises)."""
    from . import __path__ as folders

    found: dict[str, MixerFamily] = {}
    for folder in sorted(info.name for info in pkgutil.iter_modules(folders) if info.ispkg):
        try:
            module = importlib.import_module(f"{__package__}.{folder}.family")
        except ModuleNotFoundError as error:
            if error.name != f"{__package__}.{folder}.family":
                raise
            continue
        for family in module.FAMILIES:
            if family.name in found:
                raise ValueError(f"the mixer family {family.name!r} is declared twice")
            found[family.name] = family
    return found


def flat_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> ``[1, B * T, ...]`` (a view): the ops' ``cu_seqlens`` describe the flattened rows."""
    return tensor.reshape(1, tensor.shape[0] * tensor.shape[1], *tensor.shape[2:])


def positions_per_sample(layer: nn.Module, hidden: torch.Tensor, call: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``position_ids [n, L]`` restarting at 0 in every sample of a right-padded group ``hidden [n, L, ...]`` (for
    the per-sample tier)."""
    return {"position_ids": torch.arange(hidden.shape[1], device=hidden.device).expand(*hidden.shape[:2])}


def like_value(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """An empty tensor like ``value``: the output of an attention-like op ``(q, k, v, ...) -> [B, T, H, V]`` (what a
    compiled graph traces)."""
    return torch.empty_like(value)
