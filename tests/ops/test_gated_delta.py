"""Gated DeltaNet / KDA: packed chunked path == per-sample naive reference (values, final states, gradients),
gradient isolation between samples, the fla routing contract (fake fla), and ValueError on bad inputs."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfree_plugin.ops import backends
from packfree_plugin.ops.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    chunk_kda,
    chunk_kda_torch,
    naive_gated_delta_rule,
    naive_kda,
)
from tests.ops.harness import F64, assert_close, cu_seqlens_of, sample_lengths, grads









def make_inputs(lengths, *, per_channel, H=2, K=4, V=3, seed=0, with_h0=True, gate_in_kernel=False):
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)

    def leaf(*shape, lo=None, hi=None):
        x = torch.randn(*shape, generator=gen, dtype=F64)
        if lo is not None:
            x = lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=F64)
        return x.requires_grad_()

    inp = {
        "q": leaf(1, T, H, K),
        "k": leaf(1, T, H, K),
        "v": leaf(1, T, H, V),
        "g": leaf(1, T, H, K, lo=-1.5, hi=0.0) if per_channel else leaf(1, T, H, lo=-1.5, hi=0.0),
        "beta": leaf(1, T, H, lo=0.0, hi=1.0),
    }
    if gate_in_kernel:
        inp["g"] = leaf(1, T, H, K)
    opts = {"initial_state": leaf(N, H, K, V) if with_h0 else None}
    if gate_in_kernel:
        opts.update(use_gate_in_kernel=True, A_log=leaf(H, lo=-1.0, hi=1.0), dt_bias=leaf(H * K))
    return inp, opts




def leaves_of(inp, opts):
    names = [n for n, t in {**inp, **opts}.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    return names, [{**inp, **opts}[n] for n in names]


FAMILIES = {
    "gdn": (False, chunk_gated_delta_rule_torch, naive_gated_delta_rule),
    "kda": (True, chunk_kda_torch, naive_kda),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@given(
    lengths=sample_lengths(64),
    chunk=st.sampled_from([64, 8, 16]),
    seed=st.integers(0, 2**16),
    l2norm=st.booleans(),
    with_h0=st.booleans(),
    scale=st.sampled_from([None, 0.7]),
)
def test_packed_matches_per_sample_naive(family, lengths, chunk, seed, l2norm, with_h0, scale):
    per_channel, fast, naive = FAMILIES[family]
    inp, opts = make_inputs(lengths, per_channel=per_channel, seed=seed, with_h0=with_h0)
    cu = cu_seqlens_of(lengths)
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2norm, **opts)
    o, final = fast(*inp.values(), cu_seqlens=cu, chunk_size=chunk, **kw)
    # Reference: each sample alone, then concatenated.
    ref_o, ref_f = [], []
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        one = {name: t[:, sl] for name, t in inp.items()}
        h0 = None if opts["initial_state"] is None else opts["initial_state"][i : i + 1]
        oi, fi = naive(*one.values(), **{**kw, "initial_state": h0})
        ref_o.append(oi)
        ref_f.append(fi)
    ref_o, ref_f = torch.cat(ref_o, 1), torch.cat(ref_f, 0)
    assert_close(o, ref_o)
    assert_close(final, ref_f)
    names, leaves = leaves_of(inp, opts)
    for name, got, want in zip(names, grads(o, final, leaves), grads(ref_o, ref_f, leaves)):
        assert_close(got, want, what=f"grad {name}")


@given(lengths=sample_lengths(16), seed=st.integers(0, 2**16))
def test_kda_gate_in_kernel_matches_naive(lengths, seed):
    inp, opts = make_inputs(lengths, per_channel=True, seed=seed, gate_in_kernel=True)
    cu = cu_seqlens_of(lengths)
    o, f = chunk_kda_torch(*inp.values(), cu_seqlens=cu, output_final_state=True, chunk_size=16, **opts)
    ro, rf = naive_kda(*inp.values(), cu_seqlens=cu, output_final_state=True, **opts)
    assert_close(o, ro)
    assert_close(f, rf)
    names, leaves = leaves_of(inp, opts)
    for name, got, want in zip(names, grads(o, f, leaves), grads(ro, rf, leaves)):
        assert_close(got, want, what=f"grad {name}")


@pytest.mark.parametrize("family", list(FAMILIES))
@given(lengths=sample_lengths(8).filter(lambda ls: len(ls) > 1), seed=st.integers(0, 2**16), data=st.data())
def test_gradient_isolation(family, lengths, seed, data):
    per_channel, fast, _ = FAMILIES[family]
    j = data.draw(st.integers(0, len(lengths) - 1), label="sample")
    # without initial states samples share chunks; with them chunks start on sample starts
    inp, opts = make_inputs(lengths, per_channel=per_channel, seed=seed, with_h0=data.draw(st.booleans(), label="h0"))
    cu = cu_seqlens_of(lengths)
    o, final = fast(*inp.values(), cu_seqlens=cu, chunk_size=8, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **opts)
    lo, hi = int(cu[j]), int(cu[j + 1])
    loss = (o[:, lo:hi] * 1.3).sum() + final[j].sum()
    names, leaves = leaves_of(inp, opts)
    for name, grad in zip(names, torch.autograd.grad(loss, leaves, materialize_grads=True)):
        if name == "initial_state":
            others = torch.cat([grad[:j], grad[j + 1 :]])
        else:
            others = torch.cat([grad[:, :lo], grad[:, hi:]], dim=1)
        assert torch.count_nonzero(others) == 0, f"{name}: sample {j} leaks gradient into other samples"
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unsplit_batch_rows_are_samples_and_empty_samples_keep_state(family):
    per_channel, fast, naive = FAMILIES[family]
    inp, opts = make_inputs([70, 70], per_channel=per_channel)
    batched = {n: t.detach().reshape(2, 70, *t.shape[2:]) for n, t in inp.items()}  # B=2 rows of 70
    h0 = opts["initial_state"].detach()
    o, f = fast(*batched.values(), initial_state=h0, output_final_state=True)
    ro, rf = naive(*batched.values(), initial_state=h0, output_final_state=True)
    assert_close(o, ro)
    assert_close(f, rf)
    # Empty samples (repeated offsets) are allowed: their final state is their initial state.
    lengths = [0, 5, 0, 9]
    inp, opts = make_inputs(lengths, per_channel=per_channel)
    o, f = fast(*inp.values(), cu_seqlens=cu_seqlens_of(lengths), output_final_state=True, **opts)
    ro, rf = naive(*inp.values(), cu_seqlens=cu_seqlens_of(lengths), output_final_state=True, **opts)
    assert_close(o, ro)
    assert_close(f, rf)
    assert_close(f[0], opts["initial_state"][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    inp, opts = make_inputs([40, 90, 3], per_channel=False, seed=3)
    low = {n: t.detach().to(dtype) for n, t in inp.items()}
    o, f = chunk_gated_delta_rule(*low.values(), cu_seqlens=cu_seqlens_of([40, 90, 3]), output_final_state=True)
    ro, rf = naive_gated_delta_rule(*(t.double() for t in low.values()), cu_seqlens=cu_seqlens_of([40, 90, 3]),
                                    output_final_state=True)
    assert o.dtype == dtype and f.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(o.double(), ro, rtol=tol, atol=tol)
    assert_close(f.double(), rf, rtol=tol, atol=tol)


def test_kda_strong_decay_stays_finite():
    """Per-channel decay of -30 nats per token: the sub-block reference trick must not overflow."""
    inp, _ = make_inputs([100, 30], per_channel=True, seed=5)
    x = {n: t.detach().float() for n, t in inp.items()}
    x["g"] = torch.full_like(x["g"], -30.0)
    x["g"][..., ::2] = -0.01
    o, f = chunk_kda(*x.values(), cu_seqlens=cu_seqlens_of([100, 30]), output_final_state=True)
    ro, rf = naive_kda(*(t.double() for t in x.values()), cu_seqlens=cu_seqlens_of([100, 30]), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    assert_close(o.double(), ro, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------
# fla contract: a fake `fla` with the real signatures asserts what the dispatcher hands it.


class FakeFla:
    def __init__(self, expected_cu: list[int] | None):
        self.expected_cu = expected_cu
        self.calls: list[str] = []

    def _check(self, q, cu_seqlens):
        if self.expected_cu is None:
            assert cu_seqlens is None
            return
        assert isinstance(cu_seqlens, torch.Tensor)
        assert cu_seqlens.dtype == torch.int32
        assert cu_seqlens.device == q.device
        assert cu_seqlens.tolist() == self.expected_cu
        assert q.shape[0] == 1

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False):
        self._check(q, cu_seqlens)
        self.calls.append("gdn")
        return naive_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, chunk_indices=None,
                  **kwargs):
        self._check(q, cu_seqlens)
        assert initial_state is None or initial_state.dtype == torch.float32
        if use_gate_in_kernel:
            assert "A_log" in kwargs
        self.calls.append("kda")
        return naive_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         use_gate_in_kernel=use_gate_in_kernel, A_log=kwargs.get("A_log"),
                         dt_bias=kwargs.get("dt_bias"), cu_seqlens=cu_seqlens)


@pytest.fixture
def fake_fla(monkeypatch):
    def install(expected_cu, on_cuda=True):
        fake = FakeFla(expected_cu)
        mods = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.kda")}
        mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fake.chunk_gated_delta_rule
        mods["fla.ops.kda"].chunk_kda = fake.chunk_kda
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(backends, "on_cuda", lambda t: on_cuda)
        backends.load_kernel.cache_clear()
        return fake

    yield install
    backends.load_kernel.cache_clear()


CONTRACT_CASES = {"N3-T29-H2": [1, 20, 8], "N1-T7-H2": [7]}


@pytest.mark.parametrize("lengths", CONTRACT_CASES.values(), ids=CONTRACT_CASES.keys())
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
def test_fla_route_receives_int32_cu_seqlens_and_flat_row(fake_fla, family, lengths, cu_dtype):
    per_channel = FAMILIES[family][0]
    public, naive = (chunk_kda, naive_kda) if per_channel else (chunk_gated_delta_rule, naive_gated_delta_rule)
    fake = fake_fla(cu_seqlens_of(lengths, torch.int32).tolist())
    inp, opts = make_inputs(lengths, per_channel=per_channel, gate_in_kernel=per_channel)
    x = {n: t.detach().bfloat16() for n, t in inp.items()}
    o_opts = {n: (t.detach() if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    o, f = public(*x.values(), cu_seqlens=cu_seqlens_of(lengths, cu_dtype), output_final_state=True, **o_opts)
    assert fake.calls == [family]
    ro, rf = naive(*x.values(), cu_seqlens=cu_seqlens_of(lengths), output_final_state=True,
                   **{**o_opts, "initial_state": o_opts["initial_state"].float()})
    assert_close(o, ro, rtol=0, atol=0)
    assert_close(f, rf, rtol=0, atol=0)


def test_fla_route_without_cu_seqlens_passes_batch_through(fake_fla):
    fake = fake_fla(None)
    inp, _ = make_inputs([10, 10], per_channel=False)
    x = {n: t.detach().bfloat16().reshape(2, 10, *t.shape[2:]) for n, t in inp.items()}
    chunk_gated_delta_rule(*x.values())
    assert fake.calls == ["gdn"]


def test_fla_route_is_skipped_off_cuda_for_float32_and_when_fla_missing(fake_fla, monkeypatch):
    inp, _ = make_inputs([5, 6], per_channel=False)
    x = {n: t.detach() for n, t in inp.items()}
    fake = fake_fla([0, 5, 11], on_cuda=False)
    chunk_gated_delta_rule(*(t.bfloat16() for t in x.values()), cu_seqlens=cu_seqlens_of([5, 6]))
    assert fake.calls == []  # not on CUDA
    fake = fake_fla([0, 5, 11], on_cuda=True)
    chunk_gated_delta_rule(*(t.float() for t in x.values()), cu_seqlens=cu_seqlens_of([5, 6]))
    assert fake.calls == []  # fla refuses float32: auto takes the torch path
    chunk_gated_delta_rule(*x.values(), cu_seqlens=cu_seqlens_of([5, 6]), backend="kernel")
    assert fake.calls == ["gdn"]  # forced
    chunk_gated_delta_rule(*(t.bfloat16() for t in x.values()), cu_seqlens=cu_seqlens_of([5, 6]), backend="torch")
    assert fake.calls == ["gdn"]
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # import now fails
    backends.load_kernel.cache_clear()
    o, _ = chunk_gated_delta_rule(*(t.bfloat16() for t in x.values()), cu_seqlens=cu_seqlens_of([5, 6]))
    assert o.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not import"):
        chunk_gated_delta_rule(*x.values(), cu_seqlens=cu_seqlens_of([5, 6]), backend="kernel")


def test_fla_route_validates_before_calling(fake_fla):
    fake = fake_fla([0, 5, 11])
    inp, _ = make_inputs([5, 6], per_channel=False)
    x = [t.detach().bfloat16() for t in inp.values()]
    with pytest.raises(ValueError, match="end at T=11"):
        chunk_gated_delta_rule(*x, cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32))
    assert fake.calls == []


# ---------------------------------------------------------------------------------------------------------
# Bad inputs raise ValueError naming the offending values.


def _good(per_channel=False, lengths=(3, 4)):
    inp, opts = make_inputs(list(lengths), per_channel=per_channel)
    return {n: t.detach() for n, t in inp.items()}, opts["initial_state"].detach()


def _bad_cases():
    T = 7
    cases = {
        "cu-not-at-0": (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
        "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 5, 3, 7], dtype=torch.int32)), "non-decreasing"),
        "cu-not-at-T": (dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)), f"end at T={T}"),
        "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "int32 or int64"),
        "cu-2d": (dict(cu_seqlens=torch.tensor([[0, 3, 7]], dtype=torch.int32)), r"shape \[N\+1\]"),
        "cu-list": (dict(cu_seqlens=[0, 3, 7]), "torch.Tensor"),
        "h0-wrong-N": (dict(initial_state="wrong-N"), "N = number of samples"),
    }
    return cases


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_boundary_arguments_raise(family, case):
    per_channel = FAMILIES[family][0]
    public = chunk_kda if per_channel else chunk_gated_delta_rule
    x, h0 = _good(per_channel)
    kw, match = _bad_cases()[case]
    if kw.get("initial_state") == "wrong-N":
        kw = dict(cu_seqlens=cu_seqlens_of([3, 4]), initial_state=torch.cat([h0, h0]))
    with pytest.raises(ValueError, match=match):
        public(*x.values(), **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bad_tensor_arguments_raise(family):
    per_channel = FAMILIES[family][0]
    public = chunk_kda if per_channel else chunk_gated_delta_rule
    x, _ = _good(per_channel)
    cu = cu_seqlens_of([3, 4])

    def call(**over):
        return public(*{**x, **over}.values(), cu_seqlens=over.pop("cu", cu))

    with pytest.raises(ValueError, match="batch size must be 1"):
        public(*(torch.cat([t, t]) for t in x.values()), cu_seqlens=cu)
    with pytest.raises(ValueError, match="k must have the shape of q"):
        call(k=x["k"][..., :3])
    with pytest.raises(ValueError, match="v must have shape"):
        call(v=x["v"][:, :5])
    with pytest.raises(ValueError, match="g must have shape"):
        call(g=x["g"][..., 0] if per_channel else x["g"][..., None])
    with pytest.raises(ValueError, match="beta must have shape"):
        call(beta=x["beta"][..., None])
    with pytest.raises(ValueError, match="share a dtype"):
        call(v=x["v"].float())
    with pytest.raises(ValueError, match="floating-point"):
        call(q=x["q"].long(), k=x["k"].long(), v=x["v"].long())
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, H, K\]"):
        call(q=x["q"][0])
    with pytest.raises(ValueError, match="chunk_size"):
        (chunk_kda_torch if per_channel else chunk_gated_delta_rule_torch)(*x.values(), chunk_size=0)
    if per_channel:
        with pytest.raises(ValueError, match="power of two"):
            chunk_kda_torch(*x.values(), chunk_size=48)
    if per_channel:
        with pytest.raises(ValueError, match="requires A_log"):
            chunk_kda(*x.values(), use_gate_in_kernel=True)
        with pytest.raises(ValueError, match="A_log must have H=2"):
            chunk_kda(*x.values(), use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=F64))


@pytest.mark.parametrize("lengths, rows, chunk", [([5, 17, 1, 30], 1, 16), ([3, 9, 4, 8], 2, 8), ([70, 2, 24], 1, 64)])
def test_device_row_masks_equal_the_host_ones(lengths, rows, chunk):
    """A CPU row builds its boundary masks in numpy, other devices in torch: both builders give the same masks
    (CPU tests run the numpy one against the naive reference everywhere else)."""
    from packfree_plugin.ops.gated_delta.intra_chunk import above_diagonal
    from packfree_plugin.ops.gated_delta.row_chunks import host_causal, mask_arrays

    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    seq_idx = seq_idx.view(rows, -1)  # rows > 1: each row holds whole samples, indices continue across rows
    host = mask_arrays(seq_idx.numpy(), chunk, host_causal(chunk))
    device = mask_arrays(seq_idx, chunk, ~above_diagonal(chunk, seq_idx.device))
    assert len(host) == len(device) == 6
    for h, d in zip(host, device):
        assert torch.equal(torch.from_numpy(h), d)
    same = device[-1]  # [M, C, C]: causal, every token with itself
    assert same.diagonal(dim1=1, dim2=2).all() and not same.triu(1).any()
