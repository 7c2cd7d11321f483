"""Packed attention kernels against a naive per-sample reference written here, independently."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from packfree_plugin.attention import segments
from packfree_plugin.attention.interface import run_packed_attention
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.boundaries import Boundaries, Seq2SeqBoundaries
from tests.conftest import assert_close


def naive_attention(q, k, v, *, scale, causal, window, softcap, sinks) -> torch.Tensor:
    """One sample, token by token: ``q [H, L, D]``, ``k/v [Hkv, L, D]`` -> ``[H, L, Dv]``."""
    heads, length, _ = q.shape
    group = heads // k.shape[0]
    out = torch.zeros(heads, length, v.shape[-1], dtype=q.dtype)
    for h in range(heads):
        for i in range(length):
            keys = [
                j for j in range(length)
                if (j <= i if causal else True)
                and (window is None or (i - window < j if causal else abs(i - j) < window))  # flash's convention
            ]
            logits = torch.stack([(q[h, i] * k[h // group, j]).sum() * scale for j in keys])
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1]])
            weights = torch.softmax(logits, dim=0)[: len(keys)]
            out[h, i] = sum(w * v[h // group, j] for w, j in zip(weights, keys))
    return out


def dense_attention(q, k, v, *, scale, causal, window, softcap) -> torch.Tensor:
    """One sample with a dense ``[L, L]`` mask (the same rules as :func:`naive_attention`, for long samples):
    ``q [H, L, D]``, ``k/v [Hkv, L, D]`` -> ``[H, L, Dv]``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    i = torch.arange(q.shape[1])[:, None]
    j = torch.arange(q.shape[1])[None, :]
    visible = (j <= i) if causal else torch.ones_like(i == j)
    if window is not None:
        visible &= (i - window < j) if causal else ((i - j).abs() < window)
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1) @ v


case = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(1, 11), min_size=1, max_size=5),
        "heads": st.sampled_from([(4, 4), (4, 2), (4, 1)]),  # MHA, GQA, MQA
        "causal": st.booleans(),
        "window": st.sampled_from([None, 1, 3]),
        "softcap": st.sampled_from([None, 2.5]),
        "sinks": st.booleans(),
        "rows": st.integers(1, 2),
    }
)


def _packed_inputs(lengths, heads, kv_heads, rows, *, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_len = sum(lengths)
    shape = lambda h: (rows, h, seq_len, dim)  # noqa: E731
    q = torch.randn(shape(heads), generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape(kv_heads), generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(shape(kv_heads), generator=generator, dtype=torch.float64, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1)
    return q, k, v, Boundaries.from_position_ids(positions)


@pytest.mark.parametrize("query_block", [4, 256], ids=["blockwise", "one-block"])
@given(case)
def test_segment_attention_equals_each_sample_alone(query_block: int, case: dict) -> None:
    heads, kv_heads = case["heads"]
    q, k, v, boundaries = _packed_inputs(case["lengths"], heads, kv_heads, case["rows"])
    sinks = torch.linspace(-1.0, 1.0, heads, dtype=torch.float64) if case["sinks"] else None
    options = AttentionOptions(
        scale=1 / math.sqrt(8) * 1.3, causal=case["causal"], window=case["window"], softcap=case["softcap"], sinks=sinks
    )
    out = segments.segment_attention(q, k, v, boundaries, options, query_block=query_block)
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        row, begin = divmod(start, boundaries.seq_len)
        piece = slice(begin, begin + length)
        expected = naive_attention(
            q[row, :, piece], k[row, :, piece], v[row, :, piece], scale=options.scale, causal=options.causal,
            window=options.window, softcap=options.softcap, sinks=sinks,
        )
        assert_close(out[row, piece].transpose(0, 1), expected, what=f"segment at {start}")


@pytest.mark.parametrize(("causal", "window"), [(True, 100), (False, 100), (True, None), (False, None)],
                         ids=["causal-window", "bidirectional-window", "causal", "bidirectional"])
def test_samples_longer_than_a_query_block_at_the_default_block(causal: bool, window: int | None) -> None:
    """The blockwise path as models run it (the default ``QUERY_BLOCK``, samples longer than it), GQA included: each
    block's key range must reach every key the window allows and none beyond, in both directions."""
    lengths = (segments.QUERY_BLOCK * 2 + 37, 90, segments.QUERY_BLOCK + 5)
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1, seed=5)
    options = AttentionOptions(scale=0.4, causal=causal, window=window, softcap=None if window is None else 5.0)
    out = segments.segment_attention(q, k, v, boundaries, options)
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        piece = slice(start, start + length)
        expected = dense_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale=options.scale, causal=causal,
                                   window=window, softcap=options.softcap)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"segment at {start}")


