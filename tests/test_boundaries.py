"""The boundary object: every source form agrees, conversions round-trip, bad input is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.boundaries import Boundaries

lengths_strategy = st.lists(st.integers(1, 9), min_size=1, max_size=8)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _seq_idx(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


@given(lengths_strategy)
def test_every_source_gives_the_same_segments(lengths: list[int]) -> None:
    total = sum(lengths)
    expected = tuple(_cu(lengths).tolist())
    from_cu = Boundaries.from_cu_seqlens(_cu(lengths), batch_size=1, seq_len=total, max_seqlen=max(lengths))
    from_pos = Boundaries.from_position_ids(_positions(lengths))
    from_idx = Boundaries.from_seq_idx(_seq_idx(lengths))
    for boundaries in (from_cu, from_pos, from_idx):
        assert boundaries.offsets == expected
        assert boundaries.lengths == tuple(lengths)
        assert boundaries.max_seqlen == max(lengths)
        assert boundaries.is_packed == (len(lengths) > 1)
        assert torch.equal(boundaries.cu_seqlens, _cu(lengths))
        assert torch.equal(boundaries.seq_idx, _seq_idx(lengths))
        assert torch.equal(boundaries.position_ids, _positions(lengths))


@given(st.lists(lengths_strategy, min_size=2, max_size=3), st.integers(0, 4))
def test_several_rows_with_tail_padding(rows: list[list[int]], pad: int) -> None:
    """B > 1: segments never cross rows; tail padding becomes padding segments."""
    seq_len = max(sum(r) for r in rows) + pad
    position_rows, mask_rows, expected_padding = [], [], []
    for row in rows:
        tail = seq_len - sum(row)
        position_rows.append(torch.cat([_positions(row)[0], torch.arange(tail)]))
        mask_rows.append(torch.cat([torch.ones(sum(row)), torch.zeros(tail)]))
        expected_padding += [False] * len(row) + ([True] if tail else [])
    boundaries = Boundaries.from_model_inputs(
        batch_size=len(rows), seq_len=seq_len, device="cpu", position_ids=torch.stack(position_rows),
        attention_mask=torch.stack(mask_rows).long(),
    )
    assert boundaries.padding == tuple(expected_padding)
    assert all(start % seq_len + length <= seq_len for start, length in zip(boundaries.offsets, boundaries.lengths))
    assert torch.equal(boundaries.padding_tokens, torch.stack(mask_rows) == 0)


def test_precedence_collator_kwargs_over_position_ids() -> None:
    boundaries = Boundaries.from_model_inputs(
        batch_size=1, seq_len=6, device="cpu", cu_seq_lens_q=_cu([2, 4]), cu_seq_lens_k=_cu([2, 4]),
        max_length_q=4, max_length_k=4, position_ids=torch.arange(6)[None],
    )
    assert boundaries.lengths == (2, 4)
    boundaries = Boundaries.from_model_inputs(
        batch_size=1, seq_len=6, device="cpu", seq_idx=_seq_idx([3, 3]), position_ids=torch.arange(6)[None]
    )
    assert boundaries.lengths == (3, 3)


def test_padded_batch_is_one_sample_per_row() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    boundaries = Boundaries.from_attention_mask(mask)
    assert boundaries.lengths == (2, 3, 4, 1, 5)
    assert boundaries.padding == (True, False, False, True, False)
    assert not boundaries.is_packed


def test_position_ids_rule_handles_offsets_and_repeats() -> None:
    """New sample wherever the id is not previous + 1: RoBERTa-style offsets and repeats both split."""
    assert Boundaries.from_position_ids(torch.tensor([[2, 3, 4, 2, 3]])).lengths == (3, 2)
    assert Boundaries.from_position_ids(torch.tensor([[0, 1, 1, 2]])).lengths == (2, 2)


def test_mrope_position_ids_are_not_split_inside_images() -> None:
    # one sample: 2 text tokens, a 2x2 image (t constant, h/w jump), 1 text token; then a second sample
    t = torch.tensor([0, 1, 2, 2, 2, 2, 4, 0, 1])
    h = torch.tensor([0, 1, 2, 2, 3, 3, 4, 0, 1])
    w = torch.tensor([0, 1, 2, 3, 2, 3, 4, 0, 1])
    three = torch.stack([t, h, w])[:, None]
    assert Boundaries.from_position_ids(three).lengths == (7, 2)
    four = torch.cat([torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1])[None, None], three])
    assert Boundaries.from_position_ids(four).lengths == (7, 2)


def test_device_forms_are_cached() -> None:
    boundaries = Boundaries.from_position_ids(_positions([3, 2]))
    assert boundaries.cu_seqlens is boundaries.cu_seqlens
    assert boundaries.seq_idx is boundaries.seq_idx
    source = _cu([3, 2])
    assert Boundaries.from_cu_seqlens(source, batch_size=1, seq_len=5).cu_seqlens is source


def test_float_position_ids_are_read_as_stock_reads_them() -> None:
    """Float ids (stock accepts them; Qwen3-Omni-MoE's tests build them) follow the same rule as integer ids,
    compared as floats: a step that is not exactly +1 starts a sample, as transformers' packed-sequence detection
    reads them."""
    integer = Boundaries.from_position_ids(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]))
    floats = Boundaries.from_position_ids(torch.tensor([[0.0, 1.0, 2.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0]]))
    assert floats.offsets == integer.offsets == (0, 3, 5, 10)
    halves = Boundaries.from_position_ids(torch.tensor([[0.0, 0.5, 1.5, 2.5]]))
    assert halves.offsets == (0, 1, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cu_seq_lens_q": torch.tensor([0, 3, 2, 5]), "cu_seq_lens_k": torch.tensor([0, 3, 2, 5])}, "non-decreasing"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 3, 5]), "cu_seq_lens_k": torch.tensor([0, 3, 3, 5])}, "zero-length"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 4]), "cu_seq_lens_k": torch.tensor([0, 3, 4])}, "do not sum to the row"),
        ({"cu_seq_lens_q": torch.tensor([0, 3, 9]), "cu_seq_lens_k": torch.tensor([0, 3, 9])}, "must end at"),
        ({"cu_seq_lens_q": torch.tensor([1, 3, 5]), "cu_seq_lens_k": torch.tensor([1, 3, 5])}, "must start at 0"),
        ({"cu_seq_lens_q": torch.tensor([0.0, 5.0]), "cu_seq_lens_k": torch.tensor([0.0, 5.0])}, "integer"),
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5]), "cu_seq_lens_k": torch.tensor([0, 3, 5])}, "differs"),
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5])}, "both"),
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5]), "cu_seq_lens_k": torch.tensor([0, 2, 5]), "max_length_q": 2},
         "contradicts"),
        ({"cu_seq_lens_q": torch.tensor([0, 2, 5], device="meta"), "cu_seq_lens_k": torch.tensor([0, 2, 5])}, "is on"),
        ({"seq_idx": torch.tensor([[0, 0, 1, 0, 1]])}, "non-decreasing"),
        ({"seq_idx": torch.tensor([[0, 0, 1, 1]])}, "shape"),
        ({"position_ids": torch.tensor([[0, 1, 2]])}, "shape"),
        ({"attention_mask": torch.tensor([[1, 1, 0, 1, 1]])}, "gap"),
        ({"attention_mask": torch.tensor([[1, 1, 2, 2, 2]])}, "only 0 and 1"),
        ({"attention_mask": torch.tensor([[1, 1, 1, 1]])}, "2-D padding mask"),
        ({"position_ids": torch.tensor([[0, 1, 0, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 0, 1, 1]])},
         "padding inside a sample"),
        ({"position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "cu_seq_lens_q": torch.tensor([0, 3, 5]),
          "cu_seq_lens_k": torch.tensor([0, 3, 5]), "attention_mask": torch.tensor([[1, 1, 0, 1, 1]])},
         "contradicts the packed boundaries"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_bad_input_is_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Boundaries.from_model_inputs(batch_size=1, seq_len=5, device="cpu", **kwargs)


def test_segment_may_not_cross_rows() -> None:
    with pytest.raises(ValueError, match="crosses a row boundary"):
        Boundaries.from_cu_seqlens(torch.tensor([0, 3, 8]), batch_size=2, seq_len=4)


def test_position_ids_that_contradict_cu_seq_lens_are_refused() -> None:
    positions = torch.tensor([[0, 1, 0, 1, 2, 3]])  # a restart at token 2, where cu_seq_lens continue
    with pytest.raises(ValueError, match="position_ids contradict the packed boundaries: .* token 2 of row 0"):
        Boundaries.from_model_inputs(batch_size=1, seq_len=6, device="cpu", cu_seq_lens_q=_cu([3, 3]),
                                     cu_seq_lens_k=_cu([3, 3]), position_ids=positions)
    with pytest.raises(ValueError, match="position_ids contradict"):
        Boundaries.from_model_inputs(batch_size=1, seq_len=6, device="cpu", seq_idx=_seq_idx([3, 3]),
                                     position_ids=positions)


def test_cu_seq_lens_win_over_position_ids_that_continue_across_samples() -> None:
    """``0..2, 3..5``: the ids alone would merge the samples; the given boundaries split them."""
    boundaries = Boundaries.from_model_inputs(batch_size=1, seq_len=6, device="cpu", cu_seq_lens_q=_cu([3, 3]),
                                              cu_seq_lens_k=_cu([3, 3]), position_ids=torch.arange(6)[None])
    assert boundaries.lengths == (3, 3)


@pytest.mark.parametrize("positions", [torch.arange(6), torch.arange(6)[None, None, None], torch.arange(7)[None]])
def test_position_ids_of_the_wrong_shape_are_refused_clearly(positions: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="position_ids"):
        Boundaries.from_model_inputs(batch_size=1, seq_len=6, device="cpu", position_ids=positions)


@pytest.mark.parametrize(
    ("positions", "mask", "lengths", "padding"),
    [
        ([0, 1, 2, 3, 4], [1, 1, 1, 0, 0], (3, 2), (False, True)),  # right padding, ids running on
        ([0, 1, 2, 3, 4], [0, 0, 1, 1, 1], (2, 3), (True, False)),  # left padding, ids running on
        ([0, 1, 2, 0, 1], [1, 1, 0, 1, 1], (2, 1, 2), (False, True, False)),  # two samples, one padding token between
        ([0, 1, 0, 0, 1], [1, 1, 0, 1, 1], (2, 1, 2), (False, True, False)),
    ],
)
def test_position_ids_with_a_padding_mask(positions, mask, lengths, padding) -> None:
    boundaries = Boundaries.from_model_inputs(batch_size=1, seq_len=5, device="cpu",
                                              position_ids=torch.tensor([positions]), attention_mask=torch.tensor([mask]))
    assert boundaries.lengths == lengths and boundaries.padding == padding


def test_max_length_is_an_upper_bound() -> None:
    """flash-attn reads max_seqlen as an upper bound: a larger one is accepted, a smaller one contradicts."""
    boundaries = Boundaries.from_model_inputs(batch_size=1, seq_len=6, device="cpu", cu_seq_lens_q=_cu([2, 4]),
                                              cu_seq_lens_k=_cu([2, 4]), max_length_q=16, max_length_k=16)
    assert boundaries.max_seqlen == 4


def test_the_repr_counts_segments_and_padding_spans() -> None:
    """What a user printing the boundaries reads: rows, segments, padding spans, the longest segment (mutant: the
    padding count summed None, and printing raised)."""
    boundaries = Boundaries.from_model_inputs(batch_size=1, seq_len=5, device="cpu",
                                              position_ids=torch.tensor([[0, 1, 2, 0, 1]]),
                                              attention_mask=torch.tensor([[1, 1, 1, 0, 0]]))
    assert repr(boundaries) == "Boundaries(B=1, T=5, segments=2, padding_spans=1, max_seqlen=3, device=cpu)"
