""":func:`apply`, packfree's entry point: prepare a model for packed batches.

It stands above every layer it calls: the version check (:mod:`.compat`), registration with transformers
(:mod:`.registration`), the load-time gate (:mod:`.gate`), the model entry (:mod:`.model_entry`) with the refusal of
torch's context parallelism (:mod:`.parallel.torch_cp`) and the adapters that route boundaries into each layer
(:mod:`.adapters`).
"""

from __future__ import annotations

from torch import nn

from ..adapters.task_heads import unwrap_heads, wrap_heads
from ..adapters.quirks import apply_quirks, remove_quirks
from ..adapters.whole_row import reads_boundaries_in_layers
from ..adapters.mixers import check_coverage, unwrap_mixers, wrap_mixers
from ..compat import check_transformers_version
from ..gate import admit
from ..integrations import sentence_transformers
from ..forward.hook import add_read_check, apply_model_hook, remove_model_hook
from ..parallel.torch_cp import refuse_packed_rows_under_context_parallel
from .register import ATTN_IMPLEMENTATION, register

__all__ = ["apply", "release"]


def apply(model: nn.Module) -> nn.Module:
    """Prepare ``model`` for packed batches (idempotent) and return it.

    Switches a model loaded with another attention implementation to ``"packfree"``, hooks every
    ``PreTrainedModel`` in it so that each forward builds its boundaries once, and gives every sequence
    mixer (GDN, Mamba, conv, ...) its boundary adapter. Raises ``ValueError`` naming any layer that looks
    like a sequence mixer but has no adapter, any architecture that is neither verified by the sweep nor proved
    exact on a tiny copy (:mod:`packfree_plugin.gate`), and the supported range on a transformers release
    packfree was not tested with. Called automatically for models loaded with ``attn_implementation="packfree"``.
    """

    check_transformers_version()
    register()
    add_read_check(refuse_packed_rows_under_context_parallel)  # the entry refuses packed rows under torch's CP
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current not in (None, ATTN_IMPLEMENTATION) and getattr(model, "_supports_attention_backend", False):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)  # registration's wrapper prepares it: this, once more
    check_coverage(model)
    admit(model)  # verified exact, proved exact on a tiny copy, or refused (packfree_plugin.gate)
    mixers = wrap_mixers(model)
    wrap_heads(model)
    apply_model_hook(model, layer_hooks=bool(mixers) or reads_boundaries_in_layers(model))
    apply_quirks(model)
    sentence_transformers.install_if_imported()
    return model


def release(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (``set_attn_implementation`` away from ``"packfree"`` calls it): every entry, hook and
    instance forward packfree gave ``model``'s modules removed, so it runs exactly as stock. Returns ``model``."""
    remove_model_hook(model)
    unwrap_heads(model)
    remove_quirks(model)
    unwrap_mixers(model)
    for module in model.modules():  # what packfree cached on its modules (stock configs, chunk sizes, marks)
        for name in [name for name in module.__dict__ if name.startswith("_packfree_")]:
            del module.__dict__[name]
    return model
