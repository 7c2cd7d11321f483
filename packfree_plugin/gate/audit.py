"""Leak audit: does any module let one packed sample change another sample's outputs? And does each packed
sample give what it gives alone?

:func:`verify` runs both checks: the isolation proof of :mod:`packfree_plugin.gate.proof` (each packed sample
against that sample run alone on stock transformers, which also catches results that are wrong without
crossing samples, e.g. positions counted from the wrong origin) and the perturbation audit below, which names
the modules that let samples mix.

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

from .gate.proof import Proof, with_decoder_inputs

__all__ = ["AuditResult", "Leak", "audit", "packed_row"]

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
    alone: Proof | None = None
    """Packed samples against each sample alone on stock (None: not compared)."""
    alone_failure: str | None = None
    """Why the alone comparison could not run (stock failed on a sample alone)."""

    @property
    def ok(self) -> bool:
        return not self.leaks and self.failure is None and (self.alone is None or self.alone.exact)

    def summary(self, limit: int = 12) -> str:
        if self.failure is not None:
            return f"{self.attn_implementation}: could not run this input ({self.failure})"
        lines = [self._leak_summary(limit)]
        if self.alone is not None:
            lines.append(f"{self.attn_implementation}: against each sample alone: {self.alone.verdict()}")
        elif self.alone_failure is not None:
            lines.append(f"{self.attn_implementation}: not compared with each sample alone ({self.alone_failure})")
        return "\n".join(lines)

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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


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


def _record(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, list[list[torch.Tensor]]]:
    outputs: dict[str, list[list[torch.Tensor]]] = {}
    handles = []
    for name, module in model.named_modules():
        def hook(_module, _args, output, name=name):
            outputs.setdefault(name, []).append([t.detach().clone() for t in _tensors(output)])

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
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

    before, after = _record(model, base), _record(model, other)
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


def verify(target: str, *, lengths: Sequence[int] = (7, 5, 9, 6), reference: str = "sdpa",
           dtype: torch.dtype = torch.float64) -> tuple[AuditResult, AuditResult | None]:
    """Audit ``target`` (a model directory or model type) under packfree (the leak audit, and each packed
    sample against that sample alone on stock ``reference``, else ``sdpa``), and audit stock ``reference``.

    The model is built past the load-time gate (:mod:`packfree_plugin.gate`), which would refuse a model
    that fails this very check. Returns ``(packfree_result, reference_result)``; the reference is None when
    ``reference`` is empty.
    """
    from .gate import bypassed
    from .gate.proof import prove
    from .tiny import load_model

    with bypassed():
        model = load_model(target, "packfree", dtype=dtype)
    mine = audit(model, lengths=lengths)
    try:
        stock = load_model(target, reference or "sdpa", dtype=dtype)
    except ValueError:  # e.g. Mamba2 has no sdpa path: its stock implementation is eager
        stock = load_model(target, "eager", dtype=dtype)
    stock.load_state_dict(model.state_dict())
    try:
        mine.alone = prove(model, stock, stock_name=stock.config._attn_implementation, lengths=lengths)
    except Exception as error:  # noqa: BLE001 - stock cannot run a sample alone: nothing to compare with
        mine.alone_failure = f"stock {type(error).__name__}: {error}"
    theirs = None
    if reference:
        try:
            theirs = audit(stock, lengths=lengths)
        except Exception as error:  # the reference is informative: its own bugs must not hide packfree's verdict
            implementation = stock.config._attn_implementation
            theirs = AuditResult(implementation, list(lengths), 0, 0, 0, 0, failure=f"{type(error).__name__}: {error}")
    return mine, theirs
