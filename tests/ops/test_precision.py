"""fp32 and bf16 precision at realistic decay ranges, every mixer family: the packed error against the float64
per-sample reference is at most 3x the error of stock transformers' own torch path run on each sample alone in
the same dtype (for the families stock has no standalone torch function for, decay linear attention and the
diagonal LRU: a sequential recurrence on each sample alone)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from packfree_plugin.ops.conv import causal_conv1d, naive_causal_conv1d
from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda, naive_gated_delta_rule, naive_kda
from packfree_plugin.ops.linear_attention import chunk_linear_attention, naive_linear_attention
from packfree_plugin.ops.lru import linear_recurrence, naive_linear_recurrence
from packfree_plugin.ops.selective_scan import naive_selective_scan, selective_scan
from packfree_plugin.ops.ssd import naive_ssd, ssd_chunk_scan

F64 = torch.float64
RATIO = 3.0
pytestmark = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
LENGTHS = [300, 180, 290]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _seq(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)[None]


def _per_sample(fn, lengths: list[int], dim: int, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each sample's slices of ``tensors`` along ``dim`` (None: passed whole), concatenated along dim."""
    parts = [t.split(lengths, dim=dim) if t is not None else [None] * len(lengths) for t in tensors]
    return torch.cat([fn(*piece) for piece in zip(*parts)], dim=dim)


def _check(packed32: torch.Tensor, stock32: torch.Tensor, ref64: torch.Tensor) -> None:
    ours = (packed32.double() - ref64).abs().max().item()
    theirs = (stock32.double() - ref64).abs().max().item()
    assert ours <= RATIO * theirs, f"packed error {ours:.2e} > {RATIO} x stock's {theirs:.2e}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_ssd(dtype):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    gen = _gen(0)
    H, P, N, L, T = 32, 16, 64, 256, sum(LENGTHS)
    x, dt = torch.randn(1, T, H, P, generator=gen, dtype=F64), torch.randn(1, T, H, generator=gen, dtype=F64)
    B, C = torch.randn(1, T, 1, N, generator=gen, dtype=F64), torch.randn(1, T, 1, N, generator=gen, dtype=F64)
    A = -torch.arange(1, H + 1, dtype=F64)  # Mamba2's initialisation: A = -(1..H), dt log-uniform in [1e-3, 0.1]
    dt0 = torch.exp(torch.rand(H, generator=gen, dtype=F64) * math.log(100.0) + math.log(1e-3))
    opts = dict(D=torch.ones(H, dtype=F64), dt_bias=dt0 + torch.log(-torch.expm1(-dt0)))
    ref = naive_ssd(x, dt, A, B, C, seq_idx=_seq(LENGTHS), dt_softplus=True, **opts)
    f = {k: v.to(dtype) for k, v in opts.items()}
    packed = ssd_chunk_scan(x.to(dtype), dt.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype), chunk_size=L, seq_idx=_seq(LENGTHS),
                            backend="torch", dt_softplus=True, **f)
    stock = _per_sample(lambda x_, dt_, B_, C_: mamba2_chunk_scan(x_, dt_, A.to(dtype), B_, C_, L, dt_softplus=True, **f),
                        LENGTHS, 1, x.to(dtype), dt.to(dtype), B.to(dtype), C.to(dtype))
    _check(packed, stock, ref)


def _delta_inputs(per_channel: bool, seed: int):
    """Qwen3.5 / Kimi-like gates: ``g = -exp(A_log) softplus(a + dt_bias)`` with A in (0, 16], beta in (0, 1)."""
    gen = _gen(seed)
    H, K, T = 4, 64, sum(LENGTHS)
    q, k, v = (torch.randn(1, T, H, K, generator=gen, dtype=F64) for _ in range(3))
    shape = (1, T, H, K) if per_channel else (1, T, H)
    A = torch.rand(H, generator=gen, dtype=F64) * 16
    A = A.view(H, 1) if per_channel else A
    g = -A * F.softplus(torch.randn(*shape, generator=gen, dtype=F64) - 4.0)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, dtype=F64))
    return q, k, v, g, beta


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_gated_delta(family, dtype):
    per_channel = family == "kda"
    if per_channel:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention as stock_fn
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as stock_fn
    fast, naive = (chunk_kda, naive_kda) if per_channel else (chunk_gated_delta_rule, naive_gated_delta_rule)
    tensors = _delta_inputs(per_channel, seed=1)
    ref, _ = naive(*tensors, cu_seqlens=_cu(LENGTHS), use_qk_l2norm_in_kernel=True)
    low = [t.to(dtype) for t in tensors]
    packed, _ = fast(*low, cu_seqlens=_cu(LENGTHS), use_qk_l2norm_in_kernel=True, backend="torch")
    stock = _per_sample(lambda *t: stock_fn(*t, use_qk_l2norm_in_kernel=True)[0], LENGTHS, 1, *low)
    _check(packed, stock, ref)


