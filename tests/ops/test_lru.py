"""Diagonal linear recurrence: packed blocked scan == per-sample naive loop, gradient isolation, RG-LRU
equivalence with recurrent_gemma's reset-by-position_ids scan, and ValueError on bad inputs."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops.lru import linear_recurrence, naive_linear_recurrence
from tests.ops.harness import F64, assert_close, cu_seqlens_of, sample_lengths









def make_inputs(lengths, *, with_h0, D=5, seed=0, signed=True):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    a = torch.rand(1, T, D, generator=gen, dtype=F64) * (2 if signed else 1) - (1 if signed else 0)
    a[0, :: 7] = 0.0  # exact zeros inside samples must be fine too
    b = torch.randn(1, T, D, generator=gen, dtype=F64)
    h0 = torch.randn(N, D, generator=gen, dtype=F64).requires_grad_() if with_h0 else None
    return a.requires_grad_(), b.requires_grad_(), h0


@given(lengths=sample_lengths(8, allow_empty=True, long_chunks=(4, 6)), chunk=st.sampled_from([64, 8, 2, 4]), seed=st.integers(0, 2**16),
       with_h0=st.booleans())
def test_packed_matches_per_sample_naive(lengths, chunk, seed, with_h0):
    a, b, h0 = make_inputs(lengths, with_h0=with_h0, seed=seed)
    cu = cu_seqlens_of(lengths)
    h, f = linear_recurrence(a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=chunk)
    ref_h, ref_f = [], []
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        hi, fi = naive_linear_recurrence(a[:, sl], b[:, sl], initial_state=None if h0 is None else h0[i : i + 1],
                                         output_final_state=True)
        ref_h.append(hi)
        ref_f.append(fi)
    ref_h, ref_f = torch.cat(ref_h, 1), torch.cat(ref_f)
    assert_close(h, ref_h)
    assert_close(f, ref_f)
    leaves = [t for t in (a, b, h0) if t is not None]
    gen = torch.Generator().manual_seed(seed)
    wh, wf = torch.randn(h.shape, generator=gen, dtype=F64), torch.randn(f.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad((h * wh).sum() + (f * wf).sum(), leaves, materialize_grads=True)
    want = torch.autograd.grad((ref_h * wh).sum() + (ref_f * wf).sum(), leaves, materialize_grads=True)
    for name, g1, g2 in zip("abh", got, want):
        assert_close(g1, g2, what=f"grad {name}")


@given(lengths=sample_lengths(4, allow_empty=True, long_chunks=(4, 6)).filter(lambda ls: sum(1 for n in ls if n) > 1), seed=st.integers(0, 2**16),
       data=st.data())
def test_gradient_isolation(lengths, seed, data):
    j = data.draw(st.sampled_from([i for i, n in enumerate(lengths) if n]), label="sample")
    a, b, h0 = make_inputs(lengths, with_h0=True, seed=seed)
    cu = cu_seqlens_of(lengths)
    h, f = linear_recurrence(a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=4)
    lo, hi = int(cu[j]), int(cu[j + 1])
    ga, gb, gh = torch.autograd.grad((h[:, lo:hi] * 1.3).sum() + f[j].sum(), [a, b, h0], materialize_grads=True)
    for name, g in (("a", ga), ("b", gb)):
        assert torch.count_nonzero(torch.cat([g[:, :lo], g[:, hi:]], 1)) == 0, f"{name} leaks across samples"
    assert torch.count_nonzero(torch.cat([gh[:j], gh[j + 1 :]])) == 0


def test_matches_recurrent_gemma_reset_scan():
    """recurrent_gemma resets where position_ids == 0 by multiplying a by ~reset; same as our cu_seqlens reset."""
    lengths = [5, 1, 70, 9]
    a, b, _ = make_inputs(lengths, with_h0=False, signed=False)
    a, b = a.detach(), b.detach()
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    reset = position_ids[:, :, None] == 0
    a_reset = a * ~reset
    h, ref = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = a_reset[:, t] * h + b[:, t]
        ref.append(h)
    out, _ = linear_recurrence(a, b, cu_seqlens=cu_seqlens_of(lengths))
    assert_close(out, torch.stack(ref, 1))


def test_unsplit_rows_and_low_precision():
    a, b, h0 = make_inputs([30, 30], with_h0=True)
    x = [t.detach().view(2, 30, -1) for t in (a, b)]
    h, f = linear_recurrence(*x, initial_state=h0.detach(), output_final_state=True, chunk_size=4)
    rh, rf = naive_linear_recurrence(*x, initial_state=h0.detach(), output_final_state=True)
    assert_close(h, rh)
    assert_close(f, rf)
    h, f = linear_recurrence(*(t.bfloat16() for t in x), output_final_state=True)
    rh, rf = naive_linear_recurrence(*(t.bfloat16().double() for t in x), output_final_state=True)
    assert h.dtype == torch.bfloat16 and f.dtype == torch.float32
    assert_close(h.double(), rh, rtol=2e-2, atol=2e-2)


BAD = {
    "cu-not-at-0": (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "non-decreasing"),
    "cu-not-at-T": (dict(cu_seqlens=torch.tensor([0, 3, 8])), "end at T=7"),
    "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "int32 or int64"),
    "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 3, 7]])), r"shape \[N\+1\]"),
    "cu-other-device": (dict(cu_seqlens=torch.tensor([0, 3, 7], device="meta")), "is on meta"),
    "h0-wrong-N": (dict(cu_seqlens=torch.tensor([0, 3, 7]), initial_state=torch.zeros(3, 5, dtype=F64)),
                   r"initial_state must have shape \[N, D\] = \[2, 5\]"),
    "chunk": (dict(chunk_size=1), "chunk_size"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    a, b, _ = make_inputs([3, 4], with_h0=False)
    kw, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        linear_recurrence(a, b, **kw)


def test_bad_tensors_raise():
    a, b, _ = make_inputs([3, 4], with_h0=False)
    cu = cu_seqlens_of([3, 4])
    with pytest.raises(ValueError, match="batch size must be 1"):
        linear_recurrence(torch.cat([a, a]), torch.cat([b, b]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="b must have the shape of a"):
        linear_recurrence(a, b[..., :2])
    with pytest.raises(ValueError, match=r"a must have shape \[B, T, D\]"):
        linear_recurrence(a[0], b[0])
    with pytest.raises(ValueError, match="share a dtype"):
        linear_recurrence(a, b.float())
    with pytest.raises(ValueError, match="floating-point"):
        linear_recurrence(a.long(), b.long())
