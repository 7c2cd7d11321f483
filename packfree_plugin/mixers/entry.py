"""How sequence mixers (layers that carry information along the sequence outside attention) run on a packed batch.

What runs a class is elsewhere: its entry (:data:`packfree_plugin.classes.CLASSES`) names its family, and one
:class:`~.registry.MixerAdapter` per family (:data:`.registry.ADAPTERS`, filled by :mod:`.families` and :mod:`.encoders`)
says how packed boundaries reach it. :func:`wrap_mixers` gives every covered layer of a model an instance-level forward
that, while a packed batch is in flight, runs the adapter; otherwise the layer's own forward runs
untouched. A layer that looks like a sequence mixer but has no adapter is refused at load
(:func:`check_coverage`): packfree never lets one mix samples silently.

Where does a layer get its boundaries? From :func:`~.forward.context.boundaries_here`, given its input rows:
the ``packfree_boundaries`` keyword when its decoder layer passes its ``**kwargs`` on (most transformers 5
models do), else the per-forward context's stack, which the decoder-layer hook fills around each layer
(and around the recomputation of gradient checkpointing), provided they describe those rows. The native tier hands
them to its family's ops (:mod:`.seam`, through the kernel functions its family routes); the generic tier reads
the host offsets.
"""

from __future__ import annotations

import re

from torch import nn

from ..classes import entry_of
from ..forward.context import current, enter_mixer, pop
from ..forward.keywords import BOUNDARY_KWARGS, CACHE_ARGUMENTS, PACKFREE_KWARGS
from ..forward.signature import ForwardParameters
from . import encoders, families  # noqa: F401 - they fill the adapters by family
from .registry import adapter_for
from .generic import attention_forward, run_generic
from ..forward.instance import install, own_forward, own_parameters, uninstall
from .seam import routed_kernels_of

__all__ = ["check_coverage", "unwrap_mixers", "wrap_mixers"]

def _mixer_forward(layer: nn.Module, *args, **kwargs):
    """The forward every covered mixer gets, as ``functools.partial(_mixer_forward, layer)`` in the layer's
    ``__dict__``: picklable, and a deep copy binds to the copy."""
    adapter = adapter_for(type(layer))
    original = own_forward(layer)
    if adapter.attention is None and current() is None and kwargs.keys().isdisjoint(PACKFREE_KWARGS):
        # a decode step, or a call outside any packed forward: no boundaries can reach this call, so it is the
        # layer's own (what the full check below concludes, at the cost of binding the call in every layer)
        return original(*args, **kwargs)
    arguments = own_parameters(layer).bind(args, kwargs)
    boundaries, pushed = enter_mixer(kwargs, rows=arguments.get(adapter.hidden_arg))
    try:
        if adapter.attention is None and (
                boundaries is None or not (boundaries.is_packed or boundaries.has_padding)
                or not boundaries.is_packed and any(arguments.get(name) is not None for name in CACHE_ARGUMENTS)):
            # one sample per row, or rows that are not this forward's; or an ordinary padded batch with the model's
            # cache (default use_cache, a prefill in generate()): the layer's own forward is exact (and fills the
            # cache as stock does); boundary inputs would only make transformers' kernel fallbacks refuse the call
            return original(*args, **{k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS})
        if adapter.native is not None:  # its ops keep a sample's NaN or inf out of the others, whichever kernel runs
            return adapter.native(layer, original, boundaries, arguments)
        if adapter.attention is not None:
            return attention_forward(layer, adapter, original, boundaries, arguments)
        return run_generic(adapter, layer, original, boundaries, arguments)
    finally:
        if pushed:
            pop()


def wrap_mixers(model: nn.Module) -> list[tuple[str, str]]:
    """Give every covered mixer in ``model`` its packed forward (idempotent); returns ``(path, tier)`` pairs."""
    wrapped = []
    for path, module in model.named_modules():
        adapter = adapter_for(type(module))
        if adapter is None:
            continue
        install(module, _mixer_forward)
        if entry_of(type(module)).modeling is not None:
            try:
                routed_kernels_of(module)
            except ValueError as error:
                raise ValueError(f"{type(model).__name__} ({path}): {error}") from error
        wrapped.append((path, adapter.tier))
    return wrapped


