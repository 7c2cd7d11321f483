"""Helpers shared by the chunked linear-recurrence op tests (gated delta / KDA, linear attention, LRU)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

F64 = torch.float64


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kw) -> None:
    """torch's assert_close, which already fails on NaN (equal_nan=False); float64 tolerances by default."""
    kw.setdefault("rtol", 1e-9)
    kw.setdefault("atol", 1e-9)
    torch.testing.assert_close(actual, expected, **kw)


def sample_lengths(chunk: int, *, allow_empty: bool = False, long_chunks: tuple[int, int] = (2, 3)):
    """1-token samples, lengths straddling the chunk size, and one long sample among many short ones
    (``allow_empty``: also 0-length samples; ``long_chunks``: the long sample's length range in chunks)."""
    piece = st.one_of(st.integers(0 if allow_empty else 1, 3), st.sampled_from([chunk - 1, chunk, chunk + 1]),
                      st.integers(1, (long_chunks[1] if allow_empty else 2) * chunk))
    mixed = st.lists(piece, min_size=1, max_size=8 if allow_empty else 6).map(lambda ls: ls if sum(ls) else [*ls, 1])
    low, high = long_chunks
    skewed = st.tuples(st.integers(low * chunk, high * chunk + 5),
                       st.lists(st.integers(1, 4), min_size=3, max_size=12 if allow_empty else 10)).map(
        lambda t: [*t[1][:2], t[0], *t[1][2:]]
    )
    return st.one_of(mixed, skewed)


def cu_of(lengths, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def grads(out: torch.Tensor, final: torch.Tensor | None, leaves, seed: int = 1):
    """Gradients of a random projection of ``out`` (and ``final``) w.r.t. ``leaves``."""
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=F64)).sum()
    if final is not None:
        loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=F64)).sum()
    return torch.autograd.grad(loss, leaves, materialize_grads=True)
