"""Registration with transformers: the ``"packfree"`` attention and mask functions, and the load hook.

:func:`register` (idempotent) adds ``"packfree"`` to ``AttentionInterface`` and ``AttentionMaskInterface``
and wraps ``PreTrainedModel.post_init`` so that every model built with
``attn_implementation="packfree"`` (``from_pretrained``, ``from_config``, a constructor) is prepared by
:func:`packfree_plugin.apply` as soon as it exists, its attention check so that models choosing their
attention class from a table of implementations find a ``"packfree"`` entry (:mod:`.mixers.families`), and
``set_attn_implementation``, so that a model switched to ``"packfree"`` after loading is prepared the same way (the
load-time proof included) or refused with its reason and left as it was, and one switched away from it is released
(:func:`packfree_plugin.loading.prepare.release`) to run as stock.
:func:`register` also has DeepSpeed's Ulysses registration (which accelerate's and the Trainer's sequence-parallel
config call) take packfree's route for packfree models, once DeepSpeed's module is imported
(:mod:`packfree_plugin.integrations.deepspeed`). :func:`unregister` undoes all of it.
"""

from __future__ import annotations

import functools

from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface

from ..attention import packfree_attention_forward, packfree_attention_mask
from ..compat import check_transformers_version
from ..forward.keywords import ATTN_IMPLEMENTATION

__all__ = ["ATTN_IMPLEMENTATION", "apply", "is_registered", "register", "unregister"]

_ORIGINAL_POST_INIT = "_packfree_original_post_init"
_ORIGINAL_CHECK = "_packfree_original_check_attn"
_ORIGINAL_SET = "_packfree_original_set_attn"


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
    from ..integrations import deepspeed  # its hook on DeepSpeed, which registration installs

    deepspeed.install_when_imported()
    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self: PreTrainedModel, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _uses_packfree(self):
            apply(self)  # every model built with "packfree" is prepared as it exists
        return result

    setattr(PreTrainedModel, _ORIGINAL_POST_INIT, original)
    PreTrainedModel.post_init = post_init

    original_check = PreTrainedModel._check_and_adjust_attn_implementation

    @functools.wraps(original_check)
    def check_attn_implementation(self: PreTrainedModel, *args, **kwargs):
        # runs in PreTrainedModel.__init__, before the model builds its layers: models that pick their attention
        # class from a table keyed by implementation get their "packfree" entry (mixers.families)
        implementation = original_check(self, *args, **kwargs)
        if implementation == ATTN_IMPLEMENTATION:
            from ..mixers.families import add_implementation_entry

            add_implementation_entry(type(self))
        return implementation

    setattr(PreTrainedModel, _ORIGINAL_CHECK, original_check)
    PreTrainedModel._check_and_adjust_attn_implementation = check_attn_implementation

    original_set = PreTrainedModel.set_attn_implementation

    @functools.wraps(original_set)
    def set_attn_implementation(self: PreTrainedModel, attn_implementation, *args, **kwargs):
        _switch(self, original_set, attn_implementation, *args, **kwargs)

    setattr(PreTrainedModel, _ORIGINAL_SET, original_set)
    PreTrainedModel.set_attn_implementation = set_attn_implementation


def _switch(model: PreTrainedModel, original_set, attn_implementation, *args, **kwargs) -> None:
    """transformers' ``set_attn_implementation``, then: prepare a model switched to packfree (or put every config back
    and raise), release one switched away from it."""
    from .prepare import release  # here, not at the top: registration runs while transformers imports
    from ..forward.hook import has_entry

    configs = {id(module.config): module.config for module in model.modules() if isinstance(module, PreTrainedModel)}
    before = {key: config._attn_implementation_internal for key, config in configs.items()}
    original_set(model, attn_implementation, *args, **kwargs)
    prepared = has_entry(model)
    if _uses_packfree(model) and not prepared:
        try:
            apply(model)
        except BaseException:
            release(model)
            for key, config in configs.items():
                config._attn_implementation_internal = before[key]
            raise
    elif prepared and not _uses_packfree(model):
        release(model)
    elif attn_implementation == ATTN_IMPLEMENTATION and not _uses_packfree(model):
        raise ValueError(
            f"{type(model).__name__} cannot switch its attention implementation after loading (transformers: it does "
            "not follow the AttentionInterface). Load it with attn_implementation='packfree'"
        )


def apply(model: nn.Module) -> nn.Module:
    """Prepare ``model`` for packed batches (idempotent) and return it.

    Registers ``"packfree"``, switches a model loaded with another attention implementation to it, hooks every
    ``PreTrainedModel`` in it so that each forward builds its boundaries once, and gives every sequence mixer (GDN,
    Mamba, conv, ...) its boundary adapter (:func:`.prepare.prepare`). Raises ``ValueError`` naming any layer that
    looks like a sequence mixer but has no adapter, any architecture that is neither verified by the sweep nor proved
    exact on a tiny copy (:mod:`packfree_plugin.gate`), and the supported range on a transformers release packfree
    was not tested with. Called automatically for models loaded with ``attn_implementation="packfree"``.
    """
    from .prepare import prepare  # here, not at the top: registration runs while transformers imports

    check_transformers_version()
    register()
    return prepare(model)


def unregister() -> None:
    """Remove ``"packfree"`` from transformers, restore ``PreTrainedModel``'s three wrapped methods, the kernel functions
    of modeling modules that packfree routed (:mod:`.mixers.seam`) and their attention-class tables."""
    from ..mixers.families import remove_implementation_entries
    from ..mixers.seam import uninstall_routes

    uninstall_routes()
    remove_implementation_entries()
    from ..integrations import deepspeed

    deepspeed.uninstall()
    # transformers has no public way to remove a registration: these two dicts are the registries themselves
    AttentionInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    for name, original_name in (("post_init", _ORIGINAL_POST_INIT),
                                 ("_check_and_adjust_attn_implementation", _ORIGINAL_CHECK),
                                 ("set_attn_implementation", _ORIGINAL_SET)):
        original = PreTrainedModel.__dict__.get(original_name)
        if original is not None:
            setattr(PreTrainedModel, name, original)
            delattr(PreTrainedModel, original_name)
