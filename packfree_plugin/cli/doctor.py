"""What packfree finds on this machine, and how it will run each layer of a model here.

:func:`environment` lists torch/transformers and the optional kernel packages. :func:`plan` builds a model's
skeleton on the ``meta`` device (no weights, no memory) from a model directory's config or a model type,
and says for every layer that mixes tokens along the sequence which backend will run it on this machine,
whether packed samples stay isolated there, and whether it stays inside ``torch.compile``'s graph.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from ..mixers.registry import adapter_for
from ..classes import entry_of

__all__ = ["KERNEL_PACKAGES", "LayerPlan", "environment", "parallel_layout", "plan", "position_numbering", "render",
           "sequence_parallel_support"]

KERNEL_PACKAGES = {
    # import name: distribution name
    "torch": "torch",
    "transformers": "transformers",
    "flash_attn": "flash-attn",
    "mamba_ssm": "mamba-ssm",
    "causal_conv1d": "causal-conv1d",
    "fla": "flash-linear-attention",
    "kernels": "kernels",
}


IN_GRAPH = "in the graph"
OUTSIDE_GRAPH = "eager (1 graph break)"


@dataclass(frozen=True)
class LayerPlan:
    path: str
    cls: str
    kind: str  # "attention" | "mixer"
    backend: str
    boundary_safe: bool
    note: str = ""
    compiled: str = IN_GRAPH
    """How the layer runs under ``torch.compile``: inside the graph (packfree's opaque op), or eagerly."""


def environment() -> list[tuple[str, str | None]]:
    """``(package, version or None)`` for torch, transformers and each optional kernel package."""
    found = []
    for module, distribution in KERNEL_PACKAGES.items():
        version = None
        if importlib.util.find_spec(module) is not None:
            try:
                version = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                version = "found"
        found.append((module, version))
    return found


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Attention") and any(hasattr(module, a) for a in ("q_proj", "qkv_proj", "c_attn", "query"))


def _attention_backend(module: nn.Module, config, device: torch.device, dtype: torch.dtype) -> str:
    from ..attention import AttentionOptions, choose_backend

    heads = getattr(config, "num_attention_heads", 1) or 1
    head_dim = (getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
                or getattr(config, "head_dim", None) or 64)
    query = torch.empty(1, heads, 1, head_dim, device=device, dtype=dtype)
    value = torch.empty(1, heads, 1, getattr(module, "v_head_dim", None) or head_dim, device=device, dtype=dtype)
    softcap = getattr(config, "attn_logit_softcapping", None)
    sinks = getattr(module, "sinks", None)
    options = AttentionOptions(scale=float(getattr(module, "scaling", 1.0) or 1.0),
                               causal=bool(getattr(module, "is_causal", True)),
                               window=getattr(module, "sliding_window", None) or None,
                               softcap=softcap or None, sinks=None if sinks is None else torch.empty(heads),
                               dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0))
    return choose_backend(query, value, options, training=True)


def plan(target: str, *, device: str | None = None, dtype: torch.dtype | None = None) -> list[LayerPlan]:
    """Per sequence-mixing layer of ``target`` (model directory or model type): backend and boundary safety.

    ``device``/``dtype`` default to CUDA + bfloat16 where CUDA is available, else CPU + float32.
    """
    from ..mixers.entry import _looks_like_a_mixer
    from .tiny import auto_class, load_config

    run_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dtype = dtype or (torch.bfloat16 if run_device.type == "cuda" else torch.float32)
    config = load_config(target)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, attn_implementation="eager")
    plans: list[LayerPlan] = []
    inside: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in inside):
            continue
        name = type(module).__name__
        adapter = adapter_for(type(module))
        if adapter is not None:
            inside.append(path)
            attention = getattr(adapter, "attention", None)
            backend = f"{adapter.family} ({adapter.tier} tier" + (f", stock {attention} per sample)" if attention else ")")
            compiled = IN_GRAPH if adapter.tier == "native" else OUTSIDE_GRAPH
            plans.append(LayerPlan(path, name, "attention" if attention else "mixer", backend, True, compiled=compiled))
        elif _is_attention(module):
            # an attention layer holding an adapted mixer (e.g. ZAYA's conv projection) lists that mixer too
            if not any(adapter_for(type(child)) is not None for child in module.modules()):
                inside.append(path)
            backend = _attention_backend(module, model.config, run_device, run_dtype)
            plans.append(LayerPlan(path, name, "attention", backend, True))
        elif not entry_of(type(module)).mixes_nothing and _looks_like_a_mixer(module):
            inside.append(path)
            plans.append(LayerPlan(path, name, "mixer", "none", False,
                                   "no adapter: packfree refuses to load this model", compiled="-"))
    return plans


