"""Packed causal depthwise conv1d: packed == per-sample reference (values and every gradient),
gradient isolation between samples, the causal_conv1d routing contract (fake kernel), the shared
boundary helpers, and ValueError on bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops import _seq
from packfree_plugin.ops.conv import causal_conv1d, naive_causal_conv1d
from packfree_plugin.ops.conv import fast as conv_masked
from tests.ops.harness import (
    assert_close, assert_isolated, assert_same_grads, cu_seqlens_of, draw_rows, per_sample, seq_idx_of,
)

F64 = torch.float64


def _inputs(T: int, B: int, C: int, K: int, bias: bool, seed: int = 0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(C, K, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(C, generator=gen, dtype=dtype).requires_grad_() if bias else None
    return x, w, b


@pytest.mark.parametrize("path", ["boundary rows", "dense masks", "spread"])  # every path on every run
@given(data=st.data())
def test_packed_matches_per_sample(path, data):
    K = data.draw(st.integers(1, 4), label="K")
    rows = draw_rows(data, chunk=max(K, 2))
    seq_idx = seq_idx_of(rows)
    B, T = seq_idx.shape
    act = data.draw(st.sampled_from([None, "silu"]), label="activation")
    x, w, b = _inputs(T, B, 3, K, bias=data.draw(st.booleans(), label="bias"))
    kw = {"seq_idx": seq_idx}
    if B == 1 and data.draw(st.booleans(), label="cu_seqlens"):
        kw = {"cu_seqlens": cu_seqlens_of(rows[0], data.draw(st.sampled_from([torch.int32, torch.int64])))}
    tiny_tiles = data.draw(st.booleans(), label="tiny_tiles")  # many tiles of 4K tokens
    dense = path == "dense masks"  # the no-host-sync path of non-CPU devices
    spread = path == "spread"  # small rows: K - 1 zero tokens before every sample
    saved = conv_masked._TILE_BYTES, conv_masked._SPARSE_ON_CPU, conv_masked._SPREAD_UP_TO_BYTES
    conv_masked._TILE_BYTES = 1 if tiny_tiles else saved[0]
    conv_masked._SPARSE_ON_CPU = not dense
    conv_masked._SPREAD_UP_TO_BYTES = saved[2] if spread else 0
    try:
        out = causal_conv1d(x, w, b, activation=act, backend="torch", **kw)
        ref = per_sample(lambda xs: naive_causal_conv1d(xs, w, b, activation=act), rows, [(x, 1)], 1)
        inputs = {"x": x, "weight": w} | ({"bias": b} if b is not None else {})
        assert_same_grads(out, ref, inputs)
        # the naive reference's own seq_idx handling agrees with the per-sample split too
        assert_close(naive_causal_conv1d(x, w, b, seq_idx=seq_idx, activation=act), ref, "naive")
        r = data.draw(st.integers(0, B - 1), label="iso_row")
        s = data.draw(st.integers(0, len(rows[r]) - 1), label="iso_sample")
        assert_isolated(out, 1, seq_idx, {"x": (x, 1)}, r, s)
    finally:
        conv_masked._TILE_BYTES, conv_masked._SPARSE_ON_CPU, conv_masked._SPREAD_UP_TO_BYTES = saved


def test_no_boundaries_is_plain_causal_conv():
    x, w, b = _inputs(37, 2, 5, 4, bias=True)
    out = causal_conv1d(x, w, b, activation="silu")
    ref = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.transpose(1, 2), w[:, None], b, padding=3, groups=5)[..., :37]
    ).transpose(1, 2)
    assert_close(out, ref)


def test_boundary_helpers_are_device_side_and_exact():
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int64)  # includes an empty sample
    seq = _seq.cu_seqlens_to_seq_idx(cu, 9)
    assert seq.dtype == torch.int32 and seq.tolist() == [[0, 0, 0, 2, 3, 3, 3, 3, 3]]
    assert _seq.first_token_mask(seq).tolist() == [[True, False, False, True, True, False, False, False, False]]
    assert _seq.same_sample_as_previous(seq, 2).tolist() == [[True, False, False, False, True, True, True]]


# --------------------------------------------------------------------------- kernel routing (fake)
def _fake_causal_conv1d(calls: list, expected_seq: torch.Tensor | None):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        Bsz, C, T = x.shape
        assert x.stride(1) == 1 and x.stride(2) == C, "seq_idx needs the channel-last [B, C, T] view"
        assert tuple(weight.shape) == (C, weight.shape[1]) and weight.is_contiguous()
        assert bias is None or (tuple(bias.shape) == (C,) and bias.is_contiguous())
        assert initial_states is None and not return_final_states and final_states_out is None
        assert activation in (None, "silu", "swish")
        if expected_seq is None:
            assert seq_idx is None
        else:
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
            assert tuple(seq_idx.shape) == (Bsz, T) and seq_idx.device == x.device
            assert torch.equal(seq_idx, expected_seq)
        calls.append(dict(activation=activation))
        out = naive_causal_conv1d(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation=activation)
        return out.transpose(1, 2)  # channel-last, like the kernel's empty_like(x)

    return causal_conv1d_fn


@pytest.mark.parametrize("via", ["seq_idx", "cu_seqlens", "none"])
def test_routes_to_causal_conv1d_with_boundaries(route_to, via):
    lengths = [5, 1, 9, 3]
    seq = seq_idx_of([lengths])
    calls: list = []
    route_to({"causal_conv1d": {"causal_conv1d_fn": _fake_causal_conv1d(calls, None if via == "none" else seq)}})
    x, w, b = _inputs(18, 1, 16, 4, bias=True, dtype=torch.float32)
    kw = {"seq_idx": seq} if via == "seq_idx" else {"cu_seqlens": cu_seqlens_of(lengths)} if via == "cu_seqlens" else {}
    out = causal_conv1d(x, w, b, activation="silu", **kw)
    assert calls == [dict(activation="silu")]
    assert out.shape == x.shape
    ref = causal_conv1d(x, w, b, activation="silu", backend="torch", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["K5", "C12", "float64"])
def test_shapes_the_kernel_rejects_take_the_torch_path(route_to, shape):
    calls: list = []
    route_to({"causal_conv1d": {"causal_conv1d_fn": _fake_causal_conv1d(calls, None)}})
    K, C, dtype = {"K5": (5, 16, torch.float32), "C12": (4, 12, torch.float32), "float64": (4, 16, F64)}[shape]
    x, w, b = _inputs(10, 1, C, K, bias=False, dtype=dtype)
    causal_conv1d(x, w, b)
    assert calls == []


def test_cpu_tensors_never_import_the_kernel(monkeypatch):
    from packfree_plugin.ops import backends

    def boom(*a, **k):
        raise AssertionError("kernel lookup on CPU")

    monkeypatch.setattr(backends, "load_kernel", boom)
    x, w, b = _inputs(6, 1, 8, 4, bias=False, dtype=torch.float32)
    causal_conv1d(x, w, b, seq_idx=torch.zeros(1, 6, dtype=torch.int32))


def test_forced_kernel_without_package_raises(monkeypatch):
    import sys

    from packfree_plugin.ops import backends

    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # import fails
    backends.load_kernel.cache_clear()
    try:
        x, w, b = _inputs(6, 1, 8, 4, bias=False, dtype=torch.float32)
        with pytest.raises(ValueError, match="causal_conv1d"):
            causal_conv1d(x, w, b, backend="kernel")
    finally:
        backends.load_kernel.cache_clear()


# ------------------------------------------------------------------------------------ bad inputs
def _bad_cases():
    x, w, b = _inputs(6, 1, 4, 3, bias=True)
    i32 = torch.int32
    good_seq = torch.tensor([[0, 0, 1, 1, 1, 2]], dtype=i32)
    x2 = x.detach().expand(2, 6, 4)
    return {
        "x-2d": dict(x=x[0], w=w, b=b),
        "weight-wrong-C": dict(x=x, w=w[:3], b=b),
        "bias-wrong-shape": dict(x=x, w=w, b=b[:2]),
        "weight-dtype": dict(x=x, w=w.float(), b=b),
        "activation": dict(x=x, w=w, b=b, activation="relu"),
        "seq_idx-int64": dict(x=x, w=w, b=b, seq_idx=good_seq.long()),
        "seq_idx-shape": dict(x=x, w=w, b=b, seq_idx=good_seq[:, :5]),
        "seq_idx-decreasing": dict(x=x, w=w, b=b, seq_idx=torch.tensor([[0, 1, 1, 0, 2, 2]], dtype=i32)),
        "seq_idx-negative": dict(x=x, w=w, b=b, seq_idx=torch.tensor([[-1, 0, 0, 0, 0, 0]], dtype=i32)),
        "cu-float": dict(x=x, w=w, b=b, cu_seqlens=torch.tensor([0.0, 6.0])),
        "cu-2d": dict(x=x, w=w, b=b, cu_seqlens=torch.tensor([[0, 6]], dtype=i32)),
        "cu-not-ending-at-T": dict(x=x, w=w, b=b, cu_seqlens=torch.tensor([0, 2, 5], dtype=i32)),
        "cu-not-starting-at-0": dict(x=x, w=w, b=b, cu_seqlens=torch.tensor([1, 2, 6], dtype=i32)),
        "cu-decreasing": dict(x=x, w=w, b=b, cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=i32)),
        "cu-with-B2": dict(x=x2, w=w, b=b, cu_seqlens=torch.tensor([0, 6], dtype=i32)),
        "cu-and-seq-disagree": dict(x=x, w=w, b=b, seq_idx=good_seq, cu_seqlens=torch.tensor([0, 3, 6], dtype=i32)),
        "backend": dict(x=x, w=w, b=b, backend="triton"),
    }


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_inputs_raise_value_error(case):
    kw = dict(_bad_cases()[case])
    x, w, b = kw.pop("x"), kw.pop("w"), kw.pop("b")
    with pytest.raises(ValueError):
        causal_conv1d(x, w, b, **kw)


def test_agreeing_seq_idx_and_cu_seqlens_are_accepted():
    x, w, b = _inputs(6, 1, 4, 3, bias=True)
    seq = torch.tensor([[0, 0, 1, 1, 1, 2]], dtype=torch.int32)
    out = causal_conv1d(x, w, b, seq_idx=seq, cu_seqlens=torch.tensor([0, 2, 5, 6]))
    assert_close(out, causal_conv1d(x, w, b, seq_idx=seq))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_keep_their_dtype(dtype):
    x, w, b = (t.detach() for t in _inputs(21, 1, 8, 4, bias=True))
    seq = seq_idx_of([[5, 1, 15]])
    want = causal_conv1d(x, w, b, activation="silu", seq_idx=seq)
    got = causal_conv1d(x.to(dtype), w.to(dtype), b.to(dtype), activation="silu", seq_idx=seq)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.05)
