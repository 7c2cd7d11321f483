"""``packfree verify``: the isolation proof and the leak audit of one model, under packfree and on stock.

:func:`verify` runs both checks: the isolation proof of :mod:`packfree_plugin.gate.proof` (each packed sample
against that sample run alone on stock transformers, which also catches results that are wrong without
crossing samples, e.g. positions counted from the wrong origin) and the perturbation audit of
:mod:`packfree_plugin.gate.audit`, which names the modules that let samples mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..quirks.positions import numbering_of
from ..gate import bypassed
from ..gate.audit import AuditResult, audit
from ..gate.proof import Proof, prove
from .tiny import load_model

__all__ = ["Verdict", "verify"]


@dataclass
class Verdict(AuditResult):
    """The leak audit of a model under packfree, with its packed samples compared against each sample alone."""

    alone: Proof | None = None
    """Packed samples against each sample alone on stock (None: not compared)."""
    alone_failure: str | None = None
    """Why the alone comparison could not run (stock failed on a sample alone)."""
    numbering: str = ""
    """How the model numbers a lone sample's positions (:meth:`~packfree_plugin.quirks.numbering.Numbering.describe`)."""

    @property
    def ok(self) -> bool:
        return super().ok and (self.alone is None or self.alone.exact)

    def summary(self, limit: int = 12) -> str:
        lines = [super().summary(limit)]
        if self.alone is not None:
            lines.append(f"{self.attn_implementation}: against each sample alone: {self.alone.verdict()}")
        elif self.alone_failure is not None:
            lines.append(f"{self.attn_implementation}: not compared with each sample alone ({self.alone_failure})")
        if self.numbering:
            lines.append(f"positions of a lone sample: {self.numbering}")
        return "\n".join(lines)


def verify(target: str, *, lengths: Sequence[int] = (7, 5, 9, 6), reference: str = "sdpa",
           dtype: torch.dtype = torch.float64) -> tuple[Verdict, AuditResult | None]:
    """Audit ``target`` (a model directory or model type) under packfree (the leak audit, and each packed
    sample against that sample alone on stock ``reference``, else ``sdpa``), and audit stock ``reference``.

    The model is built past the load-time gate (:mod:`packfree_plugin.gate`), which would refuse a model
    that fails this very check. Returns ``(packfree_result, reference_result)``; the reference is None when
    ``reference`` is empty.
    """
    with bypassed():
        model = load_model(target, "packfree", dtype=dtype)
    mine = Verdict(**vars(audit(model, lengths=lengths)), numbering=numbering_of(model).describe())
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