@given(case)
def test_gradients_stay_inside_their_sample(case: dict) -> None:
    heads, kv_heads = case["heads"]
    q, k, v, boundaries = _packed_inputs(case["lengths"], heads, kv_heads, case["rows"], seed=1)
    options = AttentionOptions(scale=0.3, causal=case["causal"], window=case["window"], softcap=case["softcap"])
    out = segments.segment_attention(q, k, v, boundaries, options)
    target = len(boundaries.lengths) // 2
    owner = boundaries.seq_idx  # [B, T]
    (out.square() * (owner == target)[:, :, None, None]).sum().backward()
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        leaked = tensor.grad.transpose(1, 2)[owner != target]
        assert torch.count_nonzero(leaked) == 0, f"gradient leaked into other samples' {name}"


def test_padding_segments_give_zeros_and_no_gradient() -> None:
    q, k, v, _ = _packed_inputs([5], 2, 2, 2)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    boundaries = Boundaries.from_attention_mask(mask)
    out = segments.segment_attention(q, k, v, boundaries, AttentionOptions(scale=0.5, causal=True))
    assert torch.count_nonzero(out[mask == 0]) == 0
    out.sum().backward()
    assert torch.count_nonzero(q.grad.transpose(1, 2)[mask == 0]) == 0


@pytest.mark.parametrize(
    "feature",
    [dict(softcap=0.7), dict(window=2), dict(window=2, causal=False), dict(sinks=True), dict(kv_heads=1)],
    ids=["softcap", "causal-window", "bidirectional-window", "sinks", "gqa"],
)
def test_every_option_is_applied_alone(feature: dict) -> None:
    """Each option on its own, at scales where it binds (logits far above the cap, samples longer than the
    window): equal to the naive reference with the option, and different from the result without it, so a
    path that silently drops the option fails here."""
    feature = dict(feature)
    kv_heads = feature.pop("kv_heads", 4)
    lengths = [9, 6, 12]
    q, k, v, boundaries = _packed_inputs(lengths, 4, kv_heads, 1, seed=3)
    q, k, v = (t.detach() * 3 for t in (q, k, v))  # logits of O(10): a cap of 0.7 binds
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64) if feature.pop("sinks", False) else None
    settings = dict(scale=0.35, causal=True, window=None, softcap=None) | feature
    out = segments.segment_attention(q, k, v, boundaries, AttentionOptions(**settings, sinks=sinks))
    plain = segments.segment_attention(q, k, v, boundaries, AttentionOptions(scale=0.35, causal=settings["causal"]))
    if kv_heads == 4:
        assert (out - plain).abs().max() > 1e-2, "the option changed nothing: the case cannot see it"
    begin = 0
    for length in lengths:
        piece = slice(begin, begin + length)
        expected = naive_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], sinks=sinks, **settings)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"sample at {begin}")
        begin += length


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("lengths", [[4, 4, 4], [12]], ids=["equal-samples", "one-per-row"])
def test_samples_of_one_length_run_as_views_of_transformers_layout(rows: int, lengths: list[int]) -> None:
    """Rows of equal-length samples (and one sample per row) attend as one view of q/k/v in transformers' layout
    (``[B, T, H, D]`` tensors transposed to ``[B, H, T, D]``); outputs and gradients equal each sample alone."""
    generator = torch.Generator().manual_seed(1)
    seq_len = sum(lengths)

    bases = [torch.randn(rows, seq_len, heads, 8, generator=generator, dtype=torch.float64, requires_grad=True)
             for heads in (4, 2, 2)]  # [B, T, H, D] q, k, v
    q, k, v = (t.transpose(1, 2) for t in bases)
    boundaries = Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1))
    options = AttentionOptions(scale=0.4, causal=True)
    out = segments.segment_attention(q, k, v, boundaries, options)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), bases)
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        row, begin = divmod(start, seq_len)
        piece = slice(begin, begin + length)
        alone = [t[row : row + 1, piece].detach().requires_grad_() for t in bases]
        expected = naive_attention(*(t[0].transpose(0, 1) for t in alone), scale=0.4, causal=True, window=None,
                                   softcap=None, sinks=None)
        assert_close(out[row, piece].transpose(0, 1), expected, what=f"segment at {start}")
        expected_grads = torch.autograd.grad((expected.transpose(0, 1) * weights[row, piece]).sum(), alone)
        for name, got, want in zip("qkv", grads, expected_grads):
            assert_close(got[row, piece], want[0], what=f"grad {name}, segment at {start}")