def test_conv(dtype):
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn as stock_fn

    gen = _gen(2)
    T, Cch, K = sum(LENGTHS), 256, 4
    x = torch.randn(1, T, Cch, generator=gen, dtype=F64)
    w, b = torch.randn(Cch, K, generator=gen, dtype=F64) * 0.5, torch.randn(Cch, generator=gen, dtype=F64)
    ref = _per_sample(lambda x_: naive_causal_conv1d(x_, w, b, activation="silu"), LENGTHS, 1, x)
    packed = causal_conv1d(x.to(dtype), w.to(dtype), b.to(dtype), activation="silu", seq_idx=_seq(LENGTHS), backend="torch")
    stock = _per_sample(lambda x_: stock_fn(x_.transpose(1, 2), w.to(dtype), b.to(dtype), activation="silu").transpose(1, 2),
                        LENGTHS, 1, x.to(dtype))
    _check(packed, stock, ref)


def test_selective_scan(dtype):
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan as stock_fn

    gen = _gen(3)
    D, N, T = 64, 16, sum(LENGTHS)
    u, delta = torch.randn(1, D, T, generator=gen, dtype=F64), torch.randn(1, D, T, generator=gen, dtype=F64) - 2.0
    A = -torch.arange(1, N + 1, dtype=F64).expand(D, N).contiguous()  # Mamba's S4D-real initialisation
    B, C = torch.randn(1, N, T, generator=gen, dtype=F64), torch.randn(1, N, T, generator=gen, dtype=F64)
    opts = dict(D=torch.ones(D, dtype=F64), delta_bias=torch.rand(D, generator=gen, dtype=F64), delta_softplus=True)
    ref = naive_selective_scan(u, delta, A, B, C, seq_idx=_seq(LENGTHS), **opts)
    f = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    packed = selective_scan(u.to(dtype), delta.to(dtype), A.to(dtype), B.to(dtype), C.to(dtype), seq_idx=_seq(LENGTHS), **f)
    stock = _per_sample(lambda u_, d_, B_, C_: stock_fn(u_, d_, A.to(dtype), B_, C_, **f), LENGTHS, 2,
                        u.to(dtype), delta.to(dtype), B.to(dtype), C.to(dtype))
    _check(packed, stock, ref)


def test_linear_attention(dtype):
    gen = _gen(4)
    H, K, T = 4, 64, sum(LENGTHS)
    q, k, v = (torch.randn(1, T, H, K, generator=gen, dtype=F64) for _ in range(3))
    g = -F.softplus(torch.randn(1, T, H, generator=gen, dtype=F64))
    ref, _ = naive_linear_attention(q, k, v, g, cu_seqlens=_cu(LENGTHS))
    low = [t.to(dtype) for t in (q, k, v, g)]
    packed, _ = chunk_linear_attention(*low, cu_seqlens=_cu(LENGTHS))
    stock = _per_sample(lambda *t: naive_linear_attention(*t)[0], LENGTHS, 1, *low)
    _check(packed, stock, ref)


def test_lru(dtype):
    gen = _gen(5)
    T, D = sum(LENGTHS), 256
    a = torch.sigmoid(torch.randn(1, T, D, generator=gen, dtype=F64) + 4.0)  # RG-LRU: a close to 1
    b = torch.randn(1, T, D, generator=gen, dtype=F64)
    ref, _ = naive_linear_recurrence(a, b, cu_seqlens=_cu(LENGTHS))
    packed, _ = linear_recurrence(a.to(dtype), b.to(dtype), cu_seqlens=_cu(LENGTHS))
    stock = _per_sample(lambda a_, b_: naive_linear_recurrence(a_, b_)[0], LENGTHS, 1, a.to(dtype), b.to(dtype))
    _check(packed, stock, ref)
