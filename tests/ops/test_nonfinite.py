"""Non-finite isolation of every op (issue 10): a NaN or inf in one sample of a packed row never reaches
another sample, forward or backward.

Each case packs 5 samples (lengths straddling the chunk size), puts a NaN / +inf / -inf into one per-token
input at one token of one sample, and compares in float64 against the naive per-sample reference run on
every other sample alone: their outputs (and final states) must be finite and equal, and with the loss
taken on those samples only, the gradient w.r.t. every per-token input must equal the reference's (which is
zero on the poisoned sample's tokens). The poisoned sample gets what the op documents: every output token
NaN for the chunked ops (``ops/_nonfinite.py``), exactly its own per-sample result for the conv.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from packfree_plugin.ops.conv import causal_conv1d, naive_causal_conv1d
from packfree_plugin.ops.conv import fast as conv_fast
from packfree_plugin.ops.gated_delta import (
    chunk_gated_delta_rule, chunk_kda, naive_gated_delta_rule, naive_kda,
)
from packfree_plugin.ops.linear_attention import chunk_linear_attention, naive_linear_attention
from packfree_plugin.ops.lru import linear_recurrence, naive_linear_recurrence
from packfree_plugin.ops.selective_scan import naive_selective_scan, selective_scan
from packfree_plugin.ops.selective_scan import fast as scan_fast
from packfree_plugin.ops.ssd import naive_ssd, ssd_chunk_scan

F64 = torch.float64
LENGTHS = [5, 9, 2, 11, 4]
CHUNK = 4
H, K, V = 2, 4, 3


def _leaf(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale + shift).requires_grad_()


def _log_decay(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return (-F.softplus(torch.randn(*shape, generator=gen, dtype=F64))).requires_grad_()


def _gate(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.sigmoid(torch.randn(*shape, generator=gen, dtype=F64)).requires_grad_()


@dataclass(frozen=True)
class Op:
    """One op under test. ``make(gen, T)`` builds the float64 leaves of a ``B == 1`` row; ``per_token`` names
    the per-token inputs and their time dim; ``packed(inputs, seq_idx, cu_seqlens)`` and ``alone(inputs)`` return
    ``(out, final_state or None)``; the output's time dim is ``out_time``."""

    name: str
    make: Callable[[torch.Generator, int], dict[str, torch.Tensor]]
    per_token: dict[str, int]
    packed: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    alone: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    out_time: int = 1
    whole_sample_nan: bool = True
    inject: tuple[str, ...] = ()
    """The per-token inputs a case poisons (all of ``per_token`` if empty)."""


def _qkv(gen, T, per_channel_g: bool | None):
    t = dict(q=_leaf(gen, 1, T, H, K), k=_leaf(gen, 1, T, H, K), v=_leaf(gen, 1, T, H, V))
    if per_channel_g is not None:
        t["g"] = _log_decay(gen, 1, T, H, *([K] if per_channel_g else []))
    return t


def _with_h0(make):
    def build(gen, T):
        t = make(gen, T)
        t["initial_state"] = _leaf(gen, len(LENGTHS), H, K, V)
        return t
    return build


