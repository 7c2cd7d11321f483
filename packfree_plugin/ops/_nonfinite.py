"""Non-finite isolation of the chunked ops: a NaN or inf in one sample never reaches another sample.

The chunked ops mix the tokens of a packed row in dense products whose cross-sample weights are exact zeros
(``exp(-inf)`` decays, masked scores, zeroed carries). Exact zeros isolate finite values, but ``0 * nan`` is
NaN, so one sample's non-finite input would reach every token sharing a chunk or a carried state with it,
forward and backward. :class:`Quarantine` removes such samples from the mixing instead:

* a sample is *poisoned* when any of its per-token inputs (or its initial state) holds a NaN or an inf,
  found without a host sync: one sum per input over everything but batch and time, added over the inputs
  and then over the sample's tokens by ``index_add`` (a sum is non-finite exactly when a term is, or when
  finite terms overflow, which the op itself would not survive either);
* :meth:`Quarantine.clean` replaces every input of a poisoned sample by zeros (``torch.where``, not a
  multiplication), so the op computes on finite values only;
* :meth:`Quarantine.mark` sets **every output token of a poisoned sample to NaN** (and
  :meth:`Quarantine.mark_states` its final state). Its outputs are then constants: the gradient the op sends
  back into a poisoned sample's inputs is zero, and a non-finite output gradient of a poisoned sample (a
  diverged sample's loss) never enters the op's backward.

Other samples get exactly what they get without the poisoned one, forward and backward. A row without
non-finite values pays one reduction and one ``where`` per input and one ``where`` per output, on every device: it
never reads a value back to the host (on a GPU that read would synchronise in every layer).

packfree's torch paths quarantine inside their chunked computation. The CUDA kernel packages an op may call
instead (causal-conv1d, mamba-ssm, fla) do not isolate non-finite values, so each op wraps its kernel call in
:func:`around_kernel`: the op that picks the kernel is the one place that knows one runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..boundaries import memo
from ._seq import sample_starts

__all__ = ["Quarantine", "around_kernel"]


def _sample_heads(seq_idx: Tensor) -> Tensor:
    """``seq_idx [B, T]`` -> ``[B * T]`` long: flat index ``b * T + t0`` of the first token of every token's
    sample. Kept for the tensor (:func:`~packfree_plugin.boundaries.memo`: every layer of a forward passes the same
    one)."""
    def build() -> Tensor:
        B, T = seq_idx.shape
        rows = torch.arange(B, device=seq_idx.device)[:, None] * T
        return (sample_starts(seq_idx) + rows).reshape(-1)

    return memo(seq_idx, "sample_heads", tuple(seq_idx.shape), build)


def _token_sums(t: Tensor, time_dim: int) -> Tensor:
    """``[B, ..., T, ...]`` -> ``[B, T]``: the sum of every token's values (float32, float64 for float64)."""
    dims = [d for d in range(1, t.dim()) if d != time_dim % t.dim()]
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return t.sum(dim=dims, dtype=acc) if dims else t.to(acc)


