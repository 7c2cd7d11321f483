"""Public gated-delta ops: fla's Triton kernels on CUDA when fla imports, else the PyTorch chunked path.

Routing goes through the shared ``packfree_plugin.ops.backends`` (``on_cuda`` predicate, cached lazy
``load_kernel``), so tests exercise the fla route on CPU by monkeypatching ``backends.on_cuda`` and putting a
fake ``fla`` in ``sys.modules`` (then ``load_kernel.cache_clear()``). Inputs are validated here first,
whichever route runs, so a contract violation is always a ``ValueError`` from packfree, never a Triton
assertion.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._boundary_doc import with_boundary_doc
from .._dispatch import Backend, pick_kernel
from .._nonfinite import Quarantine
from .fast import _validate, chunk_gated_delta_rule_torch, chunk_kda_torch

__all__ = ["chunk_gated_delta_rule", "chunk_kda"]

FLA_GDN = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
FLA_KDA = ("fla.ops.kda", "chunk_kda")
# Under "auto", fla gets the half dtypes it is built for; float32/float64 take the torch path.
_FLA_DTYPES = (torch.bfloat16, torch.float16)
_FLA_MAX_HEAD_DIM = 256  # fla's chunk kernels assert K <= 256 (GDN's state kernel, KDA's entry point)


def _pick(backend: Backend, q: torch.Tensor, target: tuple[str, str]):
    kernel = pick_kernel(backend, q, *target)
    if kernel is None:
        return None
    too_wide = q.shape[-1] > _FLA_MAX_HEAD_DIM
    if backend == "auto":
        return None if too_wide or q.dtype not in _FLA_DTYPES else kernel
    if too_wide:
        raise ValueError(f"backend='kernel': fla's {target[1]} takes a key head dim K <= {_FLA_MAX_HEAD_DIM}, got "
                         f"{q.shape[-1]}; backend='auto' or 'torch' runs it on packfree's torch path")
    return kernel


def _isolated(seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None, per_token: tuple[torch.Tensor, ...],
              initial_state: torch.Tensor | None, kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``kernel(q, k, v, g, beta, initial_state)`` with a sample whose inputs or initial state hold a NaN or inf
    computed on zeros and returned as NaN, final state included (fla does not isolate them:
    :mod:`packfree_plugin.ops._nonfinite`)."""
    if seq_idx is None:
        return kernel(*per_token, initial_state)
    quarantine = Quarantine(seq_idx, [(t, 1) for t in per_token], initial_state)
    o, final = kernel(*quarantine.clean(), quarantine.clean_state(initial_state))
    offsets = cu_seqlens if cu_seqlens is not None else seq_idx.shape[1] * torch.arange(
        seq_idx.shape[0] + 1, device=seq_idx.device)
    return quarantine.mark(o), quarantine.mark_states(final, offsets)


def _fla_cu_seqlens(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    return None if cu_seqlens is None else cu_seqlens.to(torch.int32)


@with_boundary_doc
def chunk_gated_delta_rule(
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
    backend: Backend = "auto",
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boundary-aware Gated DeltaNet (Qwen3-Next / Qwen3.5), fla's ``chunk_gated_delta_rule`` contract.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H]`` log decay. beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]``.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        {cu_seqlens}
        backend: ``"auto"`` (fla for CUDA bf16/fp16 inputs with K <= 256 when fla imports, else torch),
            ``"torch"``, or ``"kernel"`` (force fla; ValueError if it does not import or K > 256).
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.

    The fla route receives cu_seqlens as int32 on the data's device (B == 1); the torch route is
    :func:`chunk_gated_delta_rule_torch`.
    """
    fla_fn = _pick(backend, q, FLA_GDN)
    if fla_fn is None:
        return chunk_gated_delta_rule_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, validate=validate,
        )
    seq_idx = _validate(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=False, validate=validate)
    return _isolated(seq_idx, cu_seqlens, (q, k, v, g, beta), initial_state, lambda q, k, v, g, beta, state: fla_fn(
        q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=_fla_cu_seqlens(cu_seqlens),
    ))


@with_boundary_doc
def chunk_kda(
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
    backend: Backend = "auto",
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Boundary-aware Kimi Delta Attention (per-channel decay), fla's ``chunk_kda`` contract.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]`` (same dtype as q).
        g: ``[B, T, H, K]`` log decay, or the raw gate input when ``use_gate_in_kernel``.
        beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the final state ``[N, H, K, V]``.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        use_gate_in_kernel: decay = ``-exp(A_log[h]) * softplus(g + dt_bias)``; ``A_log [H]`` required,
            ``dt_bias [H*K]`` optional.
        {cu_seqlens}
        backend: ``"auto"`` (fla for CUDA bf16/fp16 inputs with K <= 256 when fla imports, else torch),
            ``"torch"``, or ``"kernel"`` (force fla; ValueError if it does not import or K > 256).
        validate: check cu_seqlens' values (start, end, order); default None: only on the CPU (no host sync).

    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``.

    Raises:
        ValueError: on any shape/dtype/device/cu_seqlens contract violation.

    The fla route receives cu_seqlens as int32 on the data's device (B == 1) and initial_state as float32
    (fla requires it); the torch route is :func:`chunk_kda_torch`.
    """
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True requires A_log")
    fla_fn = _pick(backend, q, FLA_KDA)
    if fla_fn is None:
        return chunk_kda_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens, validate=validate,
        )
    seq_idx = _validate(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True, validate=validate)
    extra = {"A_log": A_log, "dt_bias": dt_bias} if use_gate_in_kernel else {}
    return _isolated(seq_idx, cu_seqlens, (q, k, v, g, beta), initial_state, lambda q, k, v, g, beta, state: fla_fn(
        q, k, v, g, beta, scale=scale, initial_state=None if state is None else state.float(),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, cu_seqlens=_fla_cu_seqlens(cu_seqlens), **extra,
    ))
