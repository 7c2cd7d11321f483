"""What stock transformers does on a packed row is a fact of the installed release, measured, not asserted.

A test that shows packfree exact on a row can also measure stock on that very row: stock leaking there is what makes
packfree's exactness mean something, but upstream may fix it in any release (transformers 5.25 keeps packed BERT
samples apart given ``position_ids``; 5.24 mixed them by 2.5). So the test records stock's error
(``record_property``, which lands in the JUnit XML, and in the message of any assertion that follows) and asserts only
what must hold on every release: packfree exact on the same row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers


@dataclass(frozen=True)
class StockFact:
    """Stock's packed-vs-alone error on one row, for the installed transformers."""

    what: str
    error: float
    tolerance: float

    @property
    def leaks(self) -> bool:
        return not self.error <= self.tolerance  # a NaN counts as a leak

    def __str__(self) -> str:
        verdict = "leaks" if self.leaks else "is exact"
        return (f"{self.what} {verdict} on transformers {transformers.__version__} "
                f"(packed vs alone: {self.error:.3g}, tolerance {self.tolerance:g})")


def max_abs_error(packed: Sequence[torch.Tensor], alone: Sequence[torch.Tensor]) -> float:
    """Largest ``|packed - alone|`` over the samples: each sample's piece of the packed output against its output
    alone (or in a padded batch, which stock runs as it runs each sample alone)."""
    assert len(packed) == len(alone) > 0
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(packed, alone))


def record(record_property: Callable[[str, object], None], what: str, packed: Sequence[torch.Tensor],
           alone: Sequence[torch.Tensor], *, tolerance: float) -> StockFact:
    """Measure stock's error on a packed row and record it as a property of the test; returns the fact."""
    fact = StockFact(what, max_abs_error(packed, alone), tolerance)
    record_property(f"{what}: packed vs alone", fact.error)
    record_property(f"{what}: verdict", str(fact))
    return fact
