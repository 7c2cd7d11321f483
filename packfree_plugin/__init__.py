"""packfree: padding-free (packed) training for Hugging Face Transformers, exact or refused with the reason.

``attn_implementation="packfree"`` in ``from_pretrained``/``from_config`` (registered automatically by the
installed startup hook, or by :func:`register`) makes a packed batch give the same outputs, loss and
gradients as running each sample alone. :func:`apply` prepares a model loaded some other way; :func:`release` undoes
it. :func:`packed_loss` and :class:`PackedLoss` (a ``Trainer``'s ``compute_loss_func``) reduce the loss by the batch's
samples, with per-token and per-sample weights (docs/loss.md).

Importing this package imports neither torch nor transformers: the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Boundaries": "packfree_plugin.boundaries",
    "register": "packfree_plugin.loading.register",
    "unregister": "packfree_plugin.loading.register",
    "is_registered": "packfree_plugin.loading.register",
    "apply": "packfree_plugin.loading.register",
    "release": "packfree_plugin.loading.prepare",
    "PackedLoss": "packfree_plugin.loss",
    "count_samples": "packfree_plugin.loss",
    "packed_loss": "packfree_plugin.loss",
}

__all__ = ["Boundaries", "PackedLoss", "apply", "count_samples", "is_registered", "packed_loss", "register", "release",
           "unregister", "__version__"]

if TYPE_CHECKING:
    from .boundaries import Boundaries
    from .loading.prepare import release
    from .loading.register import apply, is_registered, register, unregister
    from .loss import PackedLoss, count_samples, packed_loss


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packfree_plugin' has no attribute {name!r}")
