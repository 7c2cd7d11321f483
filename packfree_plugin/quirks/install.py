"""Every quirk of a class entry (:data:`packfree_plugin.classes.CLASSES`) installed on a prepared model, and removed
again.

One walk over the model's modules: each module's class is looked up once, and each field of its entry is handed
to the adapter that acts on it (:mod:`.positions`, :mod:`.decoder_inputs`, :mod:`.dense_masks`, :mod:`.whole_row`).
"""

from __future__ import annotations

from torch import nn

from ..classes import ClassEntry, entry_of
from ..forward.hook import add_step
from .decoder_inputs import decoder_inputs_step
from .dense_masks import install_dense_mask, mark_causal, uninstall_dense_mask, unmark_causal
from .positions import install_numbering, uninstall_numbering
from .whole_row import install_refusal, install_sample_bias, uninstall_refusal, uninstall_sample_bias

__all__ = ["apply_quirks", "remove_quirks"]


def _refused_on_packed_rows(entry: ClassEntry) -> bool:
    """A layer refused by a packed row whatever it holds (a dense-mask layer checks its own refusal's condition)."""
    return entry.refused is not None and entry.refused.on == "packed_row" and entry.dense_mask is None


def apply_quirks(model: nn.Module) -> list[str]:
    """Give every module of ``model`` with a quirk what packfree does for it: embeddings their per-sample numbering,
    dense-mask layers the mask they can read (or a refusal), refused layers their refusal, decoder layers a causal
    self-attention, seq2seq models their per-sample decoder inputs, T5-style layers that own a relative bias their
    per-sample bias (idempotent). Returns the paths whose forward was replaced."""
    replaced = []
    for path, module in model.named_modules():
        entry = entry_of(type(module))
        if entry.causal_self_attention is not None:
            mark_causal(module, entry.causal_self_attention)
        if entry.relative_position_bias:
            install_sample_bias(module)
        if entry.shifted_decoder_input is not None:
            add_step(module, decoder_inputs_step)
        if entry.numbering is not None:
            install_numbering(module, model, path)
        elif _refused_on_packed_rows(entry):
            install_refusal(module)
        elif entry.dense_mask is not None:
            install_dense_mask(module)
        else:
            continue
        replaced.append(path)
    return replaced


def remove_quirks(model: nn.Module) -> None:
    """Undo :func:`apply_quirks` on ``model`` (the decoder-input steps go with the model entries)."""
    for module in model.modules():
        entry = entry_of(type(module))
        if entry.numbering is not None:
            uninstall_numbering(module)
        elif _refused_on_packed_rows(entry):
            uninstall_refusal(module)
        elif entry.dense_mask is not None:
            uninstall_dense_mask(module)
        uninstall_sample_bias(module)
        unmark_causal(module)
