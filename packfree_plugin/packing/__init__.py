"""Collators: batches laid out as packed rows that packfree reads as separate samples.

- :mod:`.rows`: which samples share a row under a token budget (:func:`pack_best_fit_decreasing`,
  :class:`TokenBudgetBatchSampler`) and :class:`PackedCollator`, the packed rows and their boundary fields;
- :mod:`.seq2seq`: :class:`Seq2SeqPackedCollator`, (source, target) pairs packed into encoder and decoder rows;
- :mod:`.vision`: :class:`VisionPackedCollator`, samples that carry their own images and videos;
- :mod:`.weights`: loss weights laid out on the tokens (:class:`PackedCollator` does it itself,
  :class:`WithLossWeights` around any other collator).
"""

from .rows import PackedCollator, TokenBudgetBatchSampler, pack_best_fit_decreasing, packing_efficiency
from .seq2seq import Seq2SeqPackedCollator, pack_pairs
from .vision import VisionPackedCollator
from .weights import WithLossWeights

__all__ = ["PackedCollator", "Seq2SeqPackedCollator", "TokenBudgetBatchSampler", "VisionPackedCollator",
           "WithLossWeights", "pack_best_fit_decreasing", "pack_pairs", "packing_efficiency"]
