"""How boundaries reach each layer: the model hook, and (per family) the mixer adapters."""

from __future__ import annotations

from torch import nn

from .model import apply_model_hook, boundaries_for_call, remove_model_hook

__all__ = ["apply", "apply_model_hook", "boundaries_for_call", "remove_model_hook"]


def apply(model: nn.Module) -> nn.Module:
    """Prepare ``model`` for packed batches (idempotent) and return it.

    Switches a model loaded with another attention implementation to ``"packfree"`` and hooks every
    ``PreTrainedModel`` in it so that each forward builds its boundaries once. Called automatically for
    models loaded with ``attn_implementation="packfree"``.
    """
    from ..registration import ATTN_IMPLEMENTATION, register

    register()
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current not in (None, ATTN_IMPLEMENTATION) and getattr(model, "_supports_attention_backend", False):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    apply_model_hook(model)
    return model
