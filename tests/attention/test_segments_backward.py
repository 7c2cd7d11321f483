"""Segment attention's backward where the key ranges of query blocks overlap (a causal prefix, a sliding window in
either direction): each block's gradient of k and v adds into the keys it shares with other blocks. Gradients of q, k
and v equal those of a dense float64 computation on each sample alone, over query blocks smaller than, equal to,
dividing and not dividing the sample lengths, and larger than all of them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.attention import segments
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.boundaries import Boundaries
from tests.conftest import assert_close

LENGTHS = [9, 6, 12, 6]
"""One row's samples: two of length 6 run batched as one group, 9 and 12 alone."""
QUERY_BLOCKS = [1, 2, 3, 4, 5, 6, 12, 16]
"""Smaller than every sample (1, 2), dividing 6, 9 and 12 (3), dividing some (2, 4, 6), none (5), equal to a sample
(6, 12), larger than all (16: one block per sample)."""
LAYOUTS = {
    "causal-window": dict(causal=True, window=5),
    "causal-softcap": dict(causal=True, softcap=2.0),  # no window: every block's keys are a prefix of the next one's
    "causal-sinks": dict(causal=True, sinks=True),
    "causal-window-softcap": dict(causal=True, window=4, softcap=2.0),
    "bidirectional-window": dict(causal=False, window=4),
    "bidirectional-window-sinks": dict(causal=False, window=3, sinks=True),
    "bidirectional-softcap": dict(causal=False, softcap=2.0),  # every block sees every key
}
"""Each runs block by block (a window that binds, softcap or sinks); all but the last narrow the keys per block."""
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
DIM = 8


def _dense_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
    """One sample with a dense ``[L, L]`` mask: ``q [H, L, D]``, ``k/v [Hkv, L, D]`` -> ``[H, L, D]``. A sink is one
    more logit per head in the softmax, with no value; the window follows flash-attention's convention."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    logits = q @ k.transpose(-1, -2) * options.scale
    if options.softcap is not None:
        logits = options.softcap * torch.tanh(logits / options.softcap)
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(q.shape[1])[None, :]
    visible = (j <= i) if options.causal else torch.ones_like(i == j)
    if options.window is not None:
        visible &= (i - options.window < j) if options.causal else ((i - j).abs() < options.window)
    logits = logits.masked_fill(~visible, float("-inf"))
    if options.sinks is not None:
        sinks = options.sinks[:, None, None].expand(-1, q.shape[1], 1)
        return torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1] @ v
    return torch.softmax(logits, dim=-1) @ v


def _assert_gradients_equal_each_sample_alone(lengths: list[int], rows: int, heads: tuple[int, int], settings: dict,
                                              query_block: int, seed: int = 0) -> None:
    """Packed rows of ``lengths`` (``rows`` of them), ``q [rows, H, T, D]``, ``k/v [rows, Hkv, T, D]`` in float64: the
    gradients of a random weighting of the output equal those of each sample alone through :func:`_dense_alone`."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = sum(lengths)
    q, k, v = (torch.randn(rows, count, seq_len, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
               for count in (heads[0], heads[1], heads[1]))
    settings = dict(settings)
    sinks = torch.linspace(-1.0, 1.0, heads[0], dtype=torch.float64) if settings.pop("sinks", False) else None
    options = AttentionOptions(scale=0.4, sinks=sinks, **settings)
    boundaries = Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1))
    out = segments.segment_attention(q, k, v, boundaries, options, query_block=query_block)  # [rows, T, H, D]
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        row, begin = divmod(start, seq_len)
        piece = slice(begin, begin + length)
        alone = [t[row, :, piece].detach().requires_grad_() for t in (q, k, v)]
        expected = _dense_alone(*alone, options)
        expected_grads = torch.autograd.grad((expected * weights[row, piece].transpose(0, 1)).sum(), alone)
        for name, got, want in zip("qkv", grads, expected_grads):
            assert_close(got[row, :, piece], want, what=f"grad {name}, query block {query_block}, sample at {start}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("query_block", QUERY_BLOCKS)
def test_gradients_over_overlapping_key_ranges_add(query_block: int, layout: str) -> None:
    """Grouped query attention (two query heads per key head: their gradients add into one k and v too); the
    property below draws every head layout."""
    _assert_gradients_equal_each_sample_alone(LENGTHS, 1, HEADS["gqa"], LAYOUTS[layout], query_block)


@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4),
    rows=st.integers(1, 2),
    heads=st.sampled_from(list(HEADS.values())),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 2, 5]),
    logits=st.sampled_from([{"softcap": 2.0}, {"sinks": True}, {}]),
    query_block=st.integers(1, 15),
)
def test_gradients_equal_each_sample_alone_for_any_block_and_packing(lengths: list[int], rows: int,
                                                                     heads: tuple[int, int], causal: bool,
                                                                     window: int | None, logits: dict,
                                                                     query_block: int) -> None:
    _assert_gradients_equal_each_sample_alone(lengths, rows, heads, dict(causal=causal, window=window, **logits),
                                              query_block, seed=1)
