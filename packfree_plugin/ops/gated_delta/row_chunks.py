"""Rows cut into fixed chunks of ``C`` tokens whatever their samples (no initial states): the boundary masks, the
restarted in-chunk decay sums, the chunk-to-chunk state recurrence of every row and each sample's final state
(boundaries: :mod:`packfree_plugin.ops.gated_delta.fast`)."""

from __future__ import annotations

import functools

import numpy
import torch
from torch.autograd.function import once_differentiable

from ...boundaries import host_of, memo
from .._chunk_layout import compute_dtype
from .intra_chunk import above_diagonal, intra_blocks, scalar_gram, unit_lower_solve
from .stacked import unstack_chunks

__all__ = ["host_causal", "mask_arrays", "run_row_chunks"]

_NEG_INF = float("-inf")


def _contiguous_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous, in one copy (``to`` alone keeps a permuted layout when no cast is due)."""
    return x.contiguous() if x.dtype == dtype else x.to(dtype, memory_format=torch.contiguous_format)


def _chunked(x: torch.Tensor, chunk: int, cdt: torch.dtype) -> torch.Tensor:
    """:class:`_ToChunks`' forward (what runs alone where no gradient is recorded: no graph node to build)."""
    B, T, H, D = x.shape
    full, rem = divmod(T, chunk)
    nc = full + (rem > 0)
    out = x.new_empty((nc, B, H, chunk, D), dtype=cdt)
    dst = out.permute(1, 0, 3, 2, 4)  # [B, nc, C, H, D] view
    dst[:, :full].copy_(x[:, : full * chunk].reshape(B, full, chunk, H, D))
    if rem:
        dst[:, full, :rem].copy_(x[:, full * chunk :])
        dst[:, full, rem:].zero_()
    return out.view(nc * B, H, chunk, D)


class _ToChunks(torch.autograd.Function):
    """``[B, T, H, D]`` -> ``[nc * B, H, C, D]`` in ``cdt``, chunk-major (chunk ``c`` of row ``b`` at ``c * B + b``:
    one step of the state recurrence is one contiguous slice), zero after the last token: one copy, cast and
    padding included. The backward is one copy too, and returns the gradient contiguous in ``x``'s layout and
    dtype (autograd's own would hand the caller a permuted view, and the caller's reductions over it would sum
    in another order than over a compiled step's contiguous gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, chunk: int, cdt: torch.dtype) -> torch.Tensor:
        ctx.layout = (x.shape[0], x.shape[1], chunk, x.dtype)
        return _chunked(x, chunk, cdt)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        B, T, chunk, dtype = ctx.layout
        full, rem = divmod(T, chunk)
        M, H, C, D = grad.shape
        src = grad.view(M // B, B, H, C, D).permute(1, 0, 3, 2, 4)  # [B, nc, C, H, D]
        out = grad.new_empty((B, T, H, D), dtype=dtype)
        out[:, : full * chunk].view(B, full, chunk, H, D).copy_(src[:, :full])
        if rem:
            out[:, full * chunk :].copy_(src[:, full, :rem])
        return out, None, None


def _from_chunks(o: torch.Tensor, B: int, T: int, dtype: torch.dtype) -> torch.Tensor:
    """``[nc * B, H, C, V]`` chunk-major -> ``[B, T, H, V]`` in ``dtype``: one copy, cast included."""
    M, H, C, V = o.shape
    out = _contiguous_as(o.view(M // B, B, H, C, V).permute(1, 0, 3, 2, 4), dtype)
    return out.view(B, M // B * C, H, V)[:, :T]


def _row_states(qg: torch.Tensor, P: torch.Tensor, U: torch.Tensor, W: torch.Tensor, decay_last: torch.Tensor,
                k_end_t: torch.Tensor, B: int, *, end_state: bool, keep: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunk-to-chunk state recurrence of every row and the output of every chunk, chunk-major: ``qg, U, W``
    ``[M, H, C, *]``, ``P [M, H, C, C]``, ``decay_last [M, H, K or 1, 1]``, ``k_end_t [M, H, K, C]``.

    Returns ``o [M, H, C, V]``, every row's end state ``[B, H, K, V]`` if ``end_state`` (else None) and, if
    ``keep``, the state entering every chunk ``[M, H, K, V]`` and ``v_new [M, H, C, V]`` (else None). A step is
    the ``B`` chunks at one position, as 3-d products over ``B * H`` (fused multiply-adds); a row's first chunk
    enters with a zero state, so it reads none. Each chunk's output is taken in the loop from the state backward
    keeps anyway: no stacked copy of the states is saved."""
    M, H, C, V = U.shape
    K = W.shape[-1]
    nc = M // B
    steps = zip(*(t.reshape(nc, B * H, *t.shape[2:]).unbind(0) for t in (qg, P, U, W, decay_last, k_end_t)))
    S = None
    outs, entering, news = [], [], []
    for c, (q_c, p_c, u, w, dl, ke_t) in enumerate(steps):
        if S is None:  # a row's first chunk: zero state (a copy: a view would keep all of U alive for backward)
            v = u.clone()
            outs.append(torch.bmm(p_c, v))
        else:
            v = torch.baddbmm(u, w, S, alpha=-1.0)
            outs.append(torch.baddbmm(torch.bmm(q_c, S), p_c, v))
        if keep:
            entering.append(u.new_zeros(B * H, K, V) if S is None else S)
            news.append(v)
        if c + 1 < nc or end_state:
            S = torch.bmm(ke_t, v) if S is None else torch.baddbmm(S * dl, ke_t, v)
    o = torch.stack(outs).view(M, H, C, V)
    end = S.view(B, H, K, V) if end_state else None
    if not keep:
        return o, end, None
    return o, end, (torch.stack(entering).view(M, H, K, V), torch.stack(news).view(M, H, C, V))


