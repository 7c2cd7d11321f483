"""The one harness of the op tests: sample lengths that straddle chunk sizes, rows and their boundary forms, the
per-sample reference (each sample run alone), float64 comparisons, gradients and isolation checks."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

F64 = torch.float64


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", *, atol: float = 1e-9,
                 rtol: float = 1e-9) -> None:
    """float64 tolerances by default; fails on NaN/inf in ``actual`` (torch's assert_close has equal_nan=False)."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}" if what else m)


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


def cu_seqlens_of(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[N+1]`` cumulative sample lengths, starting at 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def grads(out: torch.Tensor, final: torch.Tensor | None, leaves, seed: int = 1):
    """Gradients of a random projection of ``out`` (and ``final``) w.r.t. ``leaves``."""
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=F64)).sum()
    if final is not None:
        loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=F64)).sum()
    return torch.autograd.grad(loss, leaves, materialize_grads=True)


def _row_lengths(chunk: int, *, max_samples: int = 6) -> st.SearchStrategy[list[int]]:
    """One row's sample lengths: 1-token samples, lengths straddling ``chunk``, or one long sample
    among many short ones."""
    near = sorted({max(1, chunk - 1), chunk, chunk + 1})
    piece = st.one_of(st.integers(1, 3), st.sampled_from(near), st.integers(1, 2 * chunk + 2))
    mixed = st.lists(piece, min_size=1, max_size=max_samples)
    skewed = st.tuples(st.integers(2 * chunk, 3 * chunk + 3),
                       st.lists(st.integers(1, 3), min_size=3, max_size=8)).map(
        lambda t: [*t[1][:2], t[0], *t[1][2:]])
    return st.one_of(mixed, skewed)


def draw_rows(data: st.DataObject, chunk: int) -> list[list[int]]:
    """B = 1 or 2 rows of sample lengths with equal totals (the shorter row gets one more sample)."""
    rows = [data.draw(_row_lengths(chunk), label="row0")]
    if data.draw(st.booleans(), label="two_rows"):
        rows.append(data.draw(_row_lengths(chunk), label="row1"))
        total = max(sum(r) for r in rows)
        rows = [r + ([total - sum(r)] if sum(r) < total else []) for r in rows]
    return rows


def seq_idx_of(rows: list[list[int]]) -> torch.Tensor:
    """``[B, T]`` int32 sample index per token."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
                       ).to(torch.int32)


def pieces(t: torch.Tensor, time_dim: int, rows: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per row, per sample slices of ``t`` along ``time_dim`` (the batch dim 0 kept, size 1)."""
    return [list(t[b : b + 1].split(r, dim=time_dim)) for b, r in enumerate(rows)]


def per_sample(fn, rows: list[list[int]], per_token: list[tuple[torch.Tensor | None, int]],
               out_time_dim: int) -> torch.Tensor:
    """Run ``fn(*sample_slices)`` on every sample alone and reassemble ``[B, ..., T, ...]``."""
    split = [None if t is None else pieces(t, d, rows) for t, d in per_token]
    out_rows = []
    for b, r in enumerate(rows):
        outs = [fn(*(None if s is None else s[b][i] for s in split)) for i in range(len(r))]
        out_rows.append(torch.cat(outs, dim=out_time_dim))
    return torch.cat(out_rows, dim=0)


def assert_same_grads(out: torch.Tensor, ref: torch.Tensor, inputs: dict[str, torch.Tensor],
                      seed: int = 0, **tol) -> None:
    """Forward values and the gradient w.r.t. every input agree (random output cotangent)."""
    assert_close(out, ref, "forward", **tol)
    gen = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    names = list(inputs)
    got = torch.autograd.grad(out, [inputs[n] for n in names], cot, retain_graph=True)
    want = torch.autograd.grad(ref, [inputs[n] for n in names], cot, retain_graph=True)
    for n, g, w in zip(names, got, want):
        assert_close(g, w, f"grad {n}", **tol)


def assert_isolated(out: torch.Tensor, out_time_dim: int, seq_idx: torch.Tensor,
                    per_token: dict[str, tuple[torch.Tensor, int]], row: int, sample: int) -> None:
    """A loss on one sample has exactly zero gradient w.r.t. every other token's inputs."""
    mine = torch.zeros_like(seq_idx, dtype=torch.bool)
    mine[row] = seq_idx[row] == sample

    def spread(mask: torch.Tensor, like: torch.Tensor, time_dim: int) -> torch.Tensor:
        shape = [1] * like.dim()
        shape[0], shape[time_dim] = mask.shape
        return mask.view(shape).expand_as(like)

    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    loss = (out * weight * spread(mine, out, out_time_dim)).sum()
    names = list(per_token)
    grads = torch.autograd.grad(loss, [per_token[n][0] for n in names], retain_graph=True,
                                allow_unused=True)
    for n, g in zip(names, grads):
        if g is None:
            continue
        others = g[~spread(mine, g, per_token[n][1])]
        assert torch.equal(others, torch.zeros_like(others)), (
            f"grad {n} leaks into other samples: max |g| = {others.abs().max().item():.3e}")
