"""How refusals show a batch's offsets: the first of them, and the ``cu_seqlens`` a ``[B, T]`` batch expects."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["layout_hint", "shown"]


def shown(offsets: Sequence[int]) -> str:
    """Offsets for a message: the first 12 of them."""
    offsets = list(offsets)
    return str(offsets) if len(offsets) <= 12 else f"[{', '.join(map(str, offsets[:12]))}, ...]"


def layout_hint(offsets: Sequence[int], batch_size: int, seq_len: int) -> str:
    """The ``cu_seqlens`` a ``[batch_size, seq_len]`` batch expects, for a message: rows start at multiples of
    ``seq_len`` and each row's padding is a segment of its own; with the lengths of ``offsets`` laid out row after
    row (a cumsum that skipped each row's padding), the offsets that layout gives, when it fits."""
    rows: list[list[int]] = [[]]
    for length in (b - a for a, b in zip(offsets, offsets[1:])):
        if length <= 0 or length > seq_len:
            rows = []
            break
        if sum(rows[-1]) + length > seq_len:
            rows.append([])
        rows[-1].append(length)
    if len(rows) != batch_size:
        return (f": each row's padding is a segment of its own, and rows start at multiples of T={seq_len}"
                if batch_size > 1 else f": a padding tail is a segment of its own, ending at T={seq_len}")
    expected = [0]
    for row in rows:
        for length in row + ([seq_len - sum(row)] if sum(row) < seq_len else []):
            expected.append(expected[-1] + length)
    return (f": for these samples laid out row by row, each row's padding a segment of its own (marked 0 in "
            f"attention_mask), pass cu_seq_lens_q = cu_seq_lens_k = {shown(expected)}")
