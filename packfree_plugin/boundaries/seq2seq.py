"""A packed seq2seq forward's two sides: :class:`Seq2SeqBoundaries` pairs the encoder's samples with the decoder's."""

from __future__ import annotations

from .store import kept_form, memo
from .tiling import Boundaries

__all__ = ["Seq2SeqBoundaries"]


class Seq2SeqBoundaries:
    """The two sides of a packed seq2seq forward: the encoder's rows ``[B, Te]`` and the decoder's ``[B, Td]``, each
    tiled by its own :class:`Boundaries`, and which encoder sample each decoder sample reads. Row ``i``'s ``k``-th
    decoder sample reads row ``i``'s ``k``-th encoder sample (padding spans do not count on either side).

    Built once per forward by the model entry (:mod:`packfree_plugin.forward.encoder_decoder`), which attaches it to both sides
    (:meth:`of` reads it back): the decoder runs on ``decoder``, and its cross-attention receives this object as its
    mask, the way self-attention receives a :class:`Boundaries`.

    Attributes:
        encoder, decoder: the two sides' boundaries (same ``B``).
        pairs: host tuple of ``(decoder_start, decoder_length, encoder_start, encoder_length)``, one per decoder
            sample, offsets over the flattened ``B * Td`` and ``B * Te`` tokens.
    """

    __slots__ = ("encoder", "decoder", "pairs")
    _FORM = "seq2seq"

    def __init__(self, encoder: Boundaries, decoder: Boundaries) -> None:
        """Pair the samples of ``encoder`` and ``decoder`` row by row; a row whose sides hold different numbers of
        samples raises ``ValueError``."""
        if encoder.batch_size != decoder.batch_size:
            raise ValueError(f"the encoder has {encoder.batch_size} rows but the decoder {decoder.batch_size}")
        encoder_rows, decoder_rows = _samples_by_row(encoder), _samples_by_row(decoder)
        pairs = []
        for row, (sources, targets) in enumerate(zip(encoder_rows, decoder_rows)):
            if len(sources) != len(targets):
                raise ValueError(
                    f"row {row} packs {len(sources)} encoder samples but {len(targets)} decoder samples; a packed "
                    "seq2seq row pairs its k-th encoder sample with its k-th decoder sample. Pack the same samples on "
                    "both sides (decoder_position_ids restarting at 0 where each target starts, padding marked by "
                    "decoder_attention_mask)"
                )
            pairs += [(*target, *source) for source, target in zip(sources, targets)]
        self.encoder = encoder
        self.decoder = decoder
        self.pairs: tuple[tuple[int, int, int, int], ...] = tuple(pairs)

    def attach(self) -> Seq2SeqBoundaries:
        """Make :meth:`of` find this pairing from either side's boundaries; returns self."""
        for side in (self.encoder, self.decoder):
            memo(side, self._FORM, None, lambda: self)
        return self

    @classmethod
    def of(cls, boundaries: Boundaries | None) -> Seq2SeqBoundaries | None:
        """The pairing ``boundaries`` belong to (as encoder or decoder), None when they belong to none."""
        return None if boundaries is None else kept_form(boundaries, cls._FORM)

    def __repr__(self) -> str:
        return f"Seq2SeqBoundaries(encoder={self.encoder!r}, decoder={self.decoder!r})"


def _samples_by_row(boundaries: Boundaries) -> list[list[tuple[int, int]]]:
    """``(start, length)`` of every sample (padding spans left out), row by row."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(boundaries.batch_size)]
    for start, length, pad in zip(boundaries.offsets, boundaries.lengths, boundaries.padding):
        if not pad:
            rows[start // boundaries.seq_len].append((start, length))
    return rows