@given(case, st.booleans())
def test_gradients_equal_each_sample_alone(case: dict, padded: bool) -> None:
    """Gradients of q, k, v through the grouped and blockwise paths (query blocks of 4: windows, softcap and sinks
    run block by block over narrowed keys) equal those of each sample alone; a padding tail gets no gradient."""
    heads, kv_heads = case["heads"]
    tail = 3 if padded else 0
    q, k, v, _ = _packed_inputs([*case["lengths"], tail] if tail else case["lengths"], heads, kv_heads, case["rows"],
                                seed=2)
    positions = torch.cat([torch.arange(n) for n in case["lengths"]] + [torch.arange(tail)]).expand(case["rows"], -1)
    mask = (torch.arange(positions.shape[1]) < positions.shape[1] - tail).long().expand(case["rows"], -1)
    boundaries = Boundaries.from_position_ids(positions, attention_mask=mask)
    sinks = torch.linspace(-1.0, 1.0, heads, dtype=torch.float64) if case["sinks"] else None
    settings = dict(scale=0.4, causal=case["causal"], window=case["window"], softcap=case["softcap"])
    out = segments.segment_attention(q, k, v, boundaries, AttentionOptions(**settings, sinks=sinks), query_block=4)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for start, length, pad in zip(boundaries.offsets, boundaries.lengths, boundaries.padding):
        row, begin = divmod(start, boundaries.seq_len)
        piece = slice(begin, begin + length)
        if pad:
            assert all(torch.count_nonzero(g[row, :, piece]) == 0 for g in grads), "padding got a gradient"
            continue
        alone = [t[row, :, piece].detach().requires_grad_() for t in (q, k, v)]
        expected = naive_attention(*alone, sinks=sinks, **settings)
        expected_grads = torch.autograd.grad((expected * weights[row, piece].transpose(0, 1)).sum(), alone)
        for name, got, want in zip("qkv", grads, expected_grads):
            assert_close(got[row, :, piece], want, what=f"grad {name}, segment at {start}")


class _WholeRowResults(TorchDispatchMode):
    """Counts the ops whose result holds as many elements as one of ``sizes`` (a whole row of q, or of k and v)."""

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes = sizes
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.count += isinstance(result, torch.Tensor) and result.numel() in self.sizes
        return result


def _whole_row_results_in_backward(lengths: list[int], options: AttentionOptions, query_block: int) -> int:
    """How many ops of the backward of one packed row of ``lengths`` make a result the size of the row's q or k."""
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1)
    out = segments.segment_attention(q, k, v, boundaries, options, query_block=query_block)
    with _WholeRowResults({q.numel(), k.numel()}) as counter:
        out.sum().backward()
    return counter.count


@pytest.mark.parametrize(
    ("few", "many", "options", "blocks"),
    [([100, 40, 100, 40, 229], [70 + i for i in range(5)] + [40, 30] * 2 + [9],
      AttentionOptions(scale=0.3, causal=True), (256, 256)),
     ([509], [509], AttentionOptions(scale=0.3, causal=True, window=40, softcap=4.0), (32, 8))],
    ids=["groups", "query-blocks"],
)
def test_backward_touches_the_row_a_constant_number_of_times(few: list[int], many: list[int],
                                                             options: AttentionOptions,
                                                             blocks: tuple[int, int]) -> None:
    """A row of 509 tokens (a prime: no score matrix has a row's size) in 4 groups or in 8 (long samples, short ones
    between them), or one windowed sample in query blocks of 32 or 8: the backward makes as many row-sized results
    either way (gathering each group or block by slicing made a zero gradient of the whole row, and added it in, for
    every one of them)."""
    assert sum(few) == sum(many) == 509
    few_blocks, many_blocks = blocks
    assert _whole_row_results_in_backward(many, options, many_blocks) == _whole_row_results_in_backward(
        few, options, few_blocks)


