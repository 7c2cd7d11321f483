"""Packed Mamba1 selective scan: packed == per-sample reference (values and every gradient),
gradient isolation, the blocked linear scan itself, CUDA routing staying on torch, bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops.selective_scan import linear_scan, selective_scan, naive_selective_scan
from packfree_plugin.ops.selective_scan import fast as ss_scan
from tests.ops.harness import (
    assert_close, assert_isolated, assert_same_grads, cu_seqlens_of, draw_rows, per_sample, seq_idx_of,
)

F64 = torch.float64


def _inputs(B, T, Dm=4, N=3, *, G=None, D=True, z=True, delta_bias=True, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_()

    bc = (B, N, T) if G is None else (B, G, N, T)
    return dict(
        u=leaf(B, Dm, T), delta=leaf(B, Dm, T, scale=0.5),
        A=(-torch.rand(Dm, N, generator=gen, dtype=dtype) * 2 - 0.1).requires_grad_(),
        B=leaf(*bc), C=leaf(*bc), D=leaf(Dm) if D else None, z=leaf(B, Dm, T) if z else None,
        delta_bias=leaf(Dm, scale=0.5) if delta_bias else None,
    )


TIME_DIM = {"u": 2, "delta": 2, "B": -1, "C": -1, "z": 2}


@given(data=st.data())
def test_packed_matches_per_sample(data):
    small_blocks = data.draw(st.booleans(), label="small_blocks")  # blocks of 16 tokens
    rows = draw_rows(data, 16 if small_blocks else 5)
    seq_idx = seq_idx_of(rows)
    Bsz, T = seq_idx.shape
    G = data.draw(st.sampled_from([None, 1, 2]), label="G")
    t = _inputs(Bsz, T, G=G, D=data.draw(st.booleans(), label="D"), z=data.draw(st.booleans(), label="z"),
                delta_bias=data.draw(st.booleans(), label="delta_bias"))
    softplus = data.draw(st.booleans(), label="softplus")
    bounds = {"seq_idx": seq_idx}
    if Bsz == 1 and data.draw(st.booleans(), label="cu_seqlens"):
        bounds = {"cu_seqlens": cu_seqlens_of(rows[0])}
    dense = data.draw(st.booleans(), label="dense_resets")  # the no-host-sync path of other devices
    saved = ss_scan._BLOCK_BYTES, ss_scan._SPARSE_ON_CPU
    ss_scan._BLOCK_BYTES = 1 if small_blocks else saved[0]
    ss_scan._SPARSE_ON_CPU = not dense
    try:
        out = selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"],
                             delta_bias=t["delta_bias"], delta_softplus=softplus, **bounds)
    finally:
        ss_scan._BLOCK_BYTES, ss_scan._SPARSE_ON_CPU = saved
    shared = dict(D=t["D"], delta_bias=t["delta_bias"], delta_softplus=softplus)
    bc_dim = t["B"].dim() - 1
    ref = per_sample(
        lambda u, delta, B, C, z: naive_selective_scan(u, delta, t["A"], B, C, z=z, **shared),
        rows, [(t["u"], 2), (t["delta"], 2), (t["B"], bc_dim), (t["C"], bc_dim), (t["z"], 2)], 2)
    assert_same_grads(out, ref, {k: v for k, v in t.items() if v is not None})
    r = data.draw(st.integers(0, Bsz - 1), label="iso_row")
    s = data.draw(st.integers(0, len(rows[r]) - 1), label="iso_sample")
    assert_isolated(out, 2, seq_idx,
                        {k: (t[k], d % t[k].dim()) for k, d in TIME_DIM.items() if t[k] is not None}, r, s)


@pytest.mark.parametrize("T", [1, 2, 7, 16, 40])
def test_linear_scan_matches_a_python_loop_and_gradchecks(T):
    gen = torch.Generator().manual_seed(T)
    a = torch.rand(2, T, 3, generator=gen, dtype=F64).requires_grad_()
    b = torch.randn(2, T, 3, generator=gen, dtype=F64).requires_grad_()
    h0 = torch.randn(2, 3, generator=gen, dtype=F64).requires_grad_()
    h, want = h0, []
    for i in range(T):
        h = a[:, i] * h + b[:, i]
        want.append(h)
    assert_close(linear_scan(a, b, h0), torch.stack(want, 1))
    assert torch.autograd.gradcheck(linear_scan, (a, b, h0))
    assert torch.autograd.gradcheck(linear_scan, (a, b))


def test_cuda_route_is_the_torch_path(route_to):
    """mamba_ssm has no varlen selective scan: 'on CUDA' must never call it."""

    def selective_scan_fn(*args, **kwargs):
        raise AssertionError("mamba_ssm.selective_scan_fn has no seq_idx; it must not be used")

    route_to({"mamba_ssm.ops.selective_scan_interface": {"selective_scan_fn": selective_scan_fn}})
    t = _inputs(1, 9)
    selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], seq_idx=torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32))


# ------------------------------------------------------------------------------------ bad inputs
def _bad_cases():
    t = {k: (v.detach() if v is not None else None) for k, v in _inputs(1, 6).items()}
    i32 = torch.int32

    def with_(**kw):
        return {**t, **kw}

    return {
        "u-2d": with_(u=t["u"][0]),
        "delta-shape": with_(delta=t["delta"][..., :5]),
        "A-rows": with_(A=t["A"][:3]),
        "A-complex": with_(A=t["A"].to(torch.complex128)),
        "B-shape": with_(B=t["B"][:, :2]),
        "B-groups-not-dividing-D": with_(B=torch.zeros(1, 3, 3, 6, dtype=F64), C=torch.zeros(1, 3, 3, 6, dtype=F64)),
        "B-C-layouts-differ": with_(C=t["C"][:, None]),
        "D-shape": with_(D=torch.zeros(3, dtype=F64)),
        "z-shape": with_(z=t["z"][..., :2]),
        "delta_bias-shape": with_(delta_bias=torch.zeros(5, dtype=F64)),
        "seq_idx-int64": with_(seq_idx=torch.zeros(1, 6, dtype=torch.int64)),
        "seq_idx-decreasing": with_(seq_idx=torch.tensor([[1, 1, 0, 0, 0, 0]], dtype=i32)),
        "seq_idx-negative": with_(seq_idx=torch.tensor([[-2, -1, 0, 0, 0, 0]], dtype=i32)),
        "cu-not-ending-at-T": with_(cu_seqlens=torch.tensor([0, 3, 5], dtype=i32)),
        "cu-B2": with_(u=t["u"].expand(2, -1, -1), delta=t["delta"].expand(2, -1, -1),
                       B=t["B"].expand(2, -1, -1), C=t["C"].expand(2, -1, -1), z=None,
                       cu_seqlens=torch.tensor([0, 6], dtype=i32)),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_value_error(case):
    kw = dict(_bad_cases()[case])
    args = [kw.pop(k) for k in ("u", "delta", "A", "B", "C")]
    with pytest.raises(ValueError):
        selective_scan(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_keep_their_dtype(dtype):
    t = _inputs(1, 21)
    seq = seq_idx_of([[5, 1, 15]])
    args = [t[k].detach() for k in ("u", "delta", "A", "B", "C")]
    want = selective_scan(*args, seq_idx=seq, delta_softplus=True)
    got = selective_scan(*(a.to(dtype) for a in args), seq_idx=seq, delta_softplus=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.05)
