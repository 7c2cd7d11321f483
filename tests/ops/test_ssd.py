"""Packed Mamba2 SSD chunk scan: packed == per-sample reference (values and every gradient),
gradient isolation, the mamba_ssm routing contract (fake mamba_chunk_scan_combined), bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops.ssd import fast as ssd_torch
from packfree_plugin.ops.ssd import ssd_chunk_scan, naive_ssd
from tests.ops.harness import (
    assert_close, assert_isolated, assert_same_grads, cu_seqlens_of, draw_rows, per_sample, seq_idx_of,
)

F64 = torch.float64
KERNEL = "mamba_ssm.ops.triton.ssd_combined"


def _inputs(B, T, H=4, P=2, G=2, N=3, *, D="H", z=True, dt_bias=True, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale + shift).requires_grad_()

    t = dict(
        x=leaf(B, T, H, P), dt=leaf(B, T, H, scale=0.5), A=(-torch.rand(H, generator=gen, dtype=dtype) - 0.1).requires_grad_(),
        B=leaf(B, T, G, N), C=leaf(B, T, G, N),
        D={"none": None, "H": leaf(H), "HP": leaf(H, P)}[D],
        z=leaf(B, T, H, P) if z else None, dt_bias=leaf(H, scale=0.5) if dt_bias else None,
    )
    return t


PER_TOKEN = {"x": 1, "dt": 1, "B": 1, "C": 1, "z": 1}


@given(data=st.data())
def test_packed_matches_per_sample(data):
    chunk = data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="chunk")
    rows = draw_rows(data, chunk)
    seq_idx = seq_idx_of(rows)
    Bsz, T = seq_idx.shape
    G = data.draw(st.sampled_from([1, 2]), label="G")
    t = _inputs(Bsz, T, G=G, D=data.draw(st.sampled_from(["none", "H", "HP"]), label="D"),
                z=data.draw(st.booleans(), label="z"), dt_bias=data.draw(st.booleans(), label="dt_bias"))
    opts = dict(dt_softplus=data.draw(st.booleans(), label="softplus"),
                dt_limit=data.draw(st.sampled_from([(0.0, math.inf), (0.05, 2.0)]), label="dt_limit"))
    bounds = {"seq_idx": seq_idx}
    if Bsz == 1 and data.draw(st.booleans(), label="cu_seqlens"):
        bounds = {"cu_seqlens": cu_seqlens_of(rows[0])}
    shared = dict(D=t["D"], dt_bias=t["dt_bias"], **opts)
    per_group = data.draw(st.sampled_from([1, 2, 1 << 16]), label="chunks_per_group")
    saved = ssd_torch._GROUP_BYTES
    ssd_torch._GROUP_BYTES = per_group * Bsz * 4 * chunk * chunk * 8  # 1 chunk per group, 2, or all at once
    try:
        out = ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=chunk, z=t["z"],
                             backend="torch", **shared, **bounds)
    finally:
        ssd_torch._GROUP_BYTES = saved
    ref = per_sample(
        lambda x, dt, B, C, z: naive_ssd(x, dt, t["A"], B, C, z=z, **shared),
        rows, [(t["x"], 1), (t["dt"], 1), (t["B"], 1), (t["C"], 1), (t["z"], 1)], 1)
    assert_same_grads(out, ref, {k: v for k, v in t.items() if v is not None})
    r = data.draw(st.integers(0, Bsz - 1), label="iso_row")
    s = data.draw(st.integers(0, len(rows[r]) - 1), label="iso_sample")
    assert_isolated(out, 1, seq_idx, {k: (t[k], d) for k, d in PER_TOKEN.items() if t[k] is not None}, r, s)


def test_result_does_not_depend_on_chunk_size():
    rows = [[7, 1, 12, 5]]
    t = _inputs(1, 25)
    outs = [ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=c, D=t["D"], z=t["z"],
                           dt_bias=t["dt_bias"], dt_softplus=True, seq_idx=seq_idx_of(rows))
            for c in (1, 4, 5, 32)]
    for o in outs[1:]:
        assert_close(o, outs[0])


# --------------------------------------------------------------------------- kernel routing (fake)
def _fake_ssd(calls: list, expected_seq: torch.Tensor | None):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None,
                                  dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        Bsz, T, H, P = x.shape
        assert tuple(dt.shape) == (Bsz, T, H) and tuple(A.shape) == (H,)
        assert B.shape[:2] == (Bsz, T) and C.shape == B.shape
        assert initial_states is None and not return_final_states and not return_varlen_states
        if expected_seq is None:
            assert seq_idx is None
        else:
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
            assert tuple(seq_idx.shape) == (Bsz, T) and seq_idx.device == x.device
            assert torch.equal(seq_idx, expected_seq)
        calls.append(dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit)))
        return naive_ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                         dt_limit=dt_limit, seq_idx=seq_idx)

    return mamba_chunk_scan_combined


@pytest.mark.parametrize("via", ["seq_idx", "cu_seqlens", "none"])
def test_routes_to_mamba_chunk_scan_combined(route_to, via):
    lengths = [4, 1, 9, 2]
    seq = seq_idx_of([lengths])
    calls: list = []
    route_to({KERNEL: {"mamba_chunk_scan_combined": _fake_ssd(calls, None if via == "none" else seq)}})
    t = _inputs(1, 16, dtype=torch.float32)
    kw = {"seq_idx": seq} if via == "seq_idx" else {"cu_seqlens": cu_seqlens_of(lengths, torch.int64)} if via == "cu_seqlens" else {}
    common = dict(chunk_size=8, D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True, dt_limit=(0.0, 5.0))
    out = ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], **common, **kw)
    assert calls == [dict(chunk_size=8, dt_softplus=True, dt_limit=(0.0, 5.0))]
    ref = ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], backend="torch", **common, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_float64_stays_on_the_torch_path(route_to):
    calls: list = []
    route_to({KERNEL: {"mamba_chunk_scan_combined": _fake_ssd(calls, None)}})
    t = _inputs(1, 6)
    ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=4)
    assert calls == []


# ------------------------------------------------------------------------------------ bad inputs
def _bad_cases():
    t = {k: (v.detach() if v is not None else None) for k, v in _inputs(1, 6).items()}
    i32 = torch.int32

    def with_(**kw):
        return {**t, **kw}

    return {
        "x-3d": with_(x=t["x"][0]),
        "dt-shape": with_(dt=t["dt"][:, :5]),
        "A-shape": with_(A=t["A"][:3]),
        "B-groups-not-dividing-H": with_(B=torch.zeros(1, 6, 3, 3, dtype=F64), C=torch.zeros(1, 6, 3, 3, dtype=F64)),
        "C-shape": with_(C=t["C"][:, :, :1]),
        "D-shape": with_(D=torch.zeros(3, dtype=F64)),
        "z-shape": with_(z=t["z"][..., :1]),
        "dt_bias-shape": with_(dt_bias=torch.zeros(2, dtype=F64)),
        "x-int": with_(x=t["x"].long()),
        "chunk_size-0": with_(chunk_size=0),
        "chunk_size-float": with_(chunk_size=4.0),
        "dt_limit-reversed": with_(dt_limit=(1.0, 0.5)),
        "seq_idx-int64": with_(seq_idx=torch.zeros(1, 6, dtype=torch.int64)),
        "seq_idx-decreasing": with_(seq_idx=torch.tensor([[0, 0, 2, 1, 1, 1]], dtype=i32)),
        "seq_idx-shape": with_(seq_idx=torch.zeros(2, 6, dtype=i32)),
        "cu-not-ending-at-T": with_(cu_seqlens=torch.tensor([0, 3, 7], dtype=i32)),
        "cu-decreasing": with_(cu_seqlens=torch.tensor([0, 4, 3, 6], dtype=i32)),
        "cu-float": with_(cu_seqlens=torch.tensor([0.0, 6.0])),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_value_error(case):
    kw = dict(_bad_cases()[case])
    args = [kw.pop(k) for k in ("x", "dt", "A", "B", "C")]
    kw.setdefault("chunk_size", 4)
    with pytest.raises(ValueError):
        ssd_chunk_scan(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_keep_their_dtype(dtype):
    t = _inputs(1, 21)
    seq = seq_idx_of([[5, 1, 15]])
    args = [t[k].detach() for k in ("x", "dt", "A", "B", "C")]
    want = ssd_chunk_scan(*args, chunk_size=8, seq_idx=seq, dt_softplus=True)
    got = ssd_chunk_scan(*(a.to(dtype) for a in args), chunk_size=8, seq_idx=seq, dt_softplus=True)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.05)
