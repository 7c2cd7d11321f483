"""Mamba2 SSD through mamba-ssm's real Triton ``mamba_chunk_scan_combined`` (interpreted on the CPU): packed rows
(B = 2) equal each sample alone (through the same kernel) and packfree's float64 naive reference, forward and
backward; padding spans through
packfree's mixer route; a planted wrong ``seq_idx`` fails; what packfree hands the kernel meets its contract."""

from __future__ import annotations

import math

import pytest
import torch

from packfree_plugin.ops.family import families
from packfree_plugin.ops import opaque
from packfree_plugin.ops.ssd import naive_ssd, ssd_chunk_scan

from .test_real_fla import boundaries_of, close

families()  # declares every family's boundary op

KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
H, P, G, N = 4, 8, 2, 8
CHUNK = 16
ROWS = [[1, 15, 16, 8], [21, 19]]
"""Per row, sample lengths (T = 40): a one-token sample, a boundary on a chunk start (16), samples crossing chunks."""


def seq_idx_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).to(torch.int32)


def make_inputs(rows: int, tokens: int, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Leaves ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, ``B, C [B, T, G, N]``, ``D [H]``, ``z``, ``dt_bias``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).requires_grad_()

    return {
        "x": leaf(torch.randn(rows, tokens, H, P, generator=gen)),
        "dt": leaf(torch.randn(rows, tokens, H, generator=gen) - 1.0),
        "A": leaf(-torch.rand(H, generator=gen) - 0.5),
        "B": leaf(torch.randn(rows, tokens, G, N, generator=gen)),
        "C": leaf(torch.randn(rows, tokens, G, N, generator=gen)),
        "D": leaf(torch.randn(H, generator=gen)),
        "z": leaf(torch.randn(rows, tokens, H, P, generator=gen)),
        "dt_bias": leaf(0.5 * torch.randn(H, generator=gen)),
    }


OPTIONS = dict(dt_softplus=True, dt_limit=(0.0, math.inf))


def run(fn, x: dict, **kwargs) -> torch.Tensor:
    return fn(x["x"], x["dt"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], dt_bias=x["dt_bias"], **OPTIONS, **kwargs)


def as_float64(x: dict) -> dict:
    return {n: t.detach().double().requires_grad_() for n, t in x.items()}


PER_TOKEN = ("x", "dt", "B", "C", "z")


def test_packed_rows_equal_each_sample_alone_and_naive(spy):
    calls = spy(*KERNEL)
    seq_idx = seq_idx_of(ROWS)
    x = make_inputs(len(ROWS), sum(ROWS[0]))
    y = run(ssd_chunk_scan, x, chunk_size=CHUNK, seq_idx=seq_idx)
    assert len(calls.calls) == 1, "the packed call did not reach mamba-ssm"

    alone = []
    for b, lengths in enumerate(ROWS):
        pieces = {n: x[n][b : b + 1].split(lengths, dim=1) for n in PER_TOKEN}
        alone.append(torch.cat([run(ssd_chunk_scan, {**x, **{n: pieces[n][i] for n in PER_TOKEN}}, chunk_size=CHUNK)
                                for i in range(len(lengths))], dim=1))
    alone = torch.cat(alone)
    close(y, alone, "output vs alone", tol=1e-5)

    ref = as_float64(x)
    ry = run(naive_ssd, ref, seq_idx=seq_idx)
    close(y, ry, "output vs naive", tol=1e-5)

    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad((y.double() * cot).sum(), list(x.values()))
    # the alone runs read slices of the same leaves: their gradient is the sum of the per-sample gradients (A, D and
    # dt_bias are shared by every sample)
    alone_grads = torch.autograd.grad((alone.double() * cot).sum(), list(x.values()))
    want = torch.autograd.grad((ry * cot).sum(), list(ref.values()))  # per sample: the state restarts at each
    for name, g, a, w in zip(x, got, alone_grads, want):
        close(g, a, f"grad {name} vs alone", tol=1e-4)
        close(g, w, f"grad {name} vs naive", tol=1e-4)


