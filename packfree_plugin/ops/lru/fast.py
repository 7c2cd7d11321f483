"""Boundary-aware diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` in pure PyTorch (any device, autograd).

Covers RG-LRU (recurrent_gemma) and gated scans that reduce to a diagonal recurrence (RWKV-/xLSTM-style
once their gates are computed). Boundaries cost nothing extra: a sample start is a token whose ``a`` is
replaced by 0 (after folding ``a * initial_state`` into its ``b``), so one scan over the whole packed row
never carries state across samples, with no padding and no per-sample loop.

Fast path: blocked scan. All blocks of ``C`` tokens are scanned at once by a loop over the ``C`` positions
(composing the affine maps ``h -> a h + b``: no division, exact for ``a = 0`` or negative ``a``); the block
carries are scanned the same way (recursively when there are more than ``C`` blocks); one fix-up
``h = A_local * carry + B_local``. Work ``O(T D)``, Python steps ``O(C + T / C)``. (A log-depth doubling
scan was tried first: it touches every element ``log2 C`` times through full-size temporaries and measured
~3x slower fwd+bwd in benchmarks/ops_linear.py on CPU.)
"""

from __future__ import annotations

from .._boundary_doc import with_boundary_doc

import torch

from .._nonfinite import Quarantine
from .._seq import resolve_seq_idx
from .._chunk_layout import (
    check_floating,
    check_same_device,
    compute_dtype,
    host_offsets,
    row_offsets,
)

__all__ = ["linear_recurrence"]


def _chunk_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-chunk scan along dim -2, all chunks at once: ``(A_r, B_r)`` with ``h_r = A_r * h_in + B_r``.

    A Python loop over the ``C`` positions of a chunk; each step is two multiplies and an add on an
    ``[..., n_chunks, D]`` slice. No division (exact for ``a = 0`` and negative ``a``).
    """
    A_acc, B_acc = torch.ones_like(a[..., 0, :]), torch.zeros_like(b[..., 0, :])
    As, Bs = [], []
    for a_r, b_r in zip(a.unbind(-2), b.unbind(-2)):
        B_acc = a_r * B_acc + b_r
        A_acc = a_r * A_acc
        As.append(A_acc)
        Bs.append(B_acc)
    return torch.stack(As, dim=-2), torch.stack(Bs, dim=-2)


def _blocked_scan(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """``h`` for ``h_t = a_t h_{t-1} + b_t``, ``h_{-1} = 0``; ``a, b [..., T, D]``."""
    T, D = a.shape[-2], a.shape[-1]
    if T <= chunk:
        return _chunk_scan(a, b)[1]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    lead = a.shape[:-2]
    A, Bl = _chunk_scan(a.reshape(*lead, n, chunk, D), b.reshape(*lead, n, chunk, D))
    # Carry into block c = state at the end of block c-1: scan the block summaries (recursively).
    ends = _blocked_scan(A[..., -1, :], Bl[..., -1, :], chunk)  # [..., n, D]
    carry = torch.cat([torch.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], dim=-2)
    h = A * carry[..., None, :] + Bl
    return h.reshape(*lead, n * chunk, D)[..., :T, :]


@with_boundary_doc
def linear_recurrence(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` with per-sample reset.

    Each sample starts from ``initial_state[i]`` (zeros if None), i.e. its first token computes
    ``h = a * initial_state[i] + b``.

    Args:
        a: ``[B, T, D]`` decay. b: ``[B, T, D]`` input (same dtype as a).
        initial_state: ``[N, D]`` or None.
        output_final_state: also return ``h`` at the last token of every sample, ``[N, D]`` (float32, float64
            for float64 input; the initial state for an empty sample).
        {cu_seqlens}
        chunk_size: block size of the blocked scan.

    Returns:
        ``(h [B, T, D] in b's dtype, final_state [N, D] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_floating(a=a, b=b, initial_state=initial_state)
    if a.dim() != 3:
        raise ValueError(f"a must have shape [B, T, D], got {tuple(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b must have the shape of a {tuple(a.shape)}, got {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must share a dtype, got {a.dtype}, {b.dtype}")
    if chunk_size < 2:
        raise ValueError(f"chunk_size must be >= 2, got {chunk_size}")
    check_same_device(a.device, b=b, initial_state=initial_state)
    Bsz, T, D = a.shape
    if cu_seqlens is not None:
        offsets = host_offsets(cu_seqlens, batch=Bsz, total=T, device=a.device)
    else:
        offsets = row_offsets(Bsz, T)
    N = len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, D):
        raise ValueError(f"initial_state must have shape [N, D] = {[N, D]}, got {tuple(initial_state.shape)}")
    if N == 1:
        return _scan_samples(a, b, initial_state, output_final_state, offsets, chunk_size)
    # one scan runs over all samples: a sample with a NaN/inf input or initial state computes on zeros and
    # returns NaN (ops/_nonfinite.py)
    if cu_seqlens is not None:
        seq_idx = resolve_seq_idx(Bsz, T, a.device, cu_seqlens=cu_seqlens, validate=False)
    else:
        seq_idx = torch.arange(Bsz, dtype=torch.int32, device=a.device)[:, None].expand(Bsz, T)
    quarantine = Quarantine(seq_idx, [(a, 1), (b, 1)], initial_state)
    h, final = _scan_samples(*quarantine.clean(), quarantine.clean_state(initial_state),
                             output_final_state, offsets, chunk_size)
    return quarantine.mark(h), quarantine.mark_states(final, torch.tensor(offsets, device=a.device))


def _scan_samples(a, b, initial_state, output_final_state, offsets, chunk_size):
    """The blocked scan of :func:`linear_recurrence` (arguments checked, ``offsets`` on the host)."""
    Bsz, T, D = a.shape
    N = len(offsets) - 1
    cdt = compute_dtype(b.dtype)
    af = a.reshape(1, Bsz * T, D).to(cdt)
    bf = b.reshape(1, Bsz * T, D).to(cdt)
    lens = [offsets[i + 1] - offsets[i] for i in range(N)]
    nonempty = [i for i in range(N) if lens[i] > 0]
    starts = torch.tensor([offsets[i] for i in nonempty], dtype=torch.long, device=a.device)
    if initial_state is not None and nonempty:
        h0 = initial_state.to(cdt).index_select(0, torch.tensor(nonempty, dtype=torch.long, device=a.device))
        inject = torch.zeros_like(bf[0]).index_copy(0, starts, af[0].index_select(0, starts) * h0)
        bf = bf + inject[None]
    if nonempty:  # reset: nothing flows into a sample's first token (its initial state is already in b)
        keep = torch.ones(Bsz * T, dtype=cdt, device=a.device).index_fill(0, starts, 0.0)
        af = af * keep[None, :, None]
    h = _blocked_scan(af, bf, chunk_size)[0] if Bsz * T else bf[0]  # no tokens: nothing to scan
    final = None
    if output_final_state:
        final = h.new_zeros(N, D) if initial_state is None else initial_state.to(cdt).clone()
        if nonempty:
            ends = torch.tensor([offsets[i + 1] - 1 for i in nonempty], dtype=torch.long, device=a.device)
            idx = torch.tensor(nonempty, dtype=torch.long, device=a.device)
            final = final.index_copy(0, idx, h.index_select(0, ends))
    return h.view(Bsz, T, D).to(b.dtype), final