class Quarantine:
    """Which tokens belong to a sample with a non-finite input (module docstring).

    Args:
        seq_idx: ``[B, T]`` sample index of every token (non-decreasing along T; a new sample wherever it
            changes; for ``cu_seqlens`` the sample's number, ``0 .. N-1``).
        per_token: ``(tensor, time_dim)`` pairs, each ``[B, ..., T, ...]`` with batch first.
        initial_state: ``[N, ...]`` per-sample initial states indexed by ``seq_idx`` values, or None.

    A sample is found by one sum: the sum over all its inputs' values is non-finite exactly when one of them
    is (or when finite values overflow the sum, then the op could not have held them either).
    """

    def __init__(self, seq_idx: Tensor, per_token: list[tuple[Tensor | None, int]],
                 initial_state: Tensor | None = None):
        self.per_token = per_token
        with torch.no_grad():  # a mask: nothing to differentiate, no graph to build
            self._find(seq_idx, per_token, initial_state)

    def _find(self, seq_idx: Tensor, per_token: list[tuple[Tensor | None, int]], initial_state: Tensor | None
              ) -> None:
        self.keep: Tensor | None = None
        """``[B, T]`` bool, True where a token's sample is finite."""
        self.state_finite: Tensor | None = None
        B, T = seq_idx.shape
        total = None
        for t, time_dim in per_token:
            if t is not None:
                sums = _token_sums(t, time_dim)
                total = sums if total is None else total + sums
        if initial_state is not None:
            state_sums = _token_sums(initial_state.reshape(initial_state.shape[0], -1, 1), 2).squeeze(1)
            self.state_finite = torch.isfinite(state_sums)
            total = total + state_sums[seq_idx.long()]
        heads = _sample_heads(seq_idx)
        self.sample_sums = total.new_zeros(B * T).index_add_(0, heads, total.reshape(-1))  # at each first token
        self.keep = torch.isfinite(self.sample_sums[heads]).view(B, T)  # [B, T]: token's sample is finite

    def _shape(self, like: Tensor, time_dim: int) -> list[int]:
        """The ``[B, 1, .., T, .., 1]`` shape that spreads a ``[B, T]`` mask over ``like``."""
        shape = [1] * like.dim()
        shape[0], shape[time_dim] = self.keep.shape
        return shape

    def clean(self) -> list[Tensor | None]:
        """The ``per_token`` tensors, in order, with every token of a poisoned sample set to 0 (None stays None)."""
        if self.keep is None:
            return [t for t, _ in self.per_token]
        return [None if t is None else torch.where(self.keep.view(self._shape(t, d)), t, 0.0)
                for t, d in self.per_token]

    def clean_state(self, state: Tensor | None) -> Tensor | None:
        """``[N, ...]`` initial states with the non-finite ones replaced by 0."""
        if state is None or self.state_finite is None:
            return state
        return torch.where(self.state_finite.view(-1, *[1] * (state.dim() - 1)), state, 0.0)

    def mark(self, y: Tensor, time_dim: int = 1) -> Tensor:
        """``y [B, ..., T, ...]`` with every token of a poisoned sample set to NaN."""
        if self.keep is None:
            return y
        return torch.where(self.keep.view(self._shape(y, time_dim)), y, float("nan"))

    def mark_states(self, final: Tensor | None, offsets: Tensor) -> Tensor | None:
        """``final [N, ...]`` per-sample final states with the poisoned samples' set to NaN. ``offsets [N+1]``:
        sample ``i`` is tokens ``offsets[i]:offsets[i+1]`` of the ``B * T`` flattened tokens (``cu_seqlens`` of
        a row, or ``T * arange(B + 1)`` for one sample per row)."""
        if final is None or self.keep is None:
            return final
        total = self.sample_sums.numel()
        start, end = offsets[:-1].long(), offsets[1:].long()
        finite = torch.isfinite(self.sample_sums[start.clamp(max=max(total - 1, 0))]) | (end == start) if total else (
            torch.ones_like(start, dtype=torch.bool))
        if self.state_finite is not None:
            finite = finite & self.state_finite
        return torch.where(finite.view(-1, *[1] * (final.dim() - 1)), final, float("nan"))


def around_kernel(seq_idx: Tensor | None, per_token: list[tuple[Tensor | None, int]],
                  kernel: Callable[..., Tensor], *, out_time_dim: int = 1) -> Tensor:
    """``kernel(*clean inputs)`` with every sample that has a non-finite input computed on zeros and returned as
    NaN (:class:`Quarantine`); ``per_token``: the kernel's per-token inputs with their time dim, in call order. One
    sample per row (``seq_idx`` None) needs nothing: a kernel never mixes rows."""
    if seq_idx is None:
        return kernel(*(t for t, _ in per_token))
    quarantine = Quarantine(seq_idx, per_token)
    return quarantine.mark(kernel(*quarantine.clean()), out_time_dim)