class _CountGathers(TorchDispatchMode):
    """Counts ``index_select`` / ``index_copy`` calls (the gather into group order and the write back)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.index_select, torch.ops.aten.index_copy)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("lengths", "gathers"), [([100, 10, 100, 12, 30], 0), ([100, 10, 100, 10, 30], 4)],
                         ids=["short-lengths-all-differ", "a-short-length-shared"])
def test_a_row_is_gathered_only_where_batching_short_samples_needs_it(lengths: list[int], gathers: int) -> None:
    """Short samples that share their length run as one batched call, which needs the row in group order (a gather
    of each of q, k and v, one write back); a short sample whose length no other has stays in place, and a row of such samples is
    attended as views of itself. Outputs equal each sample alone either way."""
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1)
    options = AttentionOptions(scale=0.3, causal=True)
    with _CountGathers() as counter:
        out = segments.segment_attention(q, k, v, boundaries, options)
    assert counter.count == gathers
    begin = 0
    for length in lengths:
        piece = slice(begin, begin + length)
        expected = naive_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale=0.3, causal=True,
                                   window=None, softcap=None, sinks=None)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"sample at {begin}")
        begin += length


# ------------------------------------------------------------------- relative bias, cross-attention, dropout
def _dense_reference(q, k, v, *, scale, causal=False, softcap=None, sinks=None, bias=None) -> torch.Tensor:
    """One sample (or one decoder sample over its encoder sample) with dense scores: ``q [H, Lq, D]``, ``k/v [Hkv,
    Lk, D]``, ``bias [H, Lq, Lk]`` added to the scores -> ``[H, Lq, Dv]``."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias
    if causal:
        later = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        logits = logits.masked_fill(later, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks[:, None, None].expand(-1, q.shape[1], 1)], dim=-1)
    weights = torch.softmax(logits, dim=-1)[..., : k.shape[1]]
    return weights @ v


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_relative_bias_on_grouped_keys_equals_each_sample_alone(causal: bool) -> None:
    """T5's relative position bias ``[1, H, L, L]``: every sample adds its top-left corner, on 4 query heads over 2
    key heads, one sample as long as the query heads (mutant: the grouped-keys test read the keys' length, so that
    sample's call failed)."""
    lengths = [4, 3, 6]
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1, seed=4)
    bias = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = segments.segment_attention(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=causal), bias=bias)
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        piece = slice(start, start + length)
        expected = _dense_reference(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale=0.4, causal=causal,
                                    bias=bias[0, :, :length, :length])
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"sample at {start}")


@pytest.mark.parametrize("option", [dict(chunk=2), dict(softcap=1.0), dict(window=2),
                                    dict(sinks=torch.zeros(4, dtype=torch.float64))],
                         ids=["chunk", "softcap", "window", "sinks"])
def test_a_relative_bias_with_another_option_is_refused(option: dict) -> None:
    """A bias applies to full attention only: with chunks, a softcap, a window or sinks beside it the call is
    refused, never run without the option (mutant: ``or`` read as ``and``, and chunks and softcaps were dropped)."""
    q, k, v, boundaries = _packed_inputs([4, 3], 4, 4, 1)
    bias = torch.zeros(1, 4, 4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="relative position bias only to full attention"):
        segments.segment_attention(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=True, **option), bias=bias)


def _pairing(encoder: list[int], decoder: list[int]) -> Seq2SeqBoundaries:
    """One row of encoder samples of lengths ``encoder`` paired with decoder samples of lengths ``decoder``."""
    sides = [Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in lengths])[None])
             for lengths in (encoder, decoder)]
    return Seq2SeqBoundaries(*sides)


