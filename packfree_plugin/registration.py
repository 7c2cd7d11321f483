"""Registration with transformers: the ``"packfree"`` attention and mask functions, and the load hook.

:func:`register` (idempotent) adds ``"packfree"`` to ``AttentionInterface`` and ``AttentionMaskInterface``
and wraps ``PreTrainedModel.post_init`` so that every model built with
``attn_implementation="packfree"`` (``from_pretrained``, ``from_config``, a constructor) is prepared by
:func:`packfree_plugin.apply` as soon as it exists. :func:`unregister` undoes all three.
"""

from __future__ import annotations

import functools

from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface

from .attention import packfree_attention_forward, packfree_attention_mask

__all__ = ["ATTN_IMPLEMENTATION", "register", "unregister", "is_registered"]

ATTN_IMPLEMENTATION = "packfree"
_ORIGINAL_POST_INIT = "_packfree_original_post_init"


def _uses_packfree(model: PreTrainedModel) -> bool:
    implementation = getattr(model.config, "_attn_implementation", None)
    return implementation == ATTN_IMPLEMENTATION


def is_registered() -> bool:
    """Whether ``"packfree"`` is currently registered with transformers."""
    return ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION) is packfree_attention_forward


def register() -> None:
    """Register ``"packfree"`` with transformers and prepare every model loaded with it. Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, packfree_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, packfree_attention_mask)
    if hasattr(PreTrainedModel, _ORIGINAL_POST_INIT):
        return
    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self: PreTrainedModel, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _uses_packfree(self):
            from . import apply

            apply(self)
        return result

    setattr(PreTrainedModel, _ORIGINAL_POST_INIT, original)
    PreTrainedModel.post_init = post_init


def unregister() -> None:
    """Remove ``"packfree"`` from transformers, restore ``PreTrainedModel.post_init`` and the kernel functions
    of modeling modules that packfree routed (:mod:`.adapters.routes`)."""
    from .adapters.routes import uninstall_routes

    uninstall_routes()
    # transformers has no public way to remove a registration: these two dicts are the registries themselves
    AttentionInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    original = PreTrainedModel.__dict__.get(_ORIGINAL_POST_INIT)
    if original is not None:
        PreTrainedModel.post_init = original
        delattr(PreTrainedModel, _ORIGINAL_POST_INIT)
