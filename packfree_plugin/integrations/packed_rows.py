"""Where the real tokens of a padded ``[B, L]`` batch sit in packed rows, and the moves between the two layouts.

:class:`PackedRows` reads a padded ``attention_mask`` (each row's ones contiguous: right-, left- or both-side
padding) and lays its rows' real tokens out in ``R`` rows of ``T`` tokens: one row when no budget is given, else
rows of at most ``max_tokens_per_row`` tokens (best-fit decreasing), padded to the fullest. It moves tokens and
labels to the packed rows, next-token predictions and per-sample values back, and carries the packed rows'
:class:`~packfree_plugin.Boundaries` and restarting positions. Used by TRL's packed scoring
(:mod:`packfree_plugin.integrations.trl`); nothing here depends on TRL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy
import torch

from ..boundaries import Boundaries
from ..packing import pack_best_fit_decreasing

__all__ = ["PackedRows"]


@dataclass(frozen=True)
class PackedRows:
    """Where the real tokens of a padded ``[B, L]`` batch sit in packed ``[R, T]`` rows.

    Attributes:
        batch_size, length: ``B`` and ``L`` of the padded batch.
        rows, row_len: ``R`` and ``T`` of the packed rows.
        padded_index / packed_index: ``[n_tokens]`` flat token indices (over ``B * L`` and ``R * T``) of the same
            tokens.
        padded_shifted / packed_shifted: ``[n_predictions]`` flat indices over ``B * (L - 1)`` and ``R * (T - 1)``
            of the next-token predictions that stay inside a sample (a sample of ``n`` tokens makes ``n - 1``).
        sample_starts: ``[n_samples]`` flat packed index of every sample's first token.
        order: ``[n_samples]`` padded row of each packed sample, row-major (padding spans skipped).
        position_ids: ``[R, T]`` restarting at 0 in every sample (and in each row's padding tail).
        attention_mask: ``[R, T]``, 0 on the padding tails, or None when no row has one.
        boundaries: the packed rows' samples and padding tails.
    """

    batch_size: int
    length: int
    rows: int
    row_len: int
    padded_index: torch.Tensor
    packed_index: torch.Tensor
    padded_shifted: torch.Tensor
    packed_shifted: torch.Tensor
    sample_starts: torch.Tensor
    order: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    boundaries: Boundaries

    @classmethod
    def of(cls, attention_mask: torch.Tensor, max_tokens_per_row: int | None = None) -> PackedRows:
        """Pack the rows of a padded ``attention_mask [B, L]`` (1 on real tokens).

        Without ``max_tokens_per_row`` all samples share one row, in batch order. With it, samples go into rows of at
        most that many tokens (:func:`~packfree_plugin.packing.pack_best_fit_decreasing`; a longer sample raises),
        keeping batch order inside a row, and every row is padded to the fullest one.

        Raises:
            ValueError: the mask is not 2-D, a row has no real token, or a row's real tokens are not contiguous.
        """
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
            shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"packing reads a 2-D [B, L] padding mask, got {shape}")
        host = attention_mask.detach().to("cpu") != 0
        batch_size, length = host.shape
        positions = torch.arange(length)
        lengths = host.sum(1)
        first = torch.where(host, positions, length).amin(1)
        last = torch.where(host, positions, -1).amax(1)
        empty = (lengths == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"row {empty[0]} of the batch has no real token (attention_mask all 0): nothing to pack")
        holey = (last - first + 1 != lengths).nonzero().flatten().tolist()
        if holey:
            raise ValueError(
                f"row {holey[0]}'s real tokens are not contiguous (attention_mask has zeros between ones): "
                "packfree packs padded rows, one sample per row, and would have to guess this row's samples"
            )
        sizes, starts = lengths.tolist(), first.tolist()
        if max_tokens_per_row is None:
            bins = [list(range(batch_size))]
        else:
            bins = [sorted(members) for members in pack_best_fit_decreasing(sizes, max_tokens_per_row)]
        row_len = max(sum(sizes[i] for i in members) for members in bins)
        return cls._lay_out(bins, sizes, starts, length, row_len, attention_mask)

    @classmethod
    def _lay_out(cls, bins: list[list[int]], sizes: list[int], starts: list[int], length: int, row_len: int,
                 attention_mask: torch.Tensor) -> PackedRows:
        indices: dict[str, list[numpy.ndarray]] = {"padded": [], "packed": [], "padded_shifted": [],
                                                   "packed_shifted": []}
        position_ids = numpy.zeros((len(bins), row_len), dtype=numpy.int64)
        offsets, padding, order = [0], [], []
        for row, members in enumerate(bins):
            offset = 0
            for i in members:
                size, start = sizes[i], starts[i]
                indices["padded"].append(i * length + start + numpy.arange(size))
                indices["packed"].append(row * row_len + offset + numpy.arange(size))
                indices["padded_shifted"].append(i * (length - 1) + start + numpy.arange(size - 1))
                indices["packed_shifted"].append(row * (row_len - 1) + offset + numpy.arange(size - 1))
                position_ids[row, offset:offset + size] = numpy.arange(size)
                offset += size
                offsets.append(row * row_len + offset)
                padding.append(False)
                order.append(i)
            if offset < row_len:
                position_ids[row, offset:] = numpy.arange(row_len - offset)
                offsets.append((row + 1) * row_len)
                padding.append(True)
        device = attention_mask.device

        def tensor(values: Sequence[int] | numpy.ndarray) -> torch.Tensor:
            return torch.as_tensor(numpy.asarray(values, dtype=numpy.int64), device=device)

        flat = {name: tensor(numpy.concatenate(parts)) for name, parts in indices.items()}
        mask = None
        if any(padding):
            keep = numpy.zeros(len(bins) * row_len, dtype=numpy.int64)
            keep[numpy.concatenate(indices["packed"])] = 1
            mask = tensor(keep).view(len(bins), row_len).to(attention_mask.dtype)
        sample_starts = [start for start, pad in zip(offsets, padding) if not pad]
        return cls(
            batch_size=len(sizes), length=length, rows=len(bins), row_len=row_len,
            padded_index=flat["padded"], packed_index=flat["packed"],
            padded_shifted=flat["padded_shifted"], packed_shifted=flat["packed_shifted"],
            sample_starts=tensor(sample_starts), order=tensor(order), position_ids=tensor(position_ids),
            attention_mask=mask,
            boundaries=Boundaries(offsets, batch_size=len(bins), seq_len=row_len, device=device, padding=padding),
        )

    @property
    def padded_tokens(self) -> int:
        """Tokens a padded forward runs, ``B * L``."""
        return self.batch_size * self.length

    @property
    def packed_tokens(self) -> int:
        """Tokens the packed forward runs, ``R * T``."""
        return self.rows * self.row_len

    def pack(self, padded: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """``[B, L, ...]`` -> ``[R, T, ...]``: every real token moved to its packed place, ``fill`` elsewhere."""
        rest = padded.shape[2:]
        flat = padded.reshape(self.batch_size * self.length, *rest)
        out = flat.new_full((self.rows * self.row_len, *rest), fill)
        return out.index_put((self.packed_index,), flat[self.padded_index]).view(self.rows, self.row_len, *rest)

    def unpack_predictions(self, packed: torch.Tensor) -> torch.Tensor:
        """``[R, T - 1, ...]`` next-token values -> ``[B, L - 1, ...]``, zero (False) where no prediction of a sample
        lands (padding, each sample's first token, and what a sample's last token would predict in a packed row)."""
        rest = packed.shape[2:]
        flat = packed.reshape(self.rows * (self.row_len - 1), *rest)
        out = flat.new_zeros((self.batch_size * (self.length - 1), *rest))
        out = out.index_put((self.padded_shifted,), flat[self.packed_shifted])
        return out.view(self.batch_size, self.length - 1, *rest)

    def packed_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Padded ``labels [B, L]`` -> ``[R, T]``: -100 on padding and at every sample's first token, so no label
        is predicted across two samples."""
        packed = self.pack(labels, fill=-100).reshape(-1)
        packed[self.sample_starts] = -100
        return packed.view(self.rows, self.row_len)

    def in_row_order(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[n_samples, ...]`` values in packed order -> ``[B, ...]`` in the padded batch's row order."""
        out = per_sample.new_zeros((self.batch_size, *per_sample.shape[1:]))
        return out.index_put((self.order,), per_sample)
