"""Device-side boundary helpers shared by the ops: cu_seqlens <-> seq_idx, first-token masks.

Nothing here syncs with the host unless values are validated (see :func:`resolve_seq_idx`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..boundaries import memo, seq_idx_of

__all__ = [
    "cu_seqlens_to_seq_idx",
    "describe_cu_seqlens",
    "first_token_mask",
    "sample_starts",
    "same_sample_as_previous",
    "resolve_seq_idx",
]


def cu_seqlens_to_seq_idx(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """``cu_seqlens [N+1]`` -> ``seq_idx [1, T]`` int32 (sample index per token), device-side
    (:func:`packfree_plugin.boundaries.seq_idx_of`). Empty samples (repeated offsets) simply do not appear in it."""
    return seq_idx_of(cu_seqlens, total_tokens).to(torch.int32).unsqueeze(0)


def first_token_mask(seq_idx: Tensor) -> Tensor:
    """``seq_idx [B, T]`` -> bool ``[B, T]``, True where a token is the first of its sample."""
    first = torch.ones_like(seq_idx, dtype=torch.bool)
    first[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return first


def sample_starts(seq_idx: Tensor) -> Tensor:
    """``seq_idx [B, T]`` -> ``[B, T]`` int64 on its device: the column where every token's sample starts (token
    ``t``'s position inside its sample is ``t`` minus it)."""
    B, T = seq_idx.shape
    columns = torch.arange(T, device=seq_idx.device).expand(B, T)
    return torch.where(first_token_mask(seq_idx), columns, torch.zeros_like(columns)).cummax(dim=1).values


def same_sample_as_previous(seq_idx: Tensor, shift: int) -> Tensor:
    """bool ``[B, T - shift]``: token ``t + shift`` belongs to the same sample as token ``t``."""
    return seq_idx[:, shift:] == seq_idx[:, :-shift]


def _check_seq_idx_values(seq_idx: Tensor) -> None:
    """Raise unless ``seq_idx`` is non-negative and non-decreasing along T; read once per tensor version (every
    layer of a forward passes the same tensor)."""
    if seq_idx.numel():
        memo(seq_idx, "checked", None, lambda: _read_seq_idx_values(seq_idx))


def _read_seq_idx_values(seq_idx: Tensor) -> None:
    if bool((seq_idx < 0).any()):
        b, t = (int(v) for v in (seq_idx < 0).nonzero()[0])
        raise ValueError(f"seq_idx must be non-negative; seq_idx[{b}, {t}] = {int(seq_idx[b, t])}")
    step = seq_idx[:, 1:] - seq_idx[:, :-1]
    if bool((step < 0).any()):
        b, t = (int(v) for v in (step < 0).nonzero()[0])
        raise ValueError(
            "seq_idx must be non-decreasing along T; "
            f"row {b} goes {int(seq_idx[b, t])} -> {int(seq_idx[b, t + 1])} at t={t + 1}"
        )


def check_cu_seqlens_form(cu_seqlens: Tensor, batch: int, device: torch.device) -> None:
    """Checks that need no device sync: type, int32/int64, ``[N+1]`` with N >= 1, device, ``B == 1``."""
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the data is on {device}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (one flattened row), got B={batch}")


def _check_cu_seqlens(cu_seqlens: Tensor, batch: int, total_tokens: int, device: torch.device,
                      validate: bool) -> None:
    check_cu_seqlens_form(cu_seqlens, batch, device)
    if validate:
        memo(cu_seqlens, "checked", total_tokens, lambda: _read_cu_seqlens_values(cu_seqlens, total_tokens))


def _read_cu_seqlens_values(cu_seqlens: Tensor, total_tokens: int) -> None:
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != total_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at T={total_tokens}, got {first} ... {last}"
        )
    step = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((step < 0).any()):
        i = int((step < 0).nonzero()[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing; cu_seqlens[{i}] = {int(cu_seqlens[i])} > "
            f"cu_seqlens[{i + 1}] = {int(cu_seqlens[i + 1])}"
        )


def describe_cu_seqlens(cu_seqlens: Tensor, seq_idx: Tensor) -> Tensor:
    """Give ``cu_seqlens [N+1]`` its per-token form ``seq_idx [1, T]`` (int32, the same split: what
    :func:`cu_seqlens_to_seq_idx` would compute), for a caller that holds both, built together (packfree's
    boundaries), so that :func:`resolve_seq_idx` does not derive it again. Returns ``cu_seqlens``."""
    memo(cu_seqlens, "seq_idx", seq_idx.shape[-1], lambda: seq_idx)
    return cu_seqlens


def resolve_seq_idx(
    batch: int,
    total_tokens: int,
    device: torch.device,
    *,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor | None:
    """Check the boundary arguments and return ``seq_idx [B, T]`` int32 (or None: no boundaries).

    ``validate=None`` checks values only for CPU tensors (no host sync on accelerators).
    """
    if validate is None:
        validate = device.type == "cpu"
    if seq_idx is not None:
        if not isinstance(seq_idx, Tensor):
            raise ValueError(f"seq_idx must be a torch.Tensor, got {type(seq_idx).__name__}")
        if seq_idx.dtype != torch.int32:
            raise ValueError(f"seq_idx must be int32, got {seq_idx.dtype}")
        if tuple(seq_idx.shape) != (batch, total_tokens):
            raise ValueError(
                f"seq_idx must have shape [B, T] = {[batch, total_tokens]}, got {list(seq_idx.shape)}"
            )
        if seq_idx.device != device:
            raise ValueError(f"seq_idx is on {seq_idx.device} but the data is on {device}")
        if validate:
            _check_seq_idx_values(seq_idx)
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, batch, total_tokens, device, validate)
        # every layer of a forward passes the same cu_seqlens
        from_cu = memo(cu_seqlens, "seq_idx", total_tokens, lambda: cu_seqlens_to_seq_idx(cu_seqlens, total_tokens))
        if seq_idx is None:
            return from_cu
        if validate and not torch.equal(first_token_mask(from_cu), first_token_mask(seq_idx)):
            raise ValueError(
                f"seq_idx and cu_seqlens describe different splits: cu_seqlens={cu_seqlens.tolist()}, "
                f"sample starts in seq_idx at {first_token_mask(seq_idx)[0].nonzero().flatten().tolist()}"
            )
    return seq_idx