@pytest.mark.parametrize("option", [dict(softcap=0.5), dict(sinks=torch.linspace(-1.0, 2.0, 4,
                                                                                   dtype=torch.float64))],
                         ids=["softcap", "sinks"])
def test_cross_attention_with_softcap_or_sinks_equals_each_pair_alone(option: dict) -> None:
    """Packed cross-attention through the eager path (softcap, sinks): each decoder sample over its own encoder
    sample only, with the option applied (mutants: the eager call lost its query, or its result)."""
    pairing = _pairing([5, 3, 6], [2, 4, 3])
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 9, 8, generator=generator, dtype=torch.float64) * 3  # scores past a cap of 0.5
    k, v = (torch.randn(1, 2, 14, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    out = segments.cross_segment_attention(q, k, v, pairing, AttentionOptions(scale=0.4, causal=False, **option))
    for decoder_start, decoder_length, encoder_start, encoder_length in pairing.pairs:
        queries, keys = slice(decoder_start, decoder_start + decoder_length), slice(encoder_start,
                                                                                   encoder_start + encoder_length)
        expected = _dense_reference(q[0, :, queries], k[0, :, keys], v[0, :, keys], scale=0.4, **option)
        assert_close(out[0, queries].transpose(0, 1), expected, what=f"decoder sample at {decoder_start}")


def test_rows_of_padding_only_give_zeros() -> None:
    """Self- and cross-attention over rows that are all padding (no sample at all): zeros of the output's shape
    ``[B, T, H, Dv]`` (mutants: the empty result lost a dimension)."""
    padding = Boundaries([0, 5, 10], batch_size=2, seq_len=5, device="cpu", padding=[True, True])
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    options = AttentionOptions(scale=0.4, causal=True)
    assert torch.equal(segments.segment_attention(q, k, v, padding, options), torch.zeros(2, 5, 4, 8, dtype=q.dtype))
    cross = segments.cross_segment_attention(q, k, v, Seq2SeqBoundaries(padding, padding),
                                             AttentionOptions(scale=0.4, causal=False))
    assert torch.equal(cross, torch.zeros(2, 5, 4, 8, dtype=q.dtype))


def _with_dropout(call, training: bool | None) -> torch.Tensor:
    """``call(**training)`` from a fixed random state; ``training=None`` leaves the argument out (its default)."""
    torch.manual_seed(11)
    return call(**({} if training is None else {"training": training}))


def test_attention_drops_weights_in_training_only() -> None:
    """Dropout in the options applies in training, never by default (an evaluation call): the portable path, the
    relative-bias path, cross-attention (fused and eager) and the backend entry, each against the same call without
    dropout (mutants: ``training`` defaulted to True, the bias path dropped weights in evaluation, the eager
    cross-attention lost ``training``)."""
    q, k, v, boundaries = _packed_inputs([5, 3, 6], 4, 2, 1, seed=7)
    bias = torch.randn(1, 4, 6, 6, dtype=torch.float64)
    pairing = _pairing([5, 3, 6], [6, 3, 5])
    calls = {
        "segments": lambda options, **kw: segments.segment_attention(q, k, v, boundaries, options, **kw),
        "relative bias": lambda options, **kw: segments.segment_attention(q, k, v, boundaries, options, bias=bias,
                                                                          **kw),
        "cross": lambda options, **kw: segments.cross_segment_attention(q, k, v, pairing, options, **kw),
        "cross, softcap": lambda options, **kw: segments.cross_segment_attention(
            q, k, v, pairing, dataclasses.replace(options, softcap=2.0), **kw),
        "backend entry": lambda options, **kw: run_packed_attention(q, k, v, boundaries, options, **kw),
    }
    for name, call in calls.items():
        causal = not name.startswith("cross")
        dropped, kept = AttentionOptions(scale=0.4, causal=causal, dropout=0.5), AttentionOptions(scale=0.4,
                                                                                                 causal=causal)
        reference = _with_dropout(lambda **kw: call(kept, **kw), None)
        assert_close(_with_dropout(lambda **kw: call(dropped, **kw), None), reference, what=f"{name}, by default")
        assert_close(_with_dropout(lambda **kw: call(dropped, **kw), False), reference, what=f"{name}, evaluation")
        trained = _with_dropout(lambda **kw: call(dropped, **kw), True)
        assert (trained - reference).abs().max() > 1e-3, f"{name}: training applied no dropout"


# ------------------------------------------------------------------- compiled: the opaque op
def _compiled(boundaries: Boundaries, options: AttentionOptions, *, training: bool):
    """``run_packed_attention`` on ``boundaries`` under torch.compile (the path through packfree's opaque op)."""
    return torch.compile(lambda q, k, v: run_packed_attention(q, k, v, boundaries, options, training=training),
                         backend="eager")


def test_compiled_attention_keeps_every_option() -> None:
    """Compiled, a window that binds, a softcap and sinks reach the op: each sample equals the naive reference
    with all three (mutants: the op was handed no window, no sinks, the keys as values, or the rows' shape of the
    queries' heads)."""
    lengths = [9, 6, 12]
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1, seed=3)
    q, k, v = (t.detach() * 3 for t in (q, k, v))  # logits past the cap
    sinks = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64)
    settings = dict(scale=0.35, causal=True, window=3, softcap=0.7)
    torch._dynamo.reset()
    try:
        out = _compiled(boundaries, AttentionOptions(**settings, sinks=sinks), training=False)(q, k, v)
    finally:
        torch._dynamo.reset()
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        piece = slice(start, start + length)
        expected = naive_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], sinks=sinks, **settings)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"compiled sample at {start}")


