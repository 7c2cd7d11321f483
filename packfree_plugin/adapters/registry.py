"""Registry of sequence mixers (layers that carry information along the sequence outside attention).

One :class:`MixerAdapter` per family names the transformers layer classes it covers and how packed
boundaries reach them. :func:`wrap_mixers` gives every covered layer of a model an instance-level forward
that, while a packed batch is in flight, runs the adapter; otherwise the layer's own forward runs
untouched. A layer that looks like a sequence mixer but has no adapter is refused at load
(:func:`check_coverage`): packfree never lets one mix samples silently.

Where does a layer get its boundaries? From :data:`packfree_plugin.attention.active_boundaries`, set by
the model hook for the whole forward and by the decoder-layer hook around each layer (which also covers
the recomputation of gradient checkpointing). Native adapters read ``boundaries.seq_idx`` /
``boundaries.cu_seqlens`` from it; the generic tier reads the host offsets.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..attention import active_boundaries
from ..boundaries import Boundaries
from .generic import run_unpacked

__all__ = ["MixerAdapter", "REGISTRY", "register_adapter", "wrap_mixers", "unwrap_mixers", "check_coverage"]

_ORIGINAL_FORWARD = "_packfree_original_forward"

# Arguments that make no sense for one sample run on its own: caches, masks and packed boundary inputs.
_CLEARED_PARAMETERS = ("cache", "cache_params", "past_key_values", "layer_past", "state", "attention_mask",
                       "cache_position", "mask")
_DROPPED_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
                   "packfree_boundaries", "use_cache")

NativeRun = Callable[[nn.Module, Callable, Boundaries, dict[str, Any]], Any]
"""``(layer, original_forward, boundaries, bound_arguments) -> output``."""


@dataclass(frozen=True)
class MixerAdapter:
    """How packed boundaries reach one family of sequence-mixing layers.

    ``class_names``: transformers layer classes covered. ``native``: a boundary-aware implementation
    (None: the generic unpack-run-repack tier). ``hidden_arg``: the forward's input argument.
    ``output_index``: None when the forward returns the hidden states, else their index in the returned
    tuple (the other entries, recurrent states, come back as None). ``per_sample``: extra arguments
    the layer needs when run on one right-padded sample batch, from ``(num_samples, length, device)``.
    """

    family: str
    class_names: tuple[str, ...]
    native: NativeRun | None = None
    hidden_arg: str = "hidden_states"
    output_index: int | None = None
    per_sample: Callable[[int, int, torch.device], dict[str, Any]] | None = None
    notes: str = field(default="", compare=False)

    @property
    def tier(self) -> str:
        return "native" if self.native is not None else "generic"


REGISTRY: dict[str, MixerAdapter] = {}
"""Layer class name -> adapter."""


def register_adapter(adapter: MixerAdapter) -> MixerAdapter:
    for name in adapter.class_names:
        if name in REGISTRY and REGISTRY[name] != adapter:
            raise ValueError(f"{name} already has an adapter ({REGISTRY[name].family})")
        REGISTRY[name] = adapter
    return adapter


def positions_per_sample(num_samples: int, length: int, device: torch.device) -> dict[str, Any]:
    """``position_ids`` restarting at 0 in every sample of a right-padded batch."""
    return {"position_ids": torch.arange(length, device=device).expand(num_samples, length)}


def _generic(adapter: MixerAdapter, layer: nn.Module, original: Callable, boundaries: Boundaries,
             arguments: dict[str, Any]) -> Any:
    parameters = inspect.signature(original).parameters
    extra = dict(arguments.pop("kwargs", {}))
    for name in _DROPPED_KWARGS:
        extra.pop(name, None)
    fixed = {name: value for name, value in arguments.items() if name != adapter.hidden_arg}
    for name in _CLEARED_PARAMETERS:
        if name in parameters:
            fixed[name] = None
    if "use_cache" in parameters:
        fixed["use_cache"] = False

    def run(samples: torch.Tensor) -> torch.Tensor:
        call = {**fixed, **extra, adapter.hidden_arg: samples}
        if adapter.per_sample is not None:
            call.update(adapter.per_sample(samples.shape[0], samples.shape[1], samples.device))
        out = original(**{k: v for k, v in call.items() if k in parameters or _takes_kwargs(parameters)})
        return out if adapter.output_index is None else out[adapter.output_index]

    hidden = run_unpacked(run, arguments[adapter.hidden_arg], boundaries)
    if adapter.output_index is None:
        return hidden
    return tuple(hidden if i == adapter.output_index else None for i in range(adapter.output_index + 1))


def _takes_kwargs(parameters) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _packed_forward(layer: nn.Module, adapter: MixerAdapter) -> Callable:
    original = getattr(layer, _ORIGINAL_FORWARD)
    signature = inspect.signature(original)
    native = adapter.native

    def forward(*args, **kwargs):
        boundaries = active_boundaries.get()
        if boundaries is None or not (boundaries.is_packed or boundaries.has_padding):
            return original(*args, **kwargs)
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        hidden = arguments.get(adapter.hidden_arg)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape[:2]) != (boundaries.batch_size, boundaries.seq_len):
            return original(*args, **kwargs)
        if native is not None:
            return native(layer, original, boundaries, arguments)
        return _generic(adapter, layer, original, boundaries, arguments)

    return forward


def wrap_mixers(model: nn.Module) -> list[tuple[str, str]]:
    """Give every covered mixer in ``model`` its packed forward (idempotent); returns ``(path, tier)`` pairs."""
    from . import families  # noqa: F401  (fills REGISTRY)

    wrapped = []
    for path, module in model.named_modules():
        adapter = REGISTRY.get(type(module).__name__)
        if adapter is None:
            continue
        if not hasattr(module, _ORIGINAL_FORWARD):
            setattr(module, _ORIGINAL_FORWARD, module.forward)
            module.forward = _packed_forward(module, adapter)
        wrapped.append((path, adapter.tier))
    return wrapped


def unwrap_mixers(model: nn.Module) -> None:
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL_FORWARD, None)
        if original is not None:
            module.__dict__.pop("forward", None)


_RECURRENT_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_first", "recurrent_param", "a_param"})
_MIXER_NAME = re.compile(r"(Rwkv|RWKV|Lstm|LSTM|Lightning|Indexer|Compressor|ShortConv|DeltaNet|Mamba.*Mixer)")


def _looks_like_a_mixer(module: nn.Module) -> bool:
    """A layer that carries information along the sequence: owns a Conv1d, a recurrent parameter, or a mixer name."""
    if any(isinstance(child, nn.Conv1d) for child in module.children()):
        return True
    if _RECURRENT_PARAMETERS & {name for name, _ in module.named_parameters(recurse=False)}:
        return True
    return bool(_MIXER_NAME.search(type(module).__name__))


def check_coverage(model: nn.Module) -> None:
    """Raise if ``model`` holds a layer that looks like a sequence mixer and no adapter covers it."""
    from . import families  # noqa: F401  (fills REGISTRY)

    covered: set[str] = set()
    unknown: set[str] = set()
    for path, module in model.named_modules():
        if any(path == prefix or path.startswith(prefix + ".") for prefix in covered):
            continue
        name = type(module).__name__
        if name in REGISTRY:
            covered.add(path)
        elif name not in families.NOT_MIXERS and _looks_like_a_mixer(module):
            unknown.add(name)
    if unknown:
        raise ValueError(
            f"packfree has no boundary adapter for {', '.join(sorted(unknown))}: these layers carry information "
            "along the sequence and would mix packed samples. Register a MixerAdapter for them "
            "(packfree_plugin.adapters.registry) or load the model without packfree"
        )