def _sample_end_states(cu_seqlens: torch.Tensor, seq: torch.Tensor, cont: torch.Tensor, gc: torch.Tensor,
                       kc: torch.Tensor, v_new: torch.Tensor, h_before: torch.Tensor, *, per_channel: bool
                       ) -> torch.Tensor:
    """Final state of every sample of a flattened row (B == 1): its chunk's entering state decayed to the sample's
    last token plus that chunk's tokens of the sample. ``seq/cont [M, C]``, ``gc [M, H, C(, K)]``,
    ``kc [M, H, C, K]``, ``v_new [M, H, C, V]``, ``h_before [M, H, K, V]``. Returns ``[N, H, K, V]``."""
    C = seq.shape[1]
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    end = (cu[1:] - 1).clamp(min=0)
    m, p = end // C, end % C
    sample = torch.arange(N, device=seq.device)
    G = gc[m]  # [N, H, C(, K)]
    G_end = G[sample, :, p]  # [N, H(, K)]
    mine = (seq[m] == sample[:, None]) & (torch.arange(C, device=seq.device) <= p[:, None])  # [N, C]
    mine = mine[:, None, :, None] if per_channel else mine[:, None, :]
    to_end = (G_end.unsqueeze(2) - G).masked_fill(~mine, _NEG_INF)
    k_end = kc[m] * (torch.exp(to_end) if per_channel else torch.exp(to_end)[..., None])
    start_gain = torch.exp(G_end.masked_fill(~cont[m, p].view(N, *[1] * (G_end.dim() - 1)), _NEG_INF))
    start_gain = start_gain[..., None] if per_channel else start_gain[..., None, None]
    S = start_gain * h_before[m] + k_end.transpose(-1, -2) @ v_new[m]
    return torch.where((cu[1:] > cu[:-1]).view(N, 1, 1, 1), S, torch.zeros_like(S))


@functools.lru_cache(maxsize=16)
def host_causal(C: int) -> numpy.ndarray:
    """``[C, C]`` bool numpy, True on and below the diagonal."""
    return numpy.tri(C, dtype=bool)


def mask_arrays(seq_idx: torch.Tensor | numpy.ndarray, C: int, causal: torch.Tensor | numpy.ndarray) -> tuple:
    """:func:`_row_masks`' ``(seq, cut, fresh, not_last, cont, same)`` (``same`` bool) from ``seq_idx [B, T]``, in
    torch or numpy alike (whichever ``seq_idx`` is); ``causal [C, C]`` True on and below the diagonal."""
    xp = numpy if isinstance(seq_idx, numpy.ndarray) else torch
    B, T = seq_idx.shape
    pad = -T % C
    seq = xp.concatenate([seq_idx, *[seq_idx[:, -1:]] * pad], 1) if pad else seq_idx
    seq = seq.reshape(B, -1, C).swapaxes(0, 1).reshape(-1, C)
    # sample of the token before each chunk: the previous chunk's last, none for a row's first chunk
    before = xp.concatenate([xp.full_like(seq[:B, :1], -1), seq[:-B, -1:]])
    cont = seq == before
    same = (seq[:, :, None] == seq[:, None, :]) & causal
    return seq, ~same[:, None], ~cont[:, None], (seq != seq[:, -1:])[:, None], cont, same


