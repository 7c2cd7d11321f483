"""Public boundary-aware Mamba1 selective scan (pure torch on every device)."""

from __future__ import annotations

from torch import Tensor

from .._boundary_doc import with_boundary_doc
from .._seq import resolve_seq_idx
from .fast import selective_scan_chunked


def _check(u, delta, A, B, C, D, z, delta_bias) -> None:
    if not isinstance(u, Tensor) or u.dim() != 3:
        raise ValueError(f"u must be a [B, D, T] tensor, got {getattr(u, 'shape', type(u))}")
    Bsz, Dm, T = u.shape
    if tuple(delta.shape) != (Bsz, Dm, T):
        raise ValueError(f"delta must be [B, D, T] = {[Bsz, Dm, T]}, got {list(delta.shape)}")
    if A.dim() != 2 or A.shape[0] != Dm:
        raise ValueError(f"A must be [D, N] with D={Dm}, got {list(A.shape)}")
    N = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        ok = (t.dim() == 3 and tuple(t.shape) == (Bsz, N, T)) or (
            t.dim() == 4 and t.shape[0] == Bsz and t.shape[1] >= 1 and Dm % t.shape[1] == 0
            and tuple(t.shape[2:]) == (N, T))
        if not ok:
            raise ValueError(
                f"{name} must be [B, N, T] = {[Bsz, N, T]} or [B, G, N, T] with G dividing D={Dm}, "
                f"got {list(t.shape)}")
    if B.dim() != C.dim() or (B.dim() == 4 and B.shape[1] != C.shape[1]):
        raise ValueError(f"B and C must have the same layout, got {list(B.shape)} and {list(C.shape)}")
    if D is not None and tuple(D.shape) != (Dm,):
        raise ValueError(f"D must be [D] = {[Dm]}, got {list(D.shape)}")
    if z is not None and tuple(z.shape) != tuple(u.shape):
        raise ValueError(f"z must have the shape of u {list(u.shape)}, got {list(z.shape)}")
    if delta_bias is not None and tuple(delta_bias.shape) != (Dm,):
        raise ValueError(f"delta_bias must be [D] = {[Dm]}, got {list(delta_bias.shape)}")
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("delta_bias", delta_bias)):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point (complex A is not supported), got {t.dtype}")
        if t.device != u.device:
            raise ValueError(f"{name} is on {t.device}, u is on {u.device}")


@with_boundary_doc
def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    """Mamba1 selective scan over packed rows; the hidden state restarts at every sample start.

    mamba_ssm's ``selective_scan_fn`` contract (real A, no last state):
    ``delta <- softplus?(delta + delta_bias)``, ``h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t``
    (``[D, N]``), ``y_t = C_t . h_t + D u_t``, ``y *= silu(z)``. Channel d reads group
    ``d // (D / G)`` of B and C.

    Device routing: mamba_ssm's CUDA selective scan has no variable-length (seq_idx / cu_seqlens)
    support, so this op runs the same pure-torch blocked scan
    (:func:`~packfree_plugin.ops.selective_scan.fast.selective_scan_chunked`) on every device,
    CUDA included.

    Args:
        u: ``[B, D, T]``.
        delta: ``[B, D, T]``.
        A: ``[D, N]`` (negative in Mamba: ``-exp(A_log)``).
        B, C: ``[B, N, T]`` or ``[B, G, N, T]`` with G dividing D.
        D: ``[D]`` skip connection, or None.
        z: ``[B, D, T]`` gate, or None.
        delta_bias: ``[D]`` or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        {boundaries}

    Returns:
        y ``[B, D, T]``, dtype of u (half inputs are computed in float32).
    """
    _check(u, delta, A, B, C, D, z, delta_bias)
    Bsz, _, T = u.shape
    seq_idx = resolve_seq_idx(Bsz, T, u.device, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                              validate=validate)
    return selective_scan_chunked(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                  delta_softplus=delta_softplus, seq_idx=seq_idx)
