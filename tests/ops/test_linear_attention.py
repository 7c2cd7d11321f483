"""Decay-gated linear attention: packed chunked path == per-sample naive reference, gradient isolation,
MiniMax lightning-attention equivalence, and ValueError on bad inputs."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops.linear_attention import chunk_linear_attention, naive_linear_attention
from tests.ops.harness import F64, assert_close, cu_seqlens_of, sample_lengths, grads









def make_inputs(lengths, *, gate, gamma, with_h0, H=2, K=4, V=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)

    def leaf(*shape, lo=None, hi=None):
        x = torch.randn(*shape, generator=gen, dtype=F64) if lo is None else lo + (hi - lo) * torch.rand(
            *shape, generator=gen, dtype=F64)
        return x.requires_grad_()

    inp = {"q": leaf(1, T, H, K), "k": leaf(1, T, H, K), "v": leaf(1, T, H, V),
           "g": leaf(1, T, H, lo=-1.5, hi=0.0) if gate else None}
    opts = {"g_gamma": leaf(H, lo=-0.5, hi=0.0) if gamma else None,
            "initial_state": leaf(N, H, K, V) if with_h0 else None}
    return inp, opts


def leaves_of(*dicts):
    merged = {n: t for d in dicts for n, t in d.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    return list(merged), list(merged.values())




@given(lengths=sample_lengths(64), chunk=st.sampled_from([64, 8, 16]), seed=st.integers(0, 2**16),
       gate=st.booleans(), gamma=st.booleans(), with_h0=st.booleans(), scale=st.sampled_from([None, 1.0]))
def test_packed_matches_per_sample_naive(lengths, chunk, seed, gate, gamma, with_h0, scale):
    inp, opts = make_inputs(lengths, gate=gate, gamma=gamma, with_h0=with_h0, seed=seed)
    cu = cu_seqlens_of(lengths)
    o, f = chunk_linear_attention(*inp.values(), cu_seqlens=cu, chunk_size=chunk, scale=scale,
                                  output_final_state=True, **opts)
    ref_o, ref_f = [], []
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        one = [None if t is None else t[:, sl] for t in inp.values()]
        h0 = None if opts["initial_state"] is None else opts["initial_state"][i : i + 1]
        oi, fi = naive_linear_attention(*one, g_gamma=opts["g_gamma"], scale=scale, initial_state=h0,
                                        output_final_state=True)
        ref_o.append(oi)
        ref_f.append(fi)
    ref_o, ref_f = torch.cat(ref_o, 1), torch.cat(ref_f)
    assert_close(o, ref_o)
    assert_close(f, ref_f)
    names, leaves = leaves_of(inp, opts)
    for name, got, want in zip(names, grads(o, f, leaves), grads(ref_o, ref_f, leaves)):
        assert_close(got, want, what=f"grad {name}")


@given(lengths=sample_lengths(8).filter(lambda ls: len(ls) > 1), seed=st.integers(0, 2**16), data=st.data())
def test_gradient_isolation(lengths, seed, data):
    j = data.draw(st.integers(0, len(lengths) - 1), label="sample")
    inp, opts = make_inputs(lengths, gate=True, gamma=True, with_h0=True, seed=seed)
    cu = cu_seqlens_of(lengths)
    o, f = chunk_linear_attention(*inp.values(), cu_seqlens=cu, chunk_size=8, output_final_state=True, **opts)
    lo, hi = int(cu[j]), int(cu[j + 1])
    names, leaves = leaves_of(inp, opts)
    for name, grad in zip(names, torch.autograd.grad((o[:, lo:hi] * 1.3).sum() + f[j].sum(), leaves, materialize_grads=True)):
        if name == "g_gamma":
            continue  # shared by all samples by definition
        others = torch.cat([grad[:j], grad[j + 1 :]]) if name == "initial_state" else torch.cat(
            [grad[:, :lo], grad[:, hi:]], dim=1)
        assert torch.count_nonzero(others) == 0, f"{name}: sample {j} leaks gradient into other samples"


def test_matches_minimax_lightning_attention_block_form():
    """MiniMax: per-head constant decay exp(-slope), scale 1, blockwise as in transformers' MiniMaxLightningAttention."""
    torch.manual_seed(0)
    H, D, T, block = 2, 4, 37, 8
    q, k, v = (torch.randn(1, T, H, D, dtype=F64) for _ in range(3))
    slope = torch.tensor([0.3, 0.05], dtype=F64)
    # Reference written from the recurrence the MiniMax module implements: kv = exp(-s) kv + k^T v; o = q kv.
    kv = torch.zeros(H, D, D, dtype=F64)
    ref = []
    for t in range(T):
        kv = torch.exp(-slope)[:, None, None] * kv + torch.einsum("hk,hv->hkv", k[0, t], v[0, t])
        ref.append(torch.einsum("hk,hkv->hv", q[0, t], kv))
    o, _ = chunk_linear_attention(q, k, v, g_gamma=-slope, scale=1.0, chunk_size=block)
    assert_close(o[0], torch.stack(ref))