def render(plans: list[LayerPlan]) -> str:
    """A Markdown table, consecutive identical layers folded into one row."""
    lines = ["| layers | class | kind | backend | boundary-safe | under torch.compile |", "|---|---|---|---|---|---|"]
    groups: list[list[LayerPlan]] = []
    for item in plans:
        last = groups[-1][-1] if groups else None
        if last is not None and (last.cls, last.backend, last.boundary_safe, last.compiled) == (
                item.cls, item.backend, item.boundary_safe, item.compiled):
            groups[-1].append(item)
        else:
            groups.append([item])
    for group in groups:
        first = group[0]
        where = first.path if len(group) == 1 else f"{first.path} .. {group[-1].path} ({len(group)})"
        safe = "yes" if first.boundary_safe else f"NO ({first.note})"
        lines.append(f"| {where} | {first.cls} | {first.kind} | {first.backend} | {safe} | {first.compiled} |")
    return "\n".join(lines)


_LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def parallel_layout() -> list[tuple[str, str]]:
    """``(what, value)`` for the parallel layout this process sees: the launcher's variables (torchrun, accelerate,
    deepspeed set them), torch.distributed's group, DeepSpeed's sequence-parallel group, whether Ulysses wraps
    packfree attention, and whether torch's context_parallel is active."""
    import os
    import sys

    import torch.distributed as dist

    from ..parallel import torch_context_parallel_active

    layout = [(name, os.environ[name]) for name in _LAUNCHER_VARIABLES if name in os.environ]
    if dist.is_available() and dist.is_initialized():
        layout.append(("torch.distributed", f"{dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}"))
    else:
        layout.append(("torch.distributed", "not initialised (one process)"))
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    group = getattr(state, "_SEQUENCE_PARALLEL_GROUP", None)
    if group is not None:
        layout.append(("DeepSpeed sequence parallel", f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..attention.interface import packfree_attention_forward

    wrapped = ALL_ATTENTION_FUNCTIONS.get("packfree") not in (None, packfree_attention_forward)
    layout.append(("packfree attention", "wrapped (DeepSpeed Ulysses)" if wrapped else "direct"))
    layout.append(("torch context_parallel", "active: packed rows refused" if torch_context_parallel_active()
                   else "not active"))
    return layout


def sequence_parallel_support(target: str) -> str:
    """Whether ``target``'s packed rows can be split over ranks (``"yes"``, else the set-up refusal's message)."""
    from ..parallel.setup import check_splittable
    from ..loading.register import register
    from .tiny import auto_class, load_config

    register()
    config = load_config(target)
    try:
        with torch.device("meta"):
            model = auto_class(config).from_config(config, attn_implementation="packfree")
        check_splittable(model)
    except ValueError as error:
        return f"refused: {error}"
    return "yes (DeepSpeed Ulysses for attention, head-parallel mixers; docs/distributed.md)"


def position_numbering(target: str) -> str:
    """How ``target`` (model directory or model type) numbers a lone sample's positions: ``from 0``, ``from
    padding_idx + 1 = N (...)``, ``from N, its position_ids buffer (...)`` or ``not by ids``
    (:meth:`packfree_plugin.quirks.numbering.Numbering.describe`). Built on the meta device; a position buffer,
    which has no values there, is made again on the CPU by the model's own initialisation."""
    from ..quirks.positions import numbering_of
    from .tiny import auto_class, load_config

    config = load_config(target)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, attn_implementation="eager")
    for module in model.modules():
        if entry_of(type(module)).numbering == "position_buffer" and module.position_ids.is_meta:
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)
    return numbering_of(model).describe()
