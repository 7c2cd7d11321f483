"""The one description of packed-row boundary arguments, reused by every op docstring."""

from __future__ import annotations

from typing import Callable, TypeVar

BOUNDARY_DOC = """\
Boundaries (give one of them, or neither for a single unsplit sequence per row):
        cu_seqlens: ``[N+1]`` int32 or int64, on the data's device. Cumulative sample offsets of a
            flattened row: ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T``. B must
            be 1 (N = number of samples, T = total tokens of the row).
        seq_idx: ``[B, T]`` int32, on the data's device. Sample index of every token, non-negative
            and non-decreasing along T; a new sample starts wherever the value changes. Rows are
            independent (B may be > 1).
        If both are given they must describe the same split. Shapes and dtypes are always checked;
        values (ordering, ranges) are checked when the tensors live on the CPU or when
        ``validate=True`` (on an accelerator that check would cost a host sync)."""

_F = TypeVar("_F", bound=Callable)


def with_boundary_doc(fn: _F) -> _F:
    """Substitute ``{boundaries}`` in ``fn.__doc__`` with :data:`BOUNDARY_DOC`."""
    if fn.__doc__:
        fn.__doc__ = fn.__doc__.replace("{boundaries}", BOUNDARY_DOC)
    return fn
