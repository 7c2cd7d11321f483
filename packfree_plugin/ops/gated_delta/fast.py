"""Chunked, boundary-aware gated delta rule in pure PyTorch (any device, differentiable by autograd).

Recurrence (per sample, per head; ``S`` is ``[K, V]``; ``a_t = exp(g_t)`` is a scalar for Gated DeltaNet and a
``[K]`` vector for KDA, scaling the rows of ``S``)::

    S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

Chunk form (chunk of ``C`` tokens entering with state ``S0``; ``G_r`` the in-chunk cumulative log decay up to
and including ``r``)::

    A[r, s]  = beta_r * sum_d k_r[d] k_s[d] exp(G_r[d] - G_s[d])          s < r
    P[r, s]  =          sum_d q_r[d] k_s[d] exp(G_r[d] - G_s[d])          s <= r
    U = (I + A)^-1 (beta * v),   W = (I + A)^-1 (beta * k * exp(G))       (WY / UT transform)
    delta = U - W S0                                                         ("v_new")
    o = (q * exp(G)) S0 + P delta
    S_C = exp(G_last) S0 + (k * exp(G_last - G))^T delta

Every exponent above is <= 0, so nothing overflows. For KDA's per-channel decay ``A`` and ``P`` are built by
recursive halving (see :func:`packfree_plugin.ops.gated_delta.intra_chunk._per_channel_gram`) so that no
``[C, C, K]`` tensor is ever formed.

Boundaries (no initial states): each row is cut into chunks of ``C`` tokens whatever its samples, so short
samples share chunks and the work is that of the unsplit row. ``G`` restarts at every sample start (a masked
in-chunk sum, so both terms of ``G_r - G_s`` start at the same token, as when the sample runs alone), every
exponent between tokens of different samples is ``-inf`` (``A``, ``P``, ``k`` to the chunk end), and the carried
state reaches only tokens that continue the sample running before the chunk. Rows are stacked and reshaped,
never gathered: no host sync, and two copies of the inputs (all five stacked in one tensor, then one chunk
layout), as stock's transpose and pad. With per-sample initial states, chunks start on sample starts instead.

Where each part lives: ``intra_chunk.py`` (``A``, ``P``, ``U``, ``W`` of every chunk), ``row_chunks.py`` (rows cut
into fixed chunks, boundaries inside them), ``sample_chunks.py`` (chunks aligned on sample starts, for initial
states), ``stacked.py`` (the five inputs as one tensor); this module validates, quarantines non-finite samples
and picks the layout.

At small widths the cost is the number of ops, not their work: inputs travel as one tensor, the state
recurrence runs fused 3-d products per step, and the right-hand sides of the triangular solve are solved in one.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .._boundary_doc import with_boundary_doc
from .._chunk_layout import check_qkv
from .._nonfinite import Quarantine
from .._seq import resolve_seq_idx
from .gates import kda_gate
from .row_chunks import run_row_chunks
from .sample_chunks import run_sample_chunks
from .stacked import stack_inputs

__all__ = ["chunk_gated_delta_rule_torch", "chunk_kda_torch"]


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, *, per_channel: bool, validate: bool | None = None
              ) -> torch.Tensor | None:
    """All contract checks (cu_seqlens values as ``validate`` says: by default only for CPU data, no host sync).
    Returns ``seq_idx [B, T]`` or None."""
    for name, t in (("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    B, T, H, K, V = check_qkv(q, k, v, initial_state, cu_seqlens, g=g, beta=beta)
    g_shape = (B, T, H, K) if per_channel else (B, T, H)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must have shape {list(g_shape)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape {[B, T, H]}, got {tuple(beta.shape)}")
    return resolve_seq_idx(B, T, q.device, cu_seqlens=cu_seqlens, validate=validate)


def _check_chunking(chunk_size: int, per_channel: bool) -> None:
    if chunk_size < 1 or (per_channel and chunk_size & (chunk_size - 1)):
        kind = "a power of two" if per_channel else "positive"
        raise ValueError(f"chunk_size must be {kind}, got {chunk_size}")


def _run(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         chunk_size, per_channel, validate):
    seq_idx = _validate(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=per_channel, validate=validate)
    _check_chunking(chunk_size, per_channel)
    options = dict(scale=q.shape[-1] ** -0.5 if scale is None else scale, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   per_channel=per_channel, head_dims=(q.shape[-1], v.shape[-1]), dtype=q.dtype)
    # float32 throughout (float64 for float64) under autocast too, as compiled code runs it (autocast off inside
    # the custom op): autocast would put the products in bfloat16, and CPU has no bfloat16 triangular solve
    with torch.autocast(q.device.type, enabled=False) if torch.is_autocast_enabled(q.device.type) else nullcontext():
        x = stack_inputs(q, k, v, g, beta, per_channel=per_channel)
        if seq_idx is None:  # one sample per row: no two samples share a chunk or a state
            return _run_chunked(x, seq_idx, initial_state, options)
        # a sample with a NaN/inf input or initial state computes on zeros and returns NaN (ops/_nonfinite.py)
        quarantine = Quarantine(seq_idx, [(x, 1)], initial_state)
        (x,) = quarantine.clean()
        o, final = _run_chunked(x, seq_idx, quarantine.clean_state(initial_state), options)
        return quarantine.mark(o), quarantine.mark_states(final, cu_seqlens)


def _run_chunked(x, seq_idx, initial_state, options):
    """Rows cut into fixed chunks without initial states, else chunks aligned on sample starts."""
    if initial_state is None:
        return run_row_chunks(x, seq_idx, **options)
    return run_sample_chunks(x, initial_state=initial_state, **options)


@with_boundary_doc
def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet (Qwen3-Next / Qwen3.5), chunked, pure PyTorch; semantics of fla's ``chunk_gated_delta_rule``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H]`` log decay (``<= 0``). beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]`` (float32, float64 for float64 input).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (``x / sqrt(sum x^2 + 1e-6)``).
        {cu_seqlens}
        chunk_size: tokens per chunk (64 as in fla).
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                per_channel=False, validate=validate)


@with_boundary_doc
def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (per-channel decay), chunked, pure PyTorch; semantics of fla's ``chunk_kda``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H, K]`` per-channel log decay, or the raw gate input when ``use_gate_in_kernel``.
        beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]`` (float32, float64 for float64 input).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        use_gate_in_kernel: compute the decay as ``-exp(A_log[h]) * softplus(g + dt_bias)`` (then ``A_log [H]``
            is required, ``dt_bias [H*K]`` optional).
        {cu_seqlens}
        chunk_size: tokens per chunk (a power of two: the per-channel Gram matrices are built by halving).
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.
    """
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True requires A_log")
        if g.dim() != 4:
            raise ValueError(f"g must have shape [B, T, H, K], got {tuple(g.shape)}")
        g = kda_gate(g, A_log, dt_bias)
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                per_channel=True, validate=validate)
