"""Public boundary-aware Mamba2 SSD chunk scan and its dispatch (mamba_ssm on CUDA, else torch)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._boundary_doc import with_boundary_doc
from .._dispatch import Backend, pick_kernel
from .._nonfinite import around_kernel
from .._seq import resolve_seq_idx
from .fast import ssd_chunked

KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape_error(name: str, want: str, t: Tensor) -> ValueError:
    return ValueError(f"{name} must be {want}, got {list(t.shape)}")


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a [B, T, H, P] tensor, got {getattr(x, 'shape', type(x))}")
    Bsz, T, H, P = x.shape
    if tuple(dt.shape) != (Bsz, T, H):
        raise _shape_error("dt", f"[B, T, H] = {[Bsz, T, H]}", dt)
    if tuple(A.shape) != (H,):
        raise _shape_error("A", f"[H] = {[H]}", A)
    if B.dim() != 4 or tuple(B.shape[:2]) != (Bsz, T) or B.shape[2] < 1 or H % B.shape[2]:
        raise _shape_error("B", f"[B, T, G, N] with B={Bsz}, T={T} and G dividing H={H}", B)
    if tuple(C.shape) != tuple(B.shape):
        raise _shape_error("C", f"the shape of B {list(B.shape)}", C)
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        raise _shape_error("D", f"[H] or [H, P] = {[H]} or {[H, P]}", D)
    if z is not None and tuple(z.shape) != tuple(x.shape):
        raise _shape_error("z", f"the shape of x {list(x.shape)}", z)
    if dt_bias is not None and tuple(dt_bias.shape) != (H,):
        raise _shape_error("dt_bias", f"[H] = {[H]}", dt_bias)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("dt_bias", dt_bias)):
        if t is None:
            continue
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")


@with_boundary_doc
def ssd_chunk_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    chunk_size: int = 256,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    backend: Backend = "auto",
    validate: bool | None = None,
) -> Tensor:
    """Mamba2 SSD scan over packed rows; the state restarts from zero at every sample start.

    Same contract as mamba_ssm's ``mamba_chunk_scan_combined`` (no initial or final states):
    ``dt <- clamp(softplus?(dt + dt_bias), *dt_limit)``, then per head h
    ``state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T`` (``[P, N]``), ``y_t = state_t C_t + D x_t``,
    ``y *= silu(z)``. Head h reads group ``h // (H / G)`` of B and C. A boundary may fall anywhere,
    including inside a chunk.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]``.
        A: ``[H]`` (negative in Mamba2: ``-exp(A_log)``).
        B, C: ``[B, T, G, N]``, G divides H.
        chunk_size: chunk length of the scan (result does not depend on it beyond rounding).
        D: ``[H]`` or ``[H, P]`` skip connection, or None.
        z: ``[B, T, H, P]`` gate, or None.
        dt_bias: ``[H]`` or None.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: clamp range for dt; ``(0, inf)`` means no clamp.
        {boundaries}
        backend: ``"auto"`` (``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` with
            ``seq_idx`` when x is on CUDA in fp32/fp16/bf16 and mamba_ssm imports; else the torch
            path :func:`~packfree_plugin.ops.ssd.fast.ssd_chunked`), ``"torch"`` or ``"kernel"``.

    Returns:
        y ``[B, T, H, P]``, dtype of x (the torch path computes half inputs in float32).
    """
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit)
    Bsz, T = x.shape[:2]
    seq_idx = resolve_seq_idx(Bsz, T, x.device, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                              validate=validate)
    kernel = pick_kernel(backend, x, *KERNEL)
    if kernel is not None and (backend == "kernel" or x.dtype in _KERNEL_DTYPES):
        def run(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, z: Tensor | None) -> Tensor:
            return kernel(
                x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                seq_idx=None if seq_idx is None else seq_idx.contiguous(),
                dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
            )

        return around_kernel(seq_idx, [(x, 1), (dt, 1), (B, 1), (C, 1), (z, 1)], run)
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                       dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), seq_idx=seq_idx)
