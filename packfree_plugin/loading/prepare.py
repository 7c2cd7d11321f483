""":func:`prepare` a model for packed batches, :func:`release` it (:func:`packfree_plugin.apply` registers, then
prepares).

It stands above every layer it calls: the load-time gate (:mod:`packfree_plugin.gate`), the model entry
(:mod:`packfree_plugin.forward.hook`) with the refusal of torch's context parallelism
(:mod:`packfree_plugin.parallel.torch_cp`) and the adapters that route boundaries into each layer
(:mod:`packfree_plugin.mixers`, :mod:`packfree_plugin.quirks`).
"""

from __future__ import annotations

from torch import nn

from ..quirks.task_heads import unwrap_heads, wrap_heads
from ..quirks.install import apply_quirks, remove_quirks
from ..quirks.whole_row import reads_boundaries_in_layers
from ..mixers.entry import check_coverage, unwrap_mixers, wrap_mixers
from ..gate import admit
from ..integrations import sentence_transformers
from ..forward.hook import add_read_check, apply_model_hook, remove_model_hook
from ..parallel.torch_cp import refuse_packed_rows_under_context_parallel
from ..forward.keywords import ATTN_IMPLEMENTATION

__all__ = ["prepare", "release"]


def prepare(model: nn.Module) -> nn.Module:
    """The preparation :func:`packfree_plugin.apply` runs once ``"packfree"`` is registered (idempotent); returns
    ``model``."""
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
