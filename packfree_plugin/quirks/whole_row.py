"""Layers that compute over the whole packed row by code of their own.

Some cannot be cut into samples (LongT5's local and transient-global attention, refused on a packed row:
:attr:`~packfree_plugin.classes.ClassEntry.refused`): a packed row raises ``ValueError`` with the reason, one
sample per row runs them untouched. T5's relative position bias (a ``relative_position_bias`` quirk) is computed for
the whole row's ``[T, T]`` by stock; on a packed row the layer that owns it computes the longest sample's instead,
whose top-left corner is every sample's bias.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..classes import Refusal, entry_of
from ..forward.context import boundaries_here
from ..forward.instance import install, own_forward, uninstall

__all__ = ["install_refusal", "install_sample_bias", "packed_row_refusal", "reads_boundaries_in_layers",
           "uninstall_refusal", "uninstall_sample_bias"]

_TAG = "refused_"
"""Keeps these instance forwards apart from the other adapters' (:mod:`packfree_plugin.forward.instance`)."""


def packed_row_refusal(module: nn.Module) -> Refusal | None:
    """The refusal a packed row through ``module`` raises: its entry's, where it is refused on packed rows and, for a
    refusal under a condition, the condition holds (None: it runs)."""
    refusal = entry_of(type(module)).refused
    if refusal is None or refusal.on != "packed_row":
        return None
    if refusal.when is not None and getattr(module, refusal.when[0]) != refusal.when[1]:
        return None
    return refusal


def _refused_forward(module: nn.Module, *args, **kwargs):
    """A refused layer's forward: its own, unless a packed row is in flight."""
    refusal = packed_row_refusal(module) if boundaries_here(packed=True) is not None else None
    if refusal is not None:
        raise ValueError(f"packfree cannot run {type(module).__name__} on a packed row: {refusal.reason}. Pass one "
                         "sample per row for this model")
    return own_forward(module, tag=_TAG)(*args, **kwargs)


def install_refusal(module: nn.Module) -> None:
    install(module, _refused_forward, tag=_TAG)


def uninstall_refusal(module: nn.Module) -> None:
    uninstall(module, _refused_forward, tag=_TAG)


def _sample_bias(module: nn.Module, query_length: int, key_length: int, device: torch.device | None = None,
                 past_seen_tokens: int = 0) -> torch.Tensor:
    """T5's ``compute_bias`` (installed on the instance of every ``relative_position_bias`` layer that owns a bias):
    on a packed row, the bias of the longest sample, ``[1, H, L, L]`` instead of ``[1, H, T, T]``; the bias is
    relative, so every sample's is its top-left corner, which packfree's attention takes. Elsewhere the class's own."""
    boundaries = boundaries_here(packed=True, length=query_length) if past_seen_tokens == 0 else None
    if boundaries is not None and key_length == query_length:
        query_length = key_length = boundaries.max_seqlen
    return type(module).compute_bias(module, query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)


def _owns_bias(module: nn.Module) -> bool:
    return entry_of(type(module)).relative_position_bias and getattr(module, "has_relative_attention_bias",
                                                                              False)


def install_sample_bias(module: nn.Module) -> None:
    """Give ``module`` its per-sample bias where it owns one (nothing elsewhere)."""
    if _owns_bias(module):
        module.compute_bias = functools.partial(_sample_bias, module)


def uninstall_sample_bias(module: nn.Module) -> None:
    compute_bias = module.__dict__.get("compute_bias")
    if isinstance(compute_bias, functools.partial) and compute_bias.func is _sample_bias:
        del module.__dict__["compute_bias"]


def reads_boundaries_in_layers(model: nn.Module) -> bool:
    """Whether a layer of ``model`` computes a T5-style relative bias (:func:`_sample_bias`), which reads this forward's
    boundaries inside the decoder layer: the layer then needs packfree's layer hooks, whose checkpoint wrapper hands
    the same boundaries to backward's recomputation."""
    return any(map(_owns_bias, model.modules()))