def _row_masks(seq_idx: torch.Tensor, cu_seqlens: torch.Tensor | None, C: int, cdt: torch.dtype
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``((seq, cut, fresh, not_last), cont [M, C], same [M, C, C])`` for rows cut into chunks of ``C``,
    chunk-major as :class:`_ToChunks`: the boundary masks of
    :func:`packfree_plugin.ops.gated_delta.intra_chunk._intra_chunk` (padding slots join the row's last sample),
    whether a token continues the sample running before its chunk, and the in-chunk causal same-sample matrix in
    ``cdt``. Kept for ``cu_seqlens`` (:func:`~packfree_plugin.boundaries.memo`: every layer of a forward passes the same tensor), so
    they are built once per forward, not once per layer or call. A CPU row builds them in numpy (a fraction of
    torch's per-call cost, which a short row pays a dozen times), others on their device (no host sync)."""
    def build() -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        if seq_idx.device.type == "cpu" and not torch.compiler.is_compiling():
            arrays = map(torch.from_numpy, mask_arrays(host_of(seq_idx).copy(), C, host_causal(C)))
        else:
            arrays = mask_arrays(seq_idx, C, ~above_diagonal(C, seq_idx.device))
        seq, cut, fresh, not_last, cont, same = arrays
        return (seq, cut, fresh, not_last), cont, same.to(cdt)

    return build() if cu_seqlens is None else memo(cu_seqlens, "gdn_masks", (tuple(seq_idx.shape), C, cdt), build)


def _restarted_cumsum(same: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """In-chunk cumulative sum of ``g [M, H, C(, K)]`` restarted at every sample start: ``same [M, C, C]``
    (causal, same sample) applied in one batched product, to every head's row of a scalar decay as it lies
    (no relayout), to every (head, channel) column of a per-channel one."""
    if g.dim() == 3:
        return torch.bmm(g, same.transpose(1, 2))
    M, H, C, K = g.shape
    cols = g.transpose(1, 2).reshape(M, C, H * K)
    return (same @ cols).view(M, C, H, K).transpose(1, 2).contiguous()


def run_row_chunks(x: torch.Tensor, seq_idx: torch.Tensor | None, *, head_dims: tuple[int, int],
                   dtype: torch.dtype, scale: float, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                   cu_seqlens: torch.Tensor | None, chunk_size: int, per_channel: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No initial states: rows cut into fixed chunks, boundaries inside chunks (module docstring). ``x`` the
    inputs stacked by :func:`packfree_plugin.ops.gated_delta.stacked.stack_inputs` ``[B, T, H, D]``,
    ``head_dims = (K, V)``, ``dtype`` q's; ``seq_idx [B, T]`` or None. Returns as
    :func:`packfree_plugin.ops.gated_delta.fast.chunk_gated_delta_rule_torch`."""
    B, T, H = x.shape[:3]
    K, V = head_dims
    cdt = compute_dtype(dtype)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if T == 0:
        final = x.new_zeros(N, H, K, V, dtype=cdt) if output_final_state else None
        return x.new_empty(B, 0, H, V, dtype=dtype), final
    C = chunk_size
    chunked = _ToChunks.apply(x, C, cdt) if torch.is_grad_enabled() and x.requires_grad else _chunked(x, C, cdt)
    qc, kc, vc, g_c, bc = unstack_chunks(chunked, K, V, scale=scale, per_channel=per_channel,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if seq_idx is None:
        seq = cont = None
        masks = (None,) * 4
        gc = g_c.cumsum(dim=2)
    else:
        masks, cont, same = _row_masks(seq_idx, cu_seqlens, C, cdt)
        seq = masks[0]
        # cumulative log decay restarted at every sample start: both ends of G_r - G_s sum from the same token
        gc = _restarted_cumsum(same, g_c)
    if B == qc.shape[0] and not (per_channel or output_final_state):
        # one chunk per row and no final state: no state enters or leaves a chunk, so o = P U alone
        A, P = scalar_gram(qc, kc, gc, bc, masks[1])
        U, _ = unit_lower_solve(A, bc, vc)
        o = torch.bmm(P.reshape(-1, C, C), U.reshape(-1, C, V)).view(U.shape)
        return _from_chunks(o, B, T, dtype), None
    P, U, W, qg, decay_last, k_end_t = intra_blocks(qc, kc, vc, gc, bc, masks, per_channel=per_channel)
    per_sample_ends = output_final_state and cu_seqlens is not None
    o, final, kept = _row_states(qg, P, U, W, decay_last, k_end_t, B, keep=per_sample_ends,
                                 end_state=output_final_state and not per_sample_ends)
    if per_sample_ends:
        h_before, v_new = kept
        final = _sample_end_states(cu_seqlens, seq, cont, gc, kc, v_new, h_before, per_channel=per_channel)
    return _from_chunks(o, B, T, dtype), final

