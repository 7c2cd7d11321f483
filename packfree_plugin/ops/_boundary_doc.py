"""The one description of packed-row boundary arguments, reused by every op docstring."""

from __future__ import annotations

from typing import Callable, TypeVar

BOUNDARY_DOC = """\
cu_seqlens: ``[N+1]`` int32 or int64, on the data's device: cumulative sample offsets of a
            flattened row, ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``. B must
            be 1 (N = number of samples, T = total tokens of the row).
        seq_idx: ``[B, T]`` int32, on the data's device: sample index of every token, non-negative
            and non-decreasing along T; a new sample starts wherever the value changes (rows are
            independent, B may be > 1). Give cu_seqlens or seq_idx, or neither for one unsplit
            sequence per row; if both are given they must describe the same split.
        validate: check boundary values (ordering, ranges, agreement). Default None: only for CPU
            tensors, since on an accelerator the check costs a host sync. Shapes, dtypes and
            devices are always checked; every violation raises ValueError naming the values."""

RECURRENT_CU_SEQLENS_DOC = """\
cu_seqlens: ``[N+1]`` int32/int64 cumulative sample offsets on the data's device (0, non-decreasing,
            ending at ``T``); requires ``B == 1``. ``N`` samples, ``T`` total tokens; each sample starts
            from its own initial state. ``None``: every batch row is one sample (``N == B``)."""
"""``cu_seqlens`` for the recurrent ops that also carry states (gated delta, KDA, linear attention, LRU)."""

_F = TypeVar("_F", bound=Callable)


def with_boundary_doc(fn: _F) -> _F:
    """Substitute ``{boundaries}`` / ``{cu_seqlens}`` in ``fn.__doc__`` with :data:`BOUNDARY_DOC` /
    :data:`RECURRENT_CU_SEQLENS_DOC`."""
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{boundaries}", BOUNDARY_DOC).replace("{cu_seqlens}", RECURRENT_CU_SEQLENS_DOC)
    return fn
