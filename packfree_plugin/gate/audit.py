"""Leak audit: does any module let one packed sample change another sample's outputs?

The isolation proof (:mod:`.proof`) uses it to name the modules that let samples mix, and ``packfree verify``
(:mod:`packfree_plugin.cli.verify`) reports it beside the proof.

:func:`audit` packs several samples into one row (boundaries given by ``position_ids`` alone, as TRL's
padding-free collator sends them, and the model called with its default ``use_cache`` as a user would),
runs the model twice with forward hooks on every module, the second time with one sample's tokens
replaced, and reports every module whose outputs moved at a position of another sample. Outputs are
compared call by call; a tensor is position-aligned when it is ``[B, T, ...]``, ``[B, C, T]`` (convolutions)
or ``[B, H, T, D]``. Tensors of other shapes (e.g. a mixer's internal per-sample batches) are counted as
unaligned and not compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..quirks.numbering import quiet
from ..forward.signature import tensor_leaves

__all__ = ["AuditResult", "Leak", "audit", "packed_row", "record_outputs", "with_decoder_inputs"]

_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Leak:
    """One module whose output at another sample's positions changed: ``max_diff`` there."""

    module: str
    cls: str
    max_diff: float


@dataclass
class AuditResult:
    attn_implementation: str
    lengths: list[int]
    perturbed: int
    modules: int
    compared: int
    unaligned: int
    leaks: list[Leak] = field(default_factory=list)
    failure: str | None = None
    """Why the model could not run the audit at all (only ever set for the stock reference)."""

    @property
    def ok(self) -> bool:
        return not self.leaks and self.failure is None

    def summary(self, limit: int = 12) -> str:
        if self.failure is not None:
            return f"{self.attn_implementation}: could not run this input ({self.failure})"
        return self._leak_summary(limit)

    def _leak_summary(self, limit: int) -> str:
        head = (f"{self.attn_implementation}: samples {self.lengths}, perturbed sample {self.perturbed}; "
                f"{self.compared} module outputs compared ({self.unaligned} unaligned skipped) in "
                f"{self.modules} modules: ")
        if not self.leaks:
            return head + "no leak"
        lines = [head + f"{len(self.leaks)} modules leak"]
        lines += [f"  {leak.module or '<model>'} ({leak.cls}): max diff {leak.max_diff:.3g}"
                  for leak in self.leaks[:limit]]
        if len(self.leaks) > limit:
            lines.append(f"  ... and {len(self.leaks) - limit} more")
        return "\n".join(lines)


def packed_row(samples: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One packed row as TRL's padding-free collator sends it: ``input_ids [1, T]`` and ``position_ids [1, T]``."""
    return {
        "input_ids": torch.cat(list(samples))[None],
        "position_ids": torch.cat([torch.arange(len(s)) for s in samples])[None],
    }


def with_decoder_inputs(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` plus, for an encoder-decoder model, ``decoder_input_ids`` equal to its ``input_ids`` (a packed row's
    decoder then holds the same samples in the same layout as its encoder; many such models take no decoder
    inputs from nowhere)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return {**batch, "decoder_input_ids": batch["input_ids"]}
    return batch


def _time_axis(tensor: torch.Tensor, batch: int, seq_len: int) -> int | None:
    if tensor.ndim < 2 or tensor.shape[0] != batch or not tensor.is_floating_point():
        return None
    if tensor.shape[1] == seq_len:
        return 1
    if tensor.ndim == 3 and tensor.shape[2] == seq_len:
        return 2
    if tensor.ndim == 4 and tensor.shape[2] == seq_len:
        return 2
    return None


def record_outputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, list[list[torch.Tensor]]]:
    """Module path -> the detached tensors of each of its calls in one no-grad forward of ``model(**batch)``."""
    outputs: dict[str, list[list[torch.Tensor]]] = {}
    handles = []
    for name, module in model.named_modules():
        def hook(_module, _args, output, name=name):
            outputs.setdefault(name, []).append([t.detach().clone() for t in tensor_leaves(output)])

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad(), quiet():  # 0-based ids on purpose: no numbering warning
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def audit(
    model: nn.Module,
    *,
    lengths: Sequence[int] = (7, 5, 9, 6),
    perturbed: int = 0,
    seed: int = 0,
    atol: float | None = None,
) -> AuditResult:
    """Perturb sample ``perturbed`` of a packed row of ``lengths`` and report every module that leaks it.

    ``atol``: largest change at another sample's positions that is not a leak (default by dtype: 1e-10 in
    float64, 1e-5 in float32, 1e-2 in half precision).
    """
    lengths = [int(n) for n in lengths]
    if len(lengths) < 2 or min(lengths) < 1 or not 0 <= perturbed < len(lengths):
        raise ValueError(f"need >= 2 non-empty samples and a valid perturbed index, got {lengths}, {perturbed}")
    parameter = next(model.parameters())
    if atol is None:
        atol = _TOLERANCE.get(parameter.dtype, 1e-5)
    vocab = int(model.config.vocab_size)
    low = 3 if vocab > 8 else 0
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(low, vocab, (n,), generator=generator) for n in lengths]
    changed = list(samples)
    # a different token at every position of the perturbed sample
    changed[perturbed] = (samples[perturbed] - low + torch.randint(1, vocab - low, (lengths[perturbed],),
                                                                   generator=generator)) % (vocab - low) + low
    # an encoder-decoder's decoder holds the same samples, as in the load-time proof
    base = with_decoder_inputs(model, {k: v.to(parameter.device) for k, v in packed_row(samples).items()})
    other = with_decoder_inputs(model, {k: v.to(parameter.device) for k, v in packed_row(changed).items()})
    seq_len = sum(lengths)
    start = sum(lengths[:perturbed])
    outside = torch.ones(seq_len, dtype=torch.bool)
    outside[start:start + lengths[perturbed]] = False
    outside = outside.to(parameter.device)

    before, after = record_outputs(model, base), record_outputs(model, other)
    modules = dict(model.named_modules())
    leaks, compared, unaligned = [], 0, 0
    for name, calls in before.items():
        worst = 0.0
        for call_before, call_after in zip(calls, after.get(name, [])):
            for a, b in zip(call_before, call_after):
                axis = _time_axis(a, 1, seq_len)
                if axis is None or a.shape != b.shape:
                    unaligned += 1
                    continue
                compared += 1
                diff = (a.double() - b.double()).abs().index_select(axis, outside.nonzero().squeeze(1))
                if diff.numel():
                    worst = max(worst, float(diff.nan_to_num(nan=float("inf")).max()))
        if worst > atol:
            leaks.append(Leak(name, type(modules[name]).__name__, worst))
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None) or "?"
    return AuditResult(implementation, lengths, perturbed, len(modules), compared, unaligned, leaks)
