"""sentence-transformers: its text batches flattened into packed rows for a model loaded with packfree.

sentence-transformers' ``Transformer`` module flattens a text-only batch (transformers' ``DataCollatorWithFlattening``:
one row, ``cu_seq_lens_q/k``, ``seq_idx`` and ``position_ids``, which it shifts by ``padding_idx + 1`` for
RoBERTa-family embeddings) and pools each sample from its ``cu_seq_lens_q`` slice. It turns this on only when the
model's attention implementation names FlashAttention with a varlen function (``Transformer._can_flatten_inputs``);
there is no public seam to say that another implementation keeps samples apart. :func:`install` wraps that one
method: for a model packfree prepared, the same prerequisites (the ``feature-extraction`` or ``fill-mask`` task, text
among the modalities, the torch backend, an attention-interface model, every modality run by ``forward``) switch on
the same flattening, collator and position offset. ``unpad_inputs=False`` keeps batches padded, as for FlashAttention.

Tested with sentence-transformers 6.2 and 6.3 (:data:`TESTED`); on any other release packfree leaves sentence-transformers
untouched and logs why (its batches then stay padded, which packfree runs exactly as stock).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from ..compat import installed_series
from ..forward.keywords import BOUNDARY_KWARGS

__all__ = ["TESTED", "install", "install_if_imported", "installed"]

TESTED = ((6, 2), (6, 3))
"""The (major, minor) releases of sentence-transformers this adapter was tested with."""

_ORIGINAL = "_packfree_original_can_flatten_inputs"
logger = logging.getLogger("packfree")


def installed() -> bool:
    """Whether sentence-transformers' ``Transformer`` flattens batches for packfree models in this process."""
    transformer = _transformer_class()
    return transformer is not None and _ORIGINAL in transformer.__dict__


def _transformer_class() -> type | None:
    module = sys.modules.get("sentence_transformers.base.modules.transformer")
    return getattr(module, "Transformer", None)


def install_if_imported() -> bool:
    """:func:`install` if sentence-transformers is imported (it is, whenever it loads a model); returns
    :func:`installed`. Called by :func:`packfree_plugin.apply`."""
    if "sentence_transformers" in sys.modules:
        install()
    return installed()


def install() -> None:
    """Make sentence-transformers flatten text batches for models prepared by packfree (idempotent). On a release
    outside :data:`TESTED` it logs a warning and changes nothing."""
    if installed():
        return
    release = installed_series("sentence-transformers")
    if release not in TESTED:
        tested = ", ".join(f"{major}.{minor}" for major, minor in TESTED)
        logger.warning("packfree: sentence-transformers %s.%s is not a release packfree was tested with (%s); its "
                       "batches stay padded under packfree (exact, without packing's speed-up)", *release, tested)
        return
    import sentence_transformers.base.modules.transformer  # noqa: F401 - the module that defines Transformer

    transformer = _transformer_class()
    original = transformer._can_flatten_inputs

    @functools.wraps(original)
    def can_flatten_inputs(self: Any) -> bool:
        return original(self) or _flatten_for_packfree(self)

    setattr(transformer, _ORIGINAL, original)
    transformer._can_flatten_inputs = can_flatten_inputs


def _flatten_for_packfree(module: Any) -> bool:
    """Set ``module`` (a sentence-transformers ``Transformer``) up to flatten text batches, as it does for
    FlashAttention, where its model runs packfree attention and every other prerequisite holds."""
    from transformers import DataCollatorWithFlattening

    from ..forward.hook import has_entry

    model = module.model
    if getattr(model.config, "_attn_implementation", None) != "packfree" or not has_entry(model):
        return False
    if (module.transformer_task not in ("feature-extraction", "fill-mask") or "text" not in module.modality_config
            or module.backend != "torch" or not model.is_backend_compatible()
            or any(params["method"] != "forward" for params in module.modality_config.values())):
        return False
    module.data_collator = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True,
                                                      return_position_ids=True)
    if module.model_forward_params is not None:  # a forward without **kwargs: let the boundary keys through
        module.model_forward_params |= set(BOUNDARY_KWARGS)
    module._flatten_position_offset = module._infer_flatten_position_offset()
    return True
