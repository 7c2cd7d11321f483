"""packfree: padding-free (packed) training for Hugging Face Transformers, exact on every device.

``attn_implementation="packfree"`` in ``from_pretrained``/``from_config`` (registered automatically by the
installed startup hook, or by :func:`register`) makes a packed batch give the same outputs, loss and
gradients as running each sample alone. :func:`apply` prepares a model loaded some other way; :func:`release` undoes it.

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
}

__all__ = ["Boundaries", "apply", "is_registered", "register", "release", "unregister", "__version__"]

if TYPE_CHECKING:
    from .boundaries import Boundaries
    from .loading.prepare import release
    from .loading.register import apply, is_registered, register, unregister


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'packfree_plugin' has no attribute {name!r}")
