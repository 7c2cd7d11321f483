"""What a loss needs from a forward besides the logits: the batch's boundaries, its loss weights and its
``shift_labels``, kept past the forward for :mod:`packfree_plugin.loss`.

The model entry (:func:`.hook.model_forward`) of the outermost prepared forward takes the weight fields
(:data:`.keywords.LOSS_WEIGHT_KWARGS`) out of the call's keyword arguments, so the model's own forward never sees
them, and after the call leaves one :class:`LossInputs` on the output (attribute ``packfree_loss_inputs``) and as this
thread's latest. A loss reads the output's; DDP with ``find_unused_parameters=True`` (the ``Trainer``'s default
without gradient checkpointing) rebuilds the output and clones its tensors, and the loss then takes the thread's
latest, but only for the logits that forward made (:meth:`LossInputs.made`). A compiled forward keeps them only when
it is given loss weights (:func:`keep_outside_graph`: one graph break at its end); else a loss of compiled logits is
handed its boundaries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..boundaries import Boundaries
from .keywords import LOSS_WEIGHT_KWARGS

__all__ = ["LossInputs", "keep_loss_inputs", "keep_outside_graph", "loss_inputs_of", "take_loss_weights"]

OUTPUT_ATTRIBUTE = "packfree_loss_inputs"


@dataclass(frozen=True)
class LossInputs:
    """One forward's batch, as a loss needs it.

    Attributes:
        boundaries: the batch's boundaries; None where packfree read none (one sample per row, as stock reads it).
        rows: ``(B, T)`` of the forward's tokens.
        weights: the batch's ``token_weights`` / ``sample_weights`` (``[B, T]``) that were given, by name.
        shift_labels: the ``shift_labels [B, T]`` the forward was called with, or None.
        logits_node: the autograd node that made the forward's logits (None: no graph); held, not its ``id``, so
            that a later graph's node at a reused address can never pass for it.
    """

    boundaries: Boundaries | None
    rows: tuple[int, int]
    weights: dict[str, torch.Tensor]
    shift_labels: torch.Tensor | None
    logits_node: Any

    def made(self, logits: torch.Tensor) -> bool:
        """Whether ``logits`` are this forward's, or DDP's clone of them (whose node's inputs hold the original)."""
        node = logits.grad_fn
        if self.logits_node is None or node is None or tuple(logits.shape[:2]) != self.rows:
            return False
        return node is self.logits_node or any(inner is self.logits_node for inner, _ in node.next_functions)


class _Latest(threading.local):
    def __init__(self) -> None:
        self.inputs: LossInputs | None = None


_LATEST = _Latest()


def take_loss_weights(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Pop the loss-weight fields out of a call's ``kwargs`` (those given, by name)."""
    taken = {}
    for name in LOSS_WEIGHT_KWARGS:
        value = kwargs.pop(name, None)
        if value is not None:
            taken[name] = value
    return taken


def keep_loss_inputs(output: Any, boundaries: Boundaries | None, tokens: Any, weights: dict[str, torch.Tensor],
                     kwargs: dict[str, Any]) -> None:
    """Leave what the loss needs on ``output`` and as this thread's latest, after an outermost forward on ``tokens``
    (``[B, T, ...]``; anything else keeps nothing)."""
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return
    if boundaries is None and not weights and not torch.is_grad_enabled():
        return  # a decode step (or a no-grad call that packs nothing) keeps nothing: it costs every generated token
    logits = getattr(output, "logits", None)
    node = logits.grad_fn if isinstance(logits, torch.Tensor) else None
    shift_labels = kwargs.get("shift_labels")
    inputs = LossInputs(boundaries, (tokens.shape[0], tokens.shape[1]), weights,
                        shift_labels if isinstance(shift_labels, torch.Tensor) else None,
                        node)
    _LATEST.inputs = inputs
    try:
        setattr(output, OUTPUT_ATTRIBUTE, inputs)
    except (AttributeError, TypeError):  # a tuple (return_dict=False): the thread's latest holds it
        pass


keep_outside_graph = torch.compiler.disable(keep_loss_inputs)
""":func:`keep_loss_inputs` for a compiled forward given loss weights, run outside its graph."""


def loss_inputs_of(outputs: Any, logits: torch.Tensor) -> LossInputs | None:
    """The :class:`LossInputs` of the forward that made ``outputs`` / ``logits``, or None (not a prepared model's
    forward, a compiled one, or another forward ran since DDP rebuilt these outputs)."""
    kept = getattr(outputs, OUTPUT_ATTRIBUTE, None)
    if isinstance(kept, LossInputs):
        return kept
    latest = _LATEST.inputs
    return latest if latest is not None and latest.made(logits) else None