def unwrap_mixers(model: nn.Module) -> None:
    """Undo :func:`wrap_mixers`: every mixer runs its own forward again (the kernel routes stay: they run stock's
    kernels outside a packed call)."""
    for module in model.modules():
        uninstall(module, _mixer_forward)


_RECURRENT_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_first", "recurrent_param", "a_param"})
_MIXER_NAME = re.compile(r"(Rwkv|RWKV|Lstm|LSTM|Lightning|Indexer|Compressor|ShortConv|DeltaNet|Mamba.*Mixer)")


def _looks_like_a_mixer(module: nn.Module) -> bool:
    """A layer that carries information along the sequence: owns a Conv1d, a recurrent parameter, or a mixer name."""
    if any(isinstance(child, nn.Conv1d) for child in module.children()):
        return True
    if _RECURRENT_PARAMETERS & {name for name, _ in module.named_parameters(recurse=False)}:
        return True
    return bool(_MIXER_NAME.search(type(module).__name__))


def _takes_no_tokens(module: nn.Module) -> bool:
    """A model whose forward takes neither ``input_ids`` nor ``inputs_embeds`` (an audio or vision tower, on its own
    or inside a multimodal model): its forward builds no boundaries and never takes its parent's
    (``forward.hook._read_batch`` reads tokens), so its layers only ever mix along its own inputs (audio frames,
    patches), never along a packed text row."""
    from transformers import PreTrainedModel

    if not isinstance(module, PreTrainedModel):
        return False
    names = ForwardParameters.of(module.forward).names
    return "input_ids" not in names and "inputs_embeds" not in names


def check_coverage(model: nn.Module) -> None:
    """Raise if ``model`` holds a layer that looks like a sequence mixer and no entry covers it, or a layer
    packfree knows it cannot run exactly (an entry refused at load)."""
    covered: set[str] = set()
    unknown: set[str] = set()
    for path, module in model.named_modules():
        if any(not prefix or path == prefix or path.startswith(prefix + ".") for prefix in covered):
            continue
        entry = entry_of(type(module))
        if entry.mixer is not None or entry.refused_at_load or _takes_no_tokens(module):
            covered.add(path)
        elif not entry.mixes_nothing and _looks_like_a_mixer(module):
            unknown.add(type(module).__name__)
    entries = {type(module).__name__: entry_of(type(module)) for module in model.modules()}  # towers' too
    refused = {name: entry.refused.reason for name, entry in entries.items() if entry.refused_at_load}
    if refused:
        raise ValueError(
            "packfree cannot run these layers exactly on packed rows: "
            + "; ".join(f"{name} ({refused[name]})" for name in sorted(refused))
            + ". Load the model without packfree, or pass one sample per row"
        )
    if unknown:
        raise ValueError(
            f"packfree has no boundary adapter for {', '.join(sorted(unknown))}: these layers carry information "
            "along the sequence and would mix packed samples. " + _shadowed_class_note(model)
            + "Give them an entry naming their family (packfree_plugin.classes) or load the model without packfree"
        )


def _shadowed_class_note(model: nn.Module) -> str:
    """Why a model of a transformers type may not be transformers' own: another library registered its class for
    that type with the Auto classes (importing fla does so for ``mamba``, ``mamba2`` and ``bitnet``)."""
    import transformers

    cls = type(model)
    library = cls.__module__.split(".")[0]
    if library == "transformers" or not hasattr(transformers, cls.__name__):
        return ""
    stem = cls.__name__.removesuffix("Model")
    head = f" or, for the causal LM, transformers.{stem}ForCausalLM" if stem != cls.__name__ else ""
    return (f"This {cls.__name__} is {library}'s ({cls.__module__}), not transformers': {library} registered its "
            f"classes for this model type with transformers' Auto classes when it was imported, and packfree adapts "
            f"transformers' own. Build the model with transformers.{cls.__name__}{head} directly "
            f"(its from_pretrained takes the same arguments). ")
