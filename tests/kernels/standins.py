"""Stand-ins for the compiled CUDA code behind flash-attn, causal-conv1d and torch's ``varlen_attn``, so the kernel
test mode runs those packages' **real Python wrappers** on CPU tensors (tests/README.md).

flash-attn and causal-conv1d install here without their CUDA extensions (``*_SKIP_CUDA_BUILD``); their Python code
imports ``flash_attn_2_cuda`` / ``causal_conv1d_cuda``. torch's ``varlen_attn`` reaches ``aten::_flash_attention_*``,
which has no CPU kernel. Each stand-in below takes the compiled function's arguments, applies the argument checks
the C++ source states (each ``TORCH_CHECK`` transcribed with its message, device checks left out) and computes
the result with plain torch per segment in float32. What a test learns from it: that what packfree hands the real
wrapper, after everything the wrapper does to it (padding, ``contiguous``, layout, custom-op registration,
autograd), is what the compiled kernel accepts, and that the segments the kernel would see are the samples.
What it cannot learn: the CUDA code's own numerics.

Sources: flash-attn 2.8.3 ``csrc/flash_attn/flash_api.cpp`` (``mha_varlen_fwd`` / ``mha_varlen_bwd``);
torch's copy ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`` (the same checks, without
flash-attn's Python-side head-dim padding); causal-conv1d 1.6.1 ``csrc/causal_conv1d.cpp``
(``causal_conv1d_fwd`` / ``causal_conv1d_bwd``).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)
CONV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(condition: bool, message: str) -> None:
    """``TORCH_CHECK``: a RuntimeError with the C++ message."""
    if not condition:
        raise RuntimeError(message)


# --------------------------------------------------------------------------- varlen attention (FlashAttention 2)


def check_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, dropout: float,
                         softcap: float) -> None:
    """``mha_varlen_fwd``'s checks: q ``[total_q, H, D]``, k/v ``[total_k, Hk, D]`` (one D), half dtypes."""
    check(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    if softcap > 0.0:
        check(dropout == 0.0, "Softcapping does not support dropout for now")
    batch = cu_q.numel() - 1
    total_q, heads, head_size = q.shape
    heads_k = k.shape[1]
    check(batch > 0, "batch size must be positive")
    check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    total_k = k.shape[0]
    check(tuple(k.shape) == (total_k, heads_k, head_size), "k must have shape (total_k, num_heads_k, head_size)")
    check(tuple(v.shape) == (total_k, heads_k, head_size), "v must have shape (total_k, num_heads_k, head_size)")
    check(tuple(cu_q.shape) == (batch + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
    check(tuple(cu_k.shape) == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
    check(dropout == 0.0, "stand-in: dropout is not modelled (flash's own random stream)")


def check_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, cu_q: Tensor,
                          cu_k: Tensor) -> None:
    """``mha_varlen_bwd``'s checks on top of the forward's."""
    for name, t in (("out", out), ("dout", dout)):
        check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
    check(tuple(out.shape) == tuple(q.shape), "out must have shape (total_q, num_heads, head_size)")
    check(tuple(dout.shape) == tuple(q.shape), "dout must have shape (total_q, num_heads, head_size)")
    check_varlen_forward(q, k, v, cu_q, cu_k, 0.0, 0.0)


def _window_bounds(is_causal: bool, left: int, right: int, max_k: int) -> tuple[int, int]:
    """flash's window after ``mha_varlen_fwd``'s adjustments: causal sets ``right = 0``; a side ``>= max_k`` or
    ``< 0`` is unlimited (returned as -1)."""
    if is_causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    return left, right


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, *, scale: float, left: int,
                     right: int, softcap: float) -> tuple[Tensor, Tensor]:
    """Each segment of ``cu_q`` / ``cu_k`` attends only to itself, queries aligned to the end of its keys:
    key ``j`` is visible from query ``i`` (at key position ``p = i + Lk - Lq``) iff ``p - left <= j <= p + right``
    (-1: unlimited). Returns out ``[total_q, H, D]`` in float32 and the logsumexp ``[H, total_q]``."""
    heads, heads_k = q.shape[1], k.shape[1]
    outs, lses = [], []
    for i in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qs = q[qa:qb].float().transpose(0, 1)  # [H, Lq, D]
        ks = k[ka:kb].float().transpose(0, 1).repeat_interleave(heads // heads_k, dim=0)
        vs = v[ka:kb].float().transpose(0, 1).repeat_interleave(heads // heads_k, dim=0)
        logits = qs @ ks.transpose(1, 2) * scale
        if softcap > 0.0:
            logits = softcap * torch.tanh(logits / softcap)
        lq, lk = qb - qa, kb - ka
        pos = torch.arange(lq)[:, None] + (lk - lq)
        key = torch.arange(lk)[None, :]
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            visible &= key >= pos - left
        if right >= 0:
            visible &= key <= pos + right
        logits = logits.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)  # [H, Lq]
        weights = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
        outs.append((weights @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def varlen_gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                     **attention: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`varlen_attention` w.r.t. q, k, v for the cotangent ``dout`` (float32)."""
    _, pullback = torch.func.vjp(lambda *qkv: varlen_attention(*qkv, cu_q, cu_k, **attention)[0],
                                 *(t.detach().float() for t in (q, k, v)))
    return pullback(dout.float())  # torch.func: autograd's dispatch keys are off inside a custom op


def flash_attn_2_cuda() -> types.SimpleNamespace:
    """The ``flash_attn_2_cuda`` entry points ``flash_attn_varlen_func`` reaches: ``varlen_fwd``, ``varlen_bwd``."""

    def varlen_fwd(q, k, v, out_, cu_q, cu_k, seqused_k, leftpad_k, block_table, alibi_slopes, max_q, max_k,
                   dropout, scale, zero_tensors, is_causal, left, right, softcap, return_softmax, gen):
        check(block_table is None and seqused_k is None and leftpad_k is None and alibi_slopes is None,
              "stand-in: paged KV, seqused_k, leftpad_k and ALiBi are not modelled")
        check_varlen_forward(q, k, v, cu_q, cu_k, dropout, softcap)
        left, right = _window_bounds(is_causal and max_q > 1, left, right, max_k)
        out, lse = varlen_attention(q, k, v, cu_q, cu_k, scale=scale, left=left, right=right, softcap=softcap)
        return out.to(q.dtype), lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    def varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, alibi_slopes, max_q, max_k, dropout, scale,
                   zero_tensors, is_causal, left, right, softcap, deterministic, gen, rng_state):
        check_varlen_backward(dout, q, k, v, out, cu_q, cu_k)
        left, right = _window_bounds(is_causal, left, right, max_k)
        grads = varlen_gradients(dout, q, k, v, cu_q, cu_k, scale=scale, left=left, right=right, softcap=softcap)
        for into, grad in zip((dq, dk, dv), grads):
            into.copy_(grad)
        return dq, dk, dv, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)

    return types.SimpleNamespace(varlen_fwd=varlen_fwd, varlen_bwd=varlen_bwd)


def aten_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` (varlen: ``cum_seq_q`` given) for CPU tensors."""
    check(cum_seq_q is not None and seqused_k is None and block_table is None and alibi_slopes is None,
          "stand-in: only the varlen call without paged KV, seqused_k or ALiBi is modelled")
    check_varlen_forward(query, key, value, cum_seq_q, cum_seq_k, dropout_p, 0.0)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = _window_bounds(is_causal and max_q > 1, -1 if window_size_left is None else window_size_left,
                                 -1 if window_size_right is None else window_size_right, max_k)
    out, lse = varlen_attention(query, key, value, cum_seq_q, cum_seq_k, scale=scale, left=left, right=right,
                                softcap=0.0)
    unused = torch.empty(0, dtype=torch.uint64)
    return out.to(query.dtype), lse, torch.zeros(2, dtype=torch.uint64), unused, torch.empty(0, dtype=query.dtype)


def aten_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                  dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                                  window_size_right=None):
    """``aten::_flash_attention_backward`` (varlen) for CPU tensors; like aten's CUDA wrapper, it makes
    ``grad_out`` and ``out`` contiguous before the checks."""
    grad_out, out = grad_out.contiguous(), out.contiguous()
    check_varlen_backward(grad_out, query, key, value, out, cum_seq_q, cum_seq_k)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    left, right = _window_bounds(is_causal, -1 if window_size_left is None else window_size_left,
                                 -1 if window_size_right is None else window_size_right, max_k)
    grads = varlen_gradients(grad_out, query, key, value, cum_seq_q, cum_seq_k, scale=scale, left=left,
                             right=right, softcap=0.0)
    return tuple(g.to(query.dtype) for g in grads)


# --------------------------------------------------------------------------- causal depthwise conv1d


def check_conv(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None,
               initial_states: Tensor | None, final_states: Tensor | None) -> bool:
    """``causal_conv1d_fwd``'s checks on x ``[B, C, T]``, weight ``[C, W]``; returns whether x is channel-last."""
    check(x.dtype in CONV_DTYPES and weight.dtype in CONV_DTYPES, "causal_conv1d: input and weight must be "
          "float32, float16 or bfloat16")
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    check(tuple(weight.shape) == (dim, width), "weight must have shape (dim, width)")
    check(x.stride(2) == 1 or x.stride(1) == 1, "x must be contiguous along its channel or its time dimension")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "causal_conv1d with channel last layout requires "
              "strides (x.stride(0) and x.stride(2)) to be multiples of 8")
    check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        check(bias.dtype == weight.dtype, "bias must have the weight's dtype")
        check(bias.stride(-1) == 1, "bias must be contiguous")
        check(tuple(bias.shape) == (dim,), "bias must have shape (dim)")
    if seq_idx is not None:
        check(channel_last, "seq_idx is only supported for channel last layout")
        check(seq_idx.dtype == torch.int32, "seq_idx must be int32")
        check(seq_idx.is_contiguous(), "seq_idx must be contiguous")
        check(tuple(seq_idx.shape) == (batch, seqlen), "seq_idx must have shape (batch_size, seqlen)")
    for name, states in (("initial_states", initial_states), ("final_states", final_states)):
        if states is not None:
            check(channel_last, f"{name} is only supported for channel last layout")
            check(states.dtype == x.dtype, f"{name} must have the input's dtype")
            check(tuple(states.shape) == (batch, dim, width - 1), f"{name} must have shape (batch, dim, width - 1)")
            check(states.stride(1) == 1, f"{name} must be channel-last")
    return channel_last


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, silu: bool) -> Tensor:
    """``out[b, c, t] = act(bias[c] + sum_k weight[c, k] * x[b, c, t - (W-1) + k])`` in float32, a tap read as 0
    where it falls before the row or in another sample (``seq_idx`` differs)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[-1]
    xf, wf = x.float(), weight.float()
    out = torch.zeros(batch, dim, seqlen) if bias is None else bias.float()[None, :, None].expand(batch, dim, seqlen)
    for k in range(width):
        shift = width - 1 - k
        tap = F.pad(xf, (shift, 0))[..., :seqlen]
        if seq_idx is not None and shift > 0:
            same = torch.zeros(batch, seqlen, dtype=torch.bool)
            same[:, shift:] = seq_idx[:, shift:] == seq_idx[:, :-shift]
            tap = tap * same[:, None, :]
        out = out + wf[:, k, None] * tap
    return F.silu(out) if silu else out


def causal_conv1d_cuda() -> types.SimpleNamespace:
    """The ``causal_conv1d_cuda`` entry points ``causal_conv1d_fn`` reaches: ``causal_conv1d_fwd`` / ``_bwd``."""

    def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu):
        check_conv(x, weight, bias, seq_idx, initial_states, final_states_out)
        check(initial_states is None and final_states_out is None, "stand-in: conv states are not modelled")
        out.copy_(causal_conv(x, weight, bias, seq_idx, silu))

    def causal_conv1d_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias,
                          dinitial_states, silu):
        check_conv(x, weight, bias, seq_idx, initial_states, None)
        check(tuple(dout.shape) == tuple(x.shape), "dout must have shape (batch_size, dim, seqlen)")
        check((bias is None) == (dbias is None), "bias and dbias must both be given or both be None")
        check(initial_states is None and dfinal_states is None, "stand-in: conv states are not modelled")
        leaves = [t.detach().float() for t in (x, weight) + ((bias,) if bias is not None else ())]
        _, pullback = torch.func.vjp(lambda x, w, *b: causal_conv(x, w, b[0] if b else None, seq_idx, silu), *leaves)
        grads = pullback(dout.float())
        dx.copy_(grads[0])
        dweight.add_(grads[1])
        if dbias is not None:
            dbias.add_(grads[2])

    return types.SimpleNamespace(causal_conv1d_fwd=causal_conv1d_fwd, causal_conv1d_bwd=causal_conv1d_bwd)


# --------------------------------------------------------------------------- installation

_ATEN = torch.library.Library("aten", "IMPL")  # kept alive: dropping it unregisters the kernels


def install() -> None:
    """Put the stand-ins where the real wrappers look for compiled code; call before they are imported (the
    conftest checks that they were not)."""
    sys.modules["flash_attn_2_cuda"] = flash_attn_2_cuda()
    sys.modules["causal_conv1d_cuda"] = causal_conv1d_cuda()
    _ATEN.impl("_flash_attention_forward", aten_flash_attention_forward, "CPU")
    _ATEN.impl("_flash_attention_backward", aten_flash_attention_backward, "CPU")

    import flash_attn.flash_attn_interface as interface

    # flash-attn registers its custom ops for CUDA only; give them their own Python bodies on the CPU as well
    for op in (interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward):
        op.register_kernel("cpu")(op._init_fn)