def test_padding_spans_through_the_mixer_route(spy):
    calls = spy(*KERNEL)
    seq_len = 40
    boundaries = boundaries_of([[(3, False), (30, False), (7, True)], [(1, False), (20, False), (19, True)]])
    x = make_inputs(2, seq_len, seed=4)
    y = opaque.call("ssd_chunk_scan", boundaries, x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"],
                    x["dt_bias"], chunk_size=CHUNK, dt_softplus=True, dt_limit=[0.0, math.inf])
    args, kwargs = calls.only()
    assert torch.equal(kwargs["seq_idx"], boundaries.seq_idx)

    ref = as_float64(x)
    ry = run(naive_ssd, ref, seq_idx=boundaries.seq_idx)
    real = ~boundaries.padding_tokens
    close(y[real], ry[real], "output of the real samples", tol=1e-5)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * real[..., None, None]
    got = torch.autograd.grad((y.double() * cot).sum(), list(x.values()))
    want = torch.autograd.grad((ry * cot).sum(), list(ref.values()))
    for name, g, w in zip(x, got, want):
        close(g, w, f"grad {name}", tol=1e-4)
        if name in PER_TOKEN:
            pad_grad = g[~real]
            assert torch.equal(pad_grad, torch.zeros_like(pad_grad)), f"grad {name}: the real samples reach padding"


@pytest.mark.parametrize("planted", ["shifted", "none"])
def test_planted_wrong_seq_idx_fails(spy, planted):
    calls = spy(*KERNEL)
    x = {n: t.detach() for n, t in make_inputs(len(ROWS), sum(ROWS[0]), seed=2).items()}
    wrong = {"shifted": {"seq_idx": seq_idx_of([[2, 14, 16, 8], [21, 19]])}, "none": {}}[planted]
    y = run(ssd_chunk_scan, x, chunk_size=CHUNK, **wrong)
    assert len(calls.calls) == 1
    ry = run(naive_ssd, {n: t.double() for n, t in x.items()}, seq_idx=seq_idx_of(ROWS))
    with pytest.raises(AssertionError, match="max error"):
        close(y, ry, "output", tol=1e-5)


@pytest.mark.kernels_smoke
@pytest.mark.parametrize("given", ["seq_idx", "cu_seqlens"])
def test_what_packfree_hands_mamba_ssm_meets_its_contract(spy, given):
    """``mamba_chunk_scan_combined``'s contract: x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``, B/C
    ``[B, T, G, N]``, D ``[H]``, z like x, dt_bias ``[H]``, chunk_size an int, seq_idx ``[B, T]`` int32 (its kernels
    load it as int32) and contiguous, on the data's device; no states. The output is checked too (forward only: the
    smoke subset runs this)."""
    calls = spy(*KERNEL)
    lengths = [9, 1, 22]
    x = {n: t.detach() for n, t in make_inputs(1, sum(lengths)).items()}
    boundary = ({"seq_idx": seq_idx_of([lengths]).repeat_interleave(2, dim=1)[:, ::2]} if given == "seq_idx"  # strided
                else {"cu_seqlens": torch.tensor([0, 9, 10, 32])})
    y = run(ssd_chunk_scan, x, chunk_size=CHUNK, **boundary)
    args, kwargs = calls.only()
    close(y, run(naive_ssd, {n: t.double() for n, t in x.items()}, seq_idx=seq_idx_of([lengths])), "output", tol=1e-5)
    xx, dt, A, B, C, chunk_size = args
    Bsz, T = xx.shape[:2]
    assert xx.shape == (Bsz, T, H, P) and dt.shape == (Bsz, T, H) and A.shape == (H,)
    assert B.shape == C.shape == (Bsz, T, G, N) and kwargs["z"].shape == xx.shape
    assert kwargs["D"].shape == (H,) and kwargs["dt_bias"].shape == (H,)
    assert type(chunk_size) is int and chunk_size == CHUNK
    seq = kwargs["seq_idx"]
    assert seq.dtype == torch.int32 and seq.is_contiguous() and seq.shape == (Bsz, T) and seq.device == xx.device
    assert torch.equal(seq, seq_idx_of([lengths]))
    assert "initial_states" not in kwargs and "return_final_states" not in kwargs
    assert isinstance(kwargs["dt_limit"], tuple)