def test_compiled_dropout_is_drawn_afresh_and_replayed_in_backward() -> None:
    """Compiled attention with dropout: none in evaluation, which leaves torch's random state as it was; in
    training weights are dropped, with a mask drawn afresh at every call (40 calls, 40 different outputs) that
    backward's recomputation replays: the output is linear in ``v``, so ``sum(grad_v * v)`` equals ``sum(out * w)``
    for the loss ``sum(out * w)`` only when backward dropped what the forward dropped (mutants: evaluation drew a
    seed, training dropped nothing, backward drew a mask of its own, the seed failed to draw or came from 124
    values)."""
    q, k, v, boundaries = _packed_inputs([5, 3, 6], 4, 4, 1, seed=8)
    q, k = q.detach(), k.detach()
    v = v.detach().requires_grad_()
    options = AttentionOptions(scale=0.4, causal=True, dropout=0.5)
    reference = segments.segment_attention(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=True)).detach()
    torch._dynamo.reset()
    try:
        state = torch.get_rng_state()
        assert_close(_compiled(boundaries, options, training=False)(q, k, v), reference, what="compiled evaluation")
        assert torch.equal(torch.get_rng_state(), state), "evaluation drew from torch's random generator"
        trained = _compiled(boundaries, options, training=True)
        weights = torch.randn(reference.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        out = trained(q, k, v)
        assert (out - reference).abs().max() > 1e-3, "training dropped no attention weight"
        loss = (out * weights).sum()
        (grad,) = torch.autograd.grad(loss, v)
        assert_close((grad * v).sum(), loss.detach(), what="backward's dropout against the forward's")
        with torch.no_grad():
            outputs = {tuple(trained(q, k, v).flatten()[:64].tolist()) for _ in range(40)}
        assert len(outputs) == 40, f"40 training calls drew {len(outputs)} different dropout masks"
    finally:
        torch._dynamo.reset()


def test_compiled_attention_under_autocast_runs_in_the_autocast_dtype() -> None:
    """RoPE leaves q and k in float32 beside a bfloat16 v under autocast; inside the compiled op autocast is off, so
    packfree casts all three first: the compiled call equals the eager one under autocast (mutant: nothing was cast,
    and the op got mixed dtypes)."""
    q, k, v, boundaries = _packed_inputs([5, 3, 6], 4, 2, 1, seed=10)
    q, k, v = q.detach().float(), k.detach().float(), v.detach().to(torch.bfloat16)
    options = AttentionOptions(scale=0.4, causal=True)
    torch._dynamo.reset()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = run_packed_attention(q, k, v, boundaries, options)
            compiled = _compiled(boundaries, options, training=False)(q, k, v)
    finally:
        torch._dynamo.reset()
    assert compiled.dtype == eager.dtype == torch.bfloat16
    assert_close(compiled.float(), eager.float(), atol=0, rtol=0, what="compiled under autocast")
