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


def _refused(**kwargs) -> Boundaries:
    return Boundaries.from_model_inputs(device="cpu", **kwargs)


REFUSALS = {
    # case: (call, what the refusal must say: the input by name, where it is wrong, the fix)
    "a row-long sample, rows unpadded": (
        lambda: Boundaries.from_cu_seqlens(torch.tensor([0, 8, 11, 13]), batch_size=2, seq_len=8),
        r"got 13 in \[0, 8, 11, 13\].* pass cu_seq_lens_q = cu_seq_lens_k = \[0, 8, 11, 13, 16\]$"),
    "one row, samples over its end": (
        lambda: Boundaries.from_cu_seqlens(torch.tensor([0, 5, 9]), batch_size=1, seq_len=8),
        r"got 9 in \[0, 5, 9\].*: a padding tail is a segment of its own, ending at T=8$"),
    "more than 12 offsets": (
        lambda: Boundaries.from_cu_seqlens(torch.arange(0, 15), batch_size=1, seq_len=20),
        r"got 14 in \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, \.\.\.\]"),
    "bool position_ids": (lambda: Boundaries.from_position_ids(torch.tensor([[True, False, True]])),
                          r"^position_ids must be an integer tensor, got dtype torch.bool; pass position_ids.long\(\)"),
    "bool seq_idx": (lambda: Boundaries.from_seq_idx(torch.tensor([[False, True]])),
                     r"^seq_idx must be an integer tensor, got dtype torch.bool"),
    "float seq_idx": (lambda: Boundaries.from_seq_idx(torch.tensor([[0.0, 1.0]])),
                      r"^seq_idx must be an integer tensor, got dtype torch.float32; pass seq_idx.long\(\)"),
    "bool cu_seqlens": (lambda: Boundaries.from_cu_seqlens(torch.tensor([False, True]), batch_size=1, seq_len=1),
                        r"^cu_seqlens must be an integer tensor, got dtype torch.bool"),
    "float cu_seqlens": (lambda: Boundaries.from_cu_seqlens(torch.tensor([0.0, 4.0]), batch_size=1, seq_len=4),
                         r"^cu_seqlens must be an integer tensor, got dtype torch.float32; pass cu_seqlens.long\(\)"),
    "cu_seqlens on another device": (
        lambda: Boundaries.from_cu_seqlens(torch.tensor([0, 4], device="meta"), batch_size=1, seq_len=4,
                                           device="cpu"),
        r"^cu_seqlens is on meta but the inputs are on cpu; move it to cpu"),
    "cu_seq_lens_k on another device": (
        lambda: _refused(batch_size=1, seq_len=4, cu_seq_lens_q=torch.tensor([0, 4]),
                         cu_seq_lens_k=torch.tensor([0, 4], device="meta")),
        r"^cu_seq_lens_k is on meta but the inputs are on cpu"),
    "seq_idx on another device": (
        lambda: _refused(batch_size=1, seq_len=4, seq_idx=torch.zeros(1, 4, dtype=torch.long, device="meta")),
        r"^seq_idx is on meta but the inputs are on cpu"),
    "cu_seq_lens_k alone": (lambda: _refused(batch_size=1, seq_len=4, cu_seq_lens_k=torch.tensor([0, 4])),
                            r"^only cu_seq_lens_k was passed; pass the same tensor as both"),
    "padding inside a sample": (
        lambda: _refused(batch_size=1, seq_len=6, position_ids=torch.tensor([[0, 1, 2, 3, 4, 5]]),
                         attention_mask=torch.tensor([[1, 1, 1, 0, 0, 1]])),
        r"\(row 0, tokens 3\.\.4\): the position_ids continue across it \(2 at token 2, 5 at token 5\)"),
    "seq_idx going down": (lambda: Boundaries.from_seq_idx(torch.tensor([[0, 0, 1, 1, 0]])),
                           r"row 0 goes from 1 to 0 at token 4\."),
    "1-D seq_idx": (lambda: _refused(batch_size=1, seq_len=4, seq_idx=torch.zeros(4, dtype=torch.long)),
                    r"^seq_idx has shape \[4\] .*; seq_idx must be \[B, T\]\. A 1-D tensor gives no rows; pass it as "
                    r"\[1, 4\]"),
    "position_ids as a list": (lambda: _refused(batch_size=1, seq_len=4, position_ids=[0, 1, 2, 3]),
                               r"^position_ids has shape list but the tokens .* are \[B=1, T=4\]; position_ids must "
                               r"be \[B, T\], \[1, T\] or \[R, B, T\] \(MRoPE\)\. Build"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refusal_names_the_input_where_it_is_wrong_and_the_fix(case: str) -> None:
    """Each refusal as the user reads it: the input by the name they passed, the place (offsets, row and token) and
    the layout or call that fixes it (mutants: a name upper-cased or dropped, the hint computed for other rows, the
    tokens of a hole or a decrease misplaced, a cause of None, a bool tensor taken for integers, a list's shape or
    the offsets shown raising in the message itself)."""
    call, message = REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_four_plane_mrope_ids_take_their_text_plane() -> None:
    """MRoPE ids ``[4, B, T]`` hold text positions in their first plane: samples start where it restarts, though the
    other planes run on (mutant: four planes were read by the all-zero rule of planes without text, and the row was
    one sample)."""
    text = torch.tensor([[0, 1, 2, 0, 1, 2]])
    running = torch.arange(6)[None]
    ids = torch.stack([text, running, running, running])
    assert Boundaries.from_position_ids(ids).offsets == (0, 3, 6)
