"""The reference the loss tests hold :func:`packfree_plugin.packed_loss` to: the same samples, one per row, padded, on
the stock model, reduced by plain per-row code written apart from the loss module (a loop over rows: clear, not
fast); and the packed batches those samples make."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packfree_plugin.packing import PackedCollator, pack_best_fit_decreasing
from tests.helpers import padded_batch, samples_of

WEIGHTINGS = ("none", "token", "sample")
"""No weights, per-token weights, per-sample weights."""
REDUCTIONS = ("token", "sample", "none")


@dataclass(frozen=True)
class Samples:
    """Samples with their loss weights, and the order a packed batch of them holds them in."""

    ids: list[list[int]]
    token_weights: list[list[float]]
    sample_weights: list[float]

    @classmethod
    def drawn(cls, lengths: list[int], seed: int = 0) -> Samples:
        """Weights are multiples of 1/16 in [0.5, 3]: exact in the collators' float32."""
        generator = torch.Generator().manual_seed(seed)
        ids = samples_of(lengths, seed=seed)
        token_weights = [(torch.randint(8, 49, (n,), generator=generator) / 16).tolist() for n in lengths]
        sample_weights = (torch.randint(8, 49, (len(lengths),), generator=generator) / 16).tolist()
        return cls(ids, token_weights, sample_weights)

    def features(self, weighting: str) -> list[dict]:
        """One feature per sample, with the weights ``weighting`` names (one of :data:`WEIGHTINGS`, or both)."""
        features = [{"input_ids": ids} for ids in self.ids]
        for feature, tokens, sample in zip(features, self.token_weights, self.sample_weights):
            if weighting in ("token", "both"):
                feature["token_weights"] = tokens
            if weighting in ("sample", "both"):
                feature["sample_weight"] = sample
        return features

    def packed(self, weighting: str, budget: int, rows: int) -> dict[str, torch.Tensor]:
        """:class:`PackedCollator` rows of ``budget`` tokens (labels included)."""
        return PackedCollator(rows_per_batch=rows, max_tokens=budget)(self.features(weighting))

    @staticmethod
    def packed_order(lengths: list[int], budget: int) -> list[int]:
        """The samples' indices in a packed batch's sample order (its rows' bins, each in input order)."""
        return [index for members in pack_best_fit_decreasing(lengths, budget) for index in sorted(members)]

    def padded(self) -> dict[str, torch.Tensor]:
        return padded_batch(self.ids)


def per_row_losses(logits: torch.Tensor, labels: torch.Tensor, samples: Samples,
                   weighting: str) -> tuple[list[torch.Tensor], list[int]]:
    """Each padded row's weighted next-token loss sum and its number of targets."""
    sums, counts = [], []
    for row in range(labels.shape[0]):
        targets, predicting = labels[row, 1:], logits[row, :-1]
        kept = targets != -100
        losses = F.cross_entropy(predicting[kept].to(torch.float64), targets[kept], reduction="none")
        if weighting in ("token", "both"):
            weights = torch.tensor(samples.token_weights[row], dtype=torch.float64)
            padded = torch.cat([weights, weights.new_zeros(labels.shape[1] - len(weights))])
            losses = losses * padded[1:][kept]
        if weighting in ("sample", "both"):
            losses = losses * samples.sample_weights[row]
        sums.append(losses.sum())
        counts.append(int(kept.sum()))
    return sums, counts


def reference_loss(logits: torch.Tensor, labels: torch.Tensor, samples: Samples, weighting: str, reduction: str, *,
                   tokens: int | None = None, count: int | None = None) -> torch.Tensor:
    """The reduction of a padded batch's losses: ``tokens`` / ``count``, the denominators of an accumulated batch."""
    sums, counts = per_row_losses(logits, labels, samples, weighting)
    if reduction == "token":
        return torch.stack(sums).sum() / (tokens if tokens is not None else sum(counts))
    means = [total / n if n else torch.tensor(float("nan"), dtype=torch.float64) for total, n in zip(sums, counts)]
    if reduction == "none":
        return torch.stack(means)
    with_targets = [mean for mean, n in zip(means, counts) if n]
    return torch.stack(with_targets).sum() / (count if count is not None else len(with_targets))
