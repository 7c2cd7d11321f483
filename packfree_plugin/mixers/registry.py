"""How packfree runs one family of layers (:class:`MixerAdapter`), the families by name (:data:`ADAPTERS`, filled by
:mod:`.families` and :mod:`.encoders`; a class names its family in its entry, :data:`packfree_plugin.classes.CLASSES`),
and what their per-sample runs need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..boundaries import Boundaries
from ..classes import entry_of

__all__ = ["ADAPTERS", "MixerAdapter", "NativeRun", "PerSample", "adapter_for", "register_adapter"]

NativeRun = Callable[[nn.Module, Callable, Boundaries, dict[str, Any]], Any]
"""``(layer, original_forward, boundaries, bound_arguments) -> output``."""
PerSample = Callable[[nn.Module, torch.Tensor, dict[str, Any]], dict[str, Any]]
"""``(layer, hidden [n, L, ...], call) -> arguments``: what a layer run on one right-padded group of ``n`` samples
needs beyond ``call`` (the arguments it is about to get, per-token ones already cut to the group); they replace
``call``'s entries of the same name."""


@dataclass(frozen=True)
class MixerAdapter:
    """How packed boundaries reach one family of sequence-mixing layers (the classes whose entry names ``family``).

    ``native``: a boundary-aware implementation
    (None: the generic unpack-run-repack tier). ``hidden_arg``: the forward's input argument.
    ``token_args``: further per-token arguments (``[B, T, ...]`` tensors or tuples/dicts of them, e.g.
    ``input_ids`` or the ``(cos, sin)`` position embeddings) unpacked together with ``hidden_arg``.
    ``output_index``: None when the forward returns the per-token output, else its index (or indices) in
    the returned tuple (the other entries, recurrent states or attention weights, come back as None; a
    parameter, the same for every sample, comes back as itself).
    ``per_sample``: extra arguments the layer needs when run on one right-padded sample batch (:data:`PerSample`).
    ``per_sample_output``: ``(layer, output) -> output``, applied to each group's output before its per-token
    entries go back into packed order (which needs them of one width in every group).
    A native family (declared in its op folder, :class:`packfree_plugin.ops.family.MixerFamily`) gets its native
    tier from :func:`.seam.native_tier`.

    ``attention``: for attention layers with their own attention code (a relative-position bias, sinks
    passed under another name, a token indexer reading a dense mask, ...), which the ``"packfree"``
    attention function cannot serve: the stock implementation (``"sdpa"`` or ``"eager"``) the layer runs
    with. Whenever boundaries are active (training, scoring, prefill; packed or not) the layer runs per
    sample with a dense causal (and sliding-window, from the layer's ``sliding_window``) mask per group
    (unless ``attention_mask`` is one of ``token_args``: a layer that takes a 2-D padding mask gets it per sample);
    when decoding from a cache it gets transformers' own mask. Either way its attention calls resolve to
    that stock implementation, so the layer computes exactly what stock transformers computes.
    ``causal``: whether such an attention layer masks the future, or a function of the layer that says it (BERT-era
    encoders turn causal with ``config.is_decoder``). A bidirectional layer runs on groups of samples of one
    length, unpadded (a padding key would be visible to it), with a mask that hides nothing.
    """

    family: str
    native: NativeRun | None = None
    hidden_arg: str = "hidden_states"
    token_args: tuple[str, ...] = ()
    output_index: int | tuple[int, ...] | None = None
    per_sample: PerSample | None = None
    per_sample_output: Callable[[nn.Module, Any], Any] | None = None
    attention: str | None = None
    causal: bool | Callable[[nn.Module], bool] = True
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.attention not in (None, "sdpa", "eager"):
            raise ValueError(f"attention must be None, 'sdpa' or 'eager', not {self.attention!r}")

    @property
    def tier(self) -> str:
        return "native" if self.native is not None else "generic"


ADAPTERS: dict[str, MixerAdapter] = {}
"""Family name -> adapter."""


def register_adapter(adapter: MixerAdapter) -> MixerAdapter:
    """Enter ``adapter`` in :data:`ADAPTERS` by its family; a family named twice raises."""
    if ADAPTERS.get(adapter.family, adapter) != adapter:
        raise ValueError(f"{adapter.family} already has an adapter")
    ADAPTERS[adapter.family] = adapter
    return adapter


def adapter_for(cls: type) -> MixerAdapter | None:
    """The adapter that runs layers of class ``cls`` (None: its entry names no family)."""
    family = entry_of(cls).mixer
    return ADAPTERS[family] if family is not None else None