def _delta(fn, naive, per_channel: bool):
    def make(gen, T):
        return {**_qkv(gen, T, per_channel), "beta": _gate(gen, 1, T, H)}

    def packed(t, seq_idx, cu):
        return fn(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t.get("initial_state"),
                  output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend="torch")

    def alone(t):
        return naive(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t.get("initial_state"),
                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    return make, packed, alone


_GDN = _delta(chunk_gated_delta_rule, naive_gated_delta_rule, per_channel=False)
_KDA = _delta(chunk_kda, naive_kda, per_channel=True)
_QKVGB = {"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1}


_LA_TOKENS = {"q": 1, "k": 1, "v": 1, "g": 1}


def _la_make(gen, T):
    return {**_qkv(gen, T, False), "g_gamma": -torch.rand(H, generator=gen, dtype=F64)}


def _la_packed(t, seq_idx, cu):
    return chunk_linear_attention(t["q"], t["k"], t["v"], t["g"], g_gamma=t["g_gamma"],
                                  initial_state=t.get("initial_state"), output_final_state=True, cu_seqlens=cu,
                                  chunk_size=CHUNK)


def _la_alone(t):
    return naive_linear_attention(t["q"], t["k"], t["v"], t["g"], g_gamma=t["g_gamma"],
                                  initial_state=t.get("initial_state"), output_final_state=True)


def _lru_make(gen, T):
    return dict(a=_gate(gen, 1, T, 6), b=_leaf(gen, 1, T, 6))


def _ssd_make(gen, T):
    return dict(x=_leaf(gen, 1, T, 4, 2), dt=_leaf(gen, 1, T, 4, scale=0.5), B=_leaf(gen, 1, T, 2, 3),
                C=_leaf(gen, 1, T, 2, 3), z=_leaf(gen, 1, T, 4, 2),
                A=-torch.rand(4, generator=gen, dtype=F64) - 0.1, D=torch.randn(4, generator=gen, dtype=F64),
                dt_bias=torch.randn(4, generator=gen, dtype=F64) * 0.5)


_SSD_TOKENS = {"x": 1, "dt": 1, "B": 1, "C": 1, "z": 1}


def _ssd(t, **bounds):
    fn = naive_ssd if not bounds else ssd_chunk_scan
    extra = dict(chunk_size=CHUNK, backend="torch", **bounds) if bounds else {}
    return fn(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
              dt_softplus=True, **extra), None


def _scan_make(gen, T):
    return dict(u=_leaf(gen, 1, 6, T), delta=_leaf(gen, 1, 6, T, scale=0.5), B=_leaf(gen, 1, 2, 3, T),
                C=_leaf(gen, 1, 2, 3, T), z=_leaf(gen, 1, 6, T),
                A=-torch.rand(6, 3, generator=gen, dtype=F64) - 0.1, D=torch.randn(6, generator=gen, dtype=F64))


def _scan(t, **bounds):
    fn = selective_scan if bounds else naive_selective_scan
    return fn(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"], delta_softplus=True, **bounds), None


def _conv_make(gen, T):
    return dict(x=_leaf(gen, 1, T, 5), weight=torch.randn(5, 4, generator=gen, dtype=F64),
                bias=torch.randn(5, generator=gen, dtype=F64))


def _conv(t, **bounds):
    fn = causal_conv1d if bounds else naive_causal_conv1d
    return fn(t["x"], t["weight"], t["bias"], activation="silu", **bounds), None


OPS = [
    Op("conv", _conv_make, {"x": 1}, lambda t, s, cu: _conv(t, seq_idx=s), _conv, whole_sample_nan=False),
    Op("ssd", _ssd_make, _SSD_TOKENS, lambda t, s, cu: _ssd(t, seq_idx=s), _ssd),
    Op("ssd-cu", _ssd_make, _SSD_TOKENS, lambda t, s, cu: _ssd(t, cu_seqlens=cu), _ssd, inject=("x", "dt")),
    Op("selective_scan", _scan_make, {"u": 2, "delta": 2, "B": 3, "C": 3, "z": 2},
       lambda t, s, cu: _scan(t, seq_idx=s), _scan, out_time=2),
    Op("gdn", _GDN[0], _QKVGB, _GDN[1], _GDN[2]),
    Op("gdn-h0", _with_h0(_GDN[0]), {**_QKVGB, "initial_state": 0}, _GDN[1], _GDN[2],
       inject=("q", "beta", "initial_state")),
    Op("kda", _KDA[0], _QKVGB, _KDA[1], _KDA[2]),
    Op("kda-h0", _with_h0(_KDA[0]), {**_QKVGB, "initial_state": 0}, _KDA[1], _KDA[2],
       inject=("g", "v", "initial_state")),
    Op("linear_attention", _la_make, _LA_TOKENS, _la_packed, _la_alone),
    Op("linear_attention-h0", _with_h0(_la_make), {**_LA_TOKENS, "initial_state": 0}, _la_packed, _la_alone,
       inject=("k", "initial_state")),
    Op("lru", _lru_make, {"a": 1, "b": 1},
       lambda t, s, cu: linear_recurrence(t["a"], t["b"], output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK),
       lambda t: naive_linear_recurrence(t["a"], t["b"], output_final_state=True)),
]
CASES = [(op, name) for op in OPS for name in (op.inject or op.per_token)]


def _piece(t: torch.Tensor, time_dim: int, i: int, lo: int, hi: int) -> torch.Tensor:
    """Sample ``i`` of one input: tokens ``lo:hi`` along ``time_dim``, or row ``i`` of an initial state (dim 0)."""
    return t[i : i + 1] if time_dim == 0 else t.narrow(time_dim, lo, hi - lo)


def _slice(t: dict[str, torch.Tensor], op: Op, i: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Sample ``i`` (tokens ``lo:hi``) of every input: per-token inputs along their time dim, initial states by
    sample, everything else whole."""
    out = dict(t)
    for name, dim in op.per_token.items():
        out[name] = _piece(t[name], dim, i, lo, hi)
    if "initial_state" in t and "initial_state" not in op.per_token:
        out["initial_state"] = t["initial_state"][i : i + 1]
    return out


def _poison(t: torch.Tensor, dim: int, token: int, value: float, gen: torch.Generator) -> torch.Tensor:
    """A leaf equal to ``t`` with ``value`` at one random element of ``token`` along ``dim`` (``dim`` 0:
    ``token`` indexes the samples of an initial state)."""
    poisoned = t.detach().clone()
    piece = poisoned.select(dim, token)
    flat = piece.reshape(-1)
    idx = int(torch.randint(flat.numel(), (1,), generator=gen))
    index = torch.unravel_index(torch.tensor(idx), piece.shape)
    piece[tuple(int(j) for j in index)] = value
    return poisoned.requires_grad_()


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "-inf"])
@pytest.mark.parametrize("sick", [0, 3], ids=lambda s: f"sample{s}")
@pytest.mark.parametrize("op, name", CASES, ids=[f"{op.name}-{name}" for op, name in CASES])
def test_nonfinite_stays_in_its_sample(op: Op, name: str, sick: int, value: float):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op.name}-{name}-{sick}".encode()))
    T = sum(LENGTHS)
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    inputs = op.make(gen, T)
    bad_token = sick if name == "initial_state" else offsets[sick] + LENGTHS[sick] // 2
    inputs[name] = _poison(inputs[name], op.per_token[name], bad_token, value, gen)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).to(torch.int32)[None]
    cu = torch.tensor(offsets, dtype=torch.int32)

    out, final = op.packed(inputs, seq_idx, cu)
    alone = [op.alone(_slice(inputs, op, i, offsets[i], offsets[i + 1])) for i in range(len(LENGTHS))]
    clean = [i for i in range(len(LENGTHS)) if i != sick]
    pieces = out.split(LENGTHS, dim=op.out_time)

    for i in clean:
        assert torch.isfinite(pieces[i]).all(), f"sample {i}: non-finite output"
        torch.testing.assert_close(pieces[i], alone[i][0], rtol=1e-9, atol=1e-10, msg=lambda m: f"sample {i}: {m}")
        if final is not None:
            assert torch.isfinite(final[i]).all(), f"sample {i}: non-finite final state"
            torch.testing.assert_close(final[i], alone[i][1][0], rtol=1e-9, atol=1e-10)
    if op.whole_sample_nan:
        assert torch.isnan(pieces[sick]).all(), "every output of the poisoned sample is NaN"
        if final is not None:
            assert torch.isnan(final[sick]).all(), "the poisoned sample's final state is NaN"
    else:
        torch.testing.assert_close(pieces[sick], alone[sick][0], rtol=1e-9, atol=1e-10, equal_nan=True)

    # loss on the clean samples only: gradients w.r.t. every per-token input equal the reference's
    weights = [torch.randn(alone[i][0].shape, generator=gen, dtype=F64) for i in clean]
    loss = sum((pieces[i] * w).sum() for i, w in zip(clean, weights))
    ref_loss = sum((alone[i][0] * w).sum() for i, w in zip(clean, weights))
    if final is not None:
        state_w = [torch.randn(final[i].shape, generator=gen, dtype=F64) for i in clean]
        loss = loss + sum((final[i] * w).sum() for i, w in zip(clean, state_w))
        ref_loss = ref_loss + sum((alone[i][1][0] * w).sum() for i, w in zip(clean, state_w))
    leaves = [inputs[n] for n in op.per_token]
    got = torch.autograd.grad(loss, leaves, materialize_grads=True)
    want = torch.autograd.grad(ref_loss, leaves, materialize_grads=True)
    for n, g, w in zip(op.per_token, got, want):
        if op.whole_sample_nan:  # the poisoned sample's outputs are constants: zero gradient, like the reference's
            assert torch.isfinite(g).all(), f"grad {n}: non-finite values"
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {n}: {m}")
            continue
        for i in clean:  # the conv's poisoned sample may hold NaN gradients where it alone would
            gi, wi = (_piece(x, op.per_token[n], i, offsets[i], offsets[i + 1]) for x in (g, w))
            assert torch.isfinite(gi).all(), f"grad {n}, sample {i}: non-finite values"
            torch.testing.assert_close(gi, wi, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {n}, sample {i}: {m}")


@pytest.mark.parametrize("module, switch, value, op_name", [
    (conv_fast, "_SPARSE_ON_CPU", False, "conv"), (conv_fast, "_SPREAD_UP_TO_BYTES", 0, "conv"),
    (scan_fast, "_SPARSE_ON_CPU", False, "selective_scan")], ids=["conv-dense", "conv-sparse", "scan-dense"])
def test_other_boundary_paths(monkeypatch, module, switch, value, op_name):
    """The other paths isolate too: the masked ones other devices take, and the conv's boundary-row recompute
    for rows too large to spread out."""
    monkeypatch.setattr(module, switch, value)
    op = next(o for o in OPS if o.name == op_name)
    for name in op.inject or op.per_token:
        for sick in (0, 3):
            test_nonfinite_stays_in_its_sample(op, name, sick, float("nan"))


def test_rows_without_cu_seqlens_are_isolated():
    """B > 1 rows with no cu_seqlens are samples too (the LRU flattens them into one scan)."""
    gen = torch.Generator().manual_seed(0)
    a, b = _gate(gen, 3, 7, 4), _leaf(gen, 3, 7, 4)
    poisoned = b.detach().clone()
    poisoned[1, 3, 2] = float("nan")
    poisoned.requires_grad_()
    h, final = linear_recurrence(a, poisoned, output_final_state=True, chunk_size=CHUNK)
    ref, ref_final = naive_linear_recurrence(a, poisoned, output_final_state=True)
    for row in (0, 2):
        torch.testing.assert_close(h[row], ref[row], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(final[row], ref_final[row], rtol=1e-9, atol=1e-10)
    assert torch.isnan(h[1]).all() and torch.isnan(final[1]).all()
    w = torch.randn(2, 7, 4, generator=gen, dtype=F64)
    got = torch.autograd.grad((h[[0, 2]] * w).sum(), [a, poisoned])
    want = torch.autograd.grad((ref[[0, 2]] * w).sum(), [a, poisoned])
    for g, r in zip(got, want):  # the reference runs row 1 too, so its own gradient there is NaN
        torch.testing.assert_close(g[[0, 2]], r[[0, 2]], rtol=1e-9, atol=1e-10)
        assert torch.equal(g[1], torch.zeros_like(g[1])), "the poisoned row's outputs are constants"