def test_unsplit_batch_rows_and_empty_samples():
    inp, opts = make_inputs([20, 20], gate=True, gamma=True, with_h0=True)
    x = [t.detach().reshape(2, 20, *t.shape[2:]) for t in inp.values()]
    kw = dict(g_gamma=opts["g_gamma"].detach(), initial_state=opts["initial_state"].detach(), output_final_state=True)
    o, f = chunk_linear_attention(*x, chunk_size=8, **kw)
    ro, rf = naive_linear_attention(*x, **kw)
    assert_close(o, ro)
    assert_close(f, rf)
    lengths = [0, 6, 0]
    inp, opts = make_inputs(lengths, gate=True, gamma=True, with_h0=True)
    o, f = chunk_linear_attention(*inp.values(), cu_seqlens=cu_seqlens_of(lengths), output_final_state=True, **opts)
    ro, rf = naive_linear_attention(*inp.values(), cu_seqlens=cu_seqlens_of(lengths), output_final_state=True, **opts)
    assert_close(o, ro)
    assert_close(f, rf)


BAD = {
    "cu-not-at-0": (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "non-decreasing"),
    "cu-not-at-T": (dict(cu_seqlens=torch.tensor([0, 3, 6])), "end at T=7"),
    "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "int32 or int64"),
    "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 3, 7]])), r"shape \[N\+1\]"),
    "h0-wrong-N": (dict(cu_seqlens=torch.tensor([0, 3, 7]), initial_state=torch.zeros(3, 2, 4, 3, dtype=F64)),
                   "N = number of samples"),
    "g-shape": (dict(g=torch.zeros(1, 7, 3, dtype=F64)), "g must have shape"),
    "g_gamma-shape": (dict(g_gamma=torch.zeros(2, 1, dtype=F64)), "g_gamma must have shape"),
    "chunk": (dict(chunk_size=0), "chunk_size"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    inp, _ = make_inputs([3, 4], gate=False, gamma=False, with_h0=False)
    q, k, v = (t.detach() for t in list(inp.values())[:3])
    kw, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        chunk_linear_attention(q, k, v, **kw)


def test_bad_tensors_raise():
    inp, _ = make_inputs([3, 4], gate=False, gamma=False, with_h0=False)
    q, k, v = (t.detach() for t in list(inp.values())[:3])
    cu = cu_seqlens_of([3, 4])
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_linear_attention(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="k must have the shape of q"):
        chunk_linear_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match="v must have shape"):
        chunk_linear_attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="share a dtype"):
        chunk_linear_attention(q, k, v.float())
    with pytest.raises(ValueError, match="floating-point"):
        chunk_linear_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="is on"):
        chunk_linear_attention(q, k, v, cu_seqlens=cu.to("meta"))
