"""The rules a batch's per-token inputs follow: the shapes ``position_ids`` may take (:func:`fits_rows`), where
position ids start a sample (:func:`id_starts`), and the message for a per-token input shaped unlike the tokens."""

from __future__ import annotations

from typing import Any

import numpy
import torch

__all__ = ["fits_rows", "id_starts", "rows_of", "shape_disagreement"]


def fits_rows(position_ids: torch.Tensor, batch_size: int, seq_len: int) -> bool:
    """Whether ``position_ids`` are ``[B, T]``, ``[1, T]`` or MRoPE ``[R, B | 1, T]`` for tokens ``[B, T]``."""
    return position_ids.ndim in (2, 3) and position_ids.shape[-1] == seq_len and \
        position_ids.shape[-2] in (1, batch_size)


def rows_of(position_ids: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """``position_ids`` ``[B, T]`` (or ``[R, B, T]``), a batch of 1 broadcast to ``B``; other shapes raise."""
    if not isinstance(position_ids, torch.Tensor) or not fits_rows(position_ids, batch_size, seq_len):
        raise ValueError(shape_disagreement("position_ids", position_ids, batch_size, seq_len,
                                            expected="[B, T], [1, T] or [R, B, T] (MRoPE)"))
    if position_ids.shape[-2] == batch_size:
        return position_ids
    return position_ids.expand(*position_ids.shape[:-2], batch_size, seq_len)


def id_starts(ids: numpy.ndarray, *, planes: bool, tokens: numpy.ndarray | None = None) -> numpy.ndarray:
    """The one rule for where a sample starts by its position ids (docs/input-contract.md), along the last axis of
    host ids ``[..., L]`` of a row's kept tokens, at token indices ``tokens [L]`` (None: ``0..L-1``, every token
    kept): at the first token, and at every token whose id continues the previous token's neither by 1 nor by the
    distance between them (ids that run on across padding, as ``arange`` numbers a padded row, continue). With
    ``planes`` the first axis holds MRoPE planes without a text plane and a sample starts where every plane is 0
    (that axis is dropped). Bool ``[..., L]``. (numpy: a quarter of torch's per-call overhead.)"""
    if planes:
        return (ids == 0).all(axis=0)
    starts = numpy.empty(ids.shape, dtype=bool)
    starts[..., :1] = True
    step = ids[..., 1:] - ids[..., :-1]
    numpy.not_equal(step, 1, out=starts[..., 1:])
    if tokens is not None:
        starts[..., 1:] &= step != numpy.diff(tokens)
    return starts


def shape_disagreement(name: str, value: Any, batch_size: int, seq_len: int, *, expected: str = "[B, T]") -> str:
    """The message for a per-token input ``name`` whose shape disagrees with the tokens' ``[batch_size, seq_len]``:
    both shapes, the likely cause and the fix."""
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    cause = ""
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[-1] != seq_len:
        cause = (f" Its last dimension holds {value.shape[-1]} tokens, the rows {seq_len}: padded (or truncated) "
                 "apart from input_ids, e.g. a collator's pad_to_multiple_of applied to some fields only.")
    elif isinstance(value, torch.Tensor) and value.ndim == 1:
        cause = f" A 1-D tensor gives no rows; pass it as [1, {seq_len}] or [{batch_size}, {seq_len}]."
    return (f"{name} has shape {shape} but the tokens (input_ids or inputs_embeds) are [B={batch_size}, T={seq_len}]"
            f"; {name} must be {expected}.{cause} Build every per-token field of the batch with the same padding")
