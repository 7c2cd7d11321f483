"""Gaps ``nox -s mutants`` found in the boundary object (docs/testing.md, "Planted bugs"): inputs a user passes
that no other test passed in this form, each held to its clear refusal or to the same segments as its plain form."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.boundaries import Boundaries


def _cu(lengths: list[int]) -> torch.Tensor:
    """``[N+1]`` int32 running sum of ``lengths`` with a leading 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("offsets", [[[0, 4, 8]], [[0, 4], [4, 8]]], ids=["one row", "per-row offsets"])
def test_cu_seqlens_of_two_dimensions_are_refused_as_such(offsets: list[list[int]]) -> None:
    """A collator's ``[1, N + 1]`` or per-row ``[B, N + 1]`` offsets are refused naming the 1-D form they need
    (mutant: the check read ``and``, so any tensor passed it and the offsets broke later in int())."""
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[N\+1\], got \("):
        Boundaries.from_cu_seqlens(torch.tensor(offsets), batch_size=1, seq_len=8)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_max_length_given_as_a_tensor_reads_as_its_int(dtype: torch.dtype) -> None:
    """``max_length_q`` / ``_k`` as one-element tensors (as some collators send them) bound the samples exactly as
    the ints do: the longest length is accepted, a shorter one refused with its value (mutant: the tensor's host
    copy was read from None)."""
    lengths = [3, 5]
    as_int = Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                          cu_seq_lens_k=_cu(lengths), max_length_q=5, max_length_k=5)
    as_tensor = Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                             cu_seq_lens_k=_cu(lengths), max_length_q=torch.tensor(5, dtype=dtype),
                                             max_length_k=torch.tensor([5], dtype=dtype))
    assert as_tensor.offsets == as_int.offsets == (0, 3, 8)
    with pytest.raises(ValueError, match="max_length 4 contradicts cu_seqlens, whose longest segment is 5"):
        Boundaries.from_cu_seqlens(_cu(lengths), batch_size=1, seq_len=8, max_seqlen=torch.tensor(4, dtype=dtype))
    with pytest.raises(ValueError, match="max_length_q=4 differs from max_length_k=5"):
        Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                     cu_seq_lens_k=_cu(lengths), max_length_q=torch.tensor(4, dtype=dtype),
                                     max_length_k=torch.tensor(5, dtype=dtype))
