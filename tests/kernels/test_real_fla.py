"""Gated DeltaNet and KDA through fla's real Triton kernels (interpreted on the CPU): a packed row equals each sample
alone and packfree's float64 naive reference, values, final states and gradients; B > 1 rows with padding through
packfree's mixer route; a planted wrong boundary fails; what packfree hands fla meets fla's stated contract.

float16 throughout: the auto route hands fla half inputs only, and Triton's interpreter miscomputes bfloat16 (numpy
has no bfloat16: GDN's output is off by ~4e9 at T=40 where float16 is off by 8e-4 and float32 by 5e-7).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from packfree_plugin.ops.family import families
from packfree_plugin.ops import opaque
from packfree_plugin.boundaries import Boundaries
from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda, naive_gated_delta_rule, naive_kda

families()  # declares every family's boundary op

HALF = torch.float16
H, K, V = 2, 16, 16
FAMILIES = {
    # family: (packfree op, naive reference, fla module and function, per-channel decay, route name)
    "gdn": (chunk_gated_delta_rule, naive_gated_delta_rule, ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
            False, "chunk_gated_delta_rule"),
    "kda": (chunk_kda, naive_kda, ("fla.ops.kda", "chunk_kda"), True, "chunk_kda"),
}
CROSSING = [1, 70, 5]
"""fla's chunk is 64 tokens: a one-token sample, one crossing a chunk boundary, one starting inside the second chunk."""


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def boundaries_of(rows: list[list[tuple[int, bool]]]) -> Boundaries:
    """Rows of equal length, each a list of ``(length, is_padding)`` spans."""
    offsets, padding = [0], []
    for row in rows:
        for length, pad in row:
            offsets.append(offsets[-1] + length)
            padding.append(pad)
    return Boundaries(offsets, batch_size=len(rows), seq_len=sum(n for n, _ in rows[0]), device="cpu",
                      padding=padding)


def make_inputs(tokens: int, *, per_channel: bool, seed: int = 0, rows: int = 1) -> dict[str, torch.Tensor]:
    """float16 leaves ``q, k [rows, T, H, K]``, ``v [rows, T, H, V]``, ``g`` (log decay), ``beta [rows, T, H]``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.to(HALF).requires_grad_()

    decay_shape = (rows, tokens, H, K) if per_channel else (rows, tokens, H)
    return {
        "q": leaf(torch.randn(rows, tokens, H, K, generator=gen)),
        "k": leaf(F.normalize(torch.randn(rows, tokens, H, K, generator=gen), dim=-1)),
        "v": leaf(torch.randn(rows, tokens, H, V, generator=gen)),
        "g": leaf(-0.8 * torch.rand(*decay_shape, generator=gen)),
        "beta": leaf(torch.rand(rows, tokens, H, generator=gen)),
    }


def initial_states(samples: int, seed: int = 1) -> torch.Tensor:
    """``[N, H, K, V]`` float32 leaf (fla keeps states in float32)."""
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(samples, H, K, V, generator=gen)).requires_grad_()


def grads(outputs: list[torch.Tensor], leaves: list[torch.Tensor], seed: int = 7) -> list[torch.Tensor]:
    """Gradients of ``sum(out * cotangent)`` (fixed random cotangents, in float64) w.r.t. ``leaves``."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum() for out in outputs)
    return list(torch.autograd.grad(loss, leaves))


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, tol: float) -> None:
    """Within ``tol`` of the reference's scale (float16 kernels against float64 references)."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(1.0, expected.abs().max().item())
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= tol * scale, f"{what}: max error {error:.3e} > {tol * scale:.3e}"


def as_float64(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values, float64 leaves."""
    return {n: t.detach().double().requires_grad_() for n, t in x.items()}


@pytest.mark.parametrize("family", [pytest.param("gdn", marks=pytest.mark.kernels_smoke), "kda"])
def test_packed_row_equals_each_sample_alone_and_naive(spy, family):
    op, naive, (module, attr), per_channel, _ = FAMILIES[family]
    calls = spy(module, attr)
    lengths = CROSSING
    x = make_inputs(sum(lengths), per_channel=per_channel)
    h0 = initial_states(len(lengths))
    o, final = op(*x.values(), initial_state=h0, output_final_state=True, cu_seqlens=cu_of(lengths))
    assert len(calls.calls) == 1, "the packed call did not reach fla"
    leaves = [*x.values(), h0]

    # each sample alone, through the same real kernel (B = 1, no cu_seqlens)
    alone_o, alone_final = [], []
    for i, piece in enumerate(zip(*(t.split(lengths, dim=1) for t in x.values()))):
        out, state = op(*piece, initial_state=h0[i : i + 1], output_final_state=True)
        alone_o.append(out)
        alone_final.append(state)
    alone_o, alone_final = torch.cat(alone_o, dim=1), torch.cat(alone_final)
    close(o, alone_o, "output vs alone", tol=2e-3)
    close(final, alone_final, "final state vs alone", tol=2e-3)

    ref = as_float64(x)
    ref_h0 = h0.detach().double().requires_grad_()
    ro, rfinal = naive(*ref.values(), initial_state=ref_h0, output_final_state=True, cu_seqlens=cu_of(lengths))
    close(o, ro, "output vs naive", tol=1e-2)
    close(final, rfinal, "final state vs naive", tol=1e-2)

    got = grads([o, final], leaves)
    alone = grads([alone_o, alone_final], leaves)
    want = grads([ro, rfinal], [*ref.values(), ref_h0])
    for name, g, a, w in zip([*x, "initial_state"], got, alone, want):
        close(g, a, f"grad {name} vs alone", tol=2e-3)
        close(g, w, f"grad {name} vs naive", tol=2e-2)


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_rows_with_padding_through_the_mixer_route(spy, family):
    """B = 2 rows with padding spans, as the mixer route gets them: flattened into one fla call."""
    _, naive, (module, attr), per_channel, route = FAMILIES[family]
    calls = spy(module, attr)
    seq_len = 40
    boundaries = boundaries_of([[(3, False), (30, False), (7, True)], [(1, False), (20, False), (19, True)]])
    offsets = list(boundaries.offsets)
    x = make_inputs(seq_len, per_channel=per_channel, rows=2, seed=3)
    out = opaque.call(route, boundaries, *x.values(), scale=None, use_qk_l2norm_in_kernel=True)
    args, kwargs = calls.only()
    assert args[0].shape[:2] == (1, 2 * seq_len) and kwargs["cu_seqlens"].tolist() == offsets

    ref = as_float64(x)
    flat = {n: t.reshape(1, 2 * seq_len, *t.shape[2:]) for n, t in ref.items()}
    ro, _ = naive(*flat.values(), use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(offsets))
    ro = ro.reshape(2, seq_len, H, V)
    real = ~boundaries.padding_tokens  # [B, T]
    close(out[real], ro[real], "output of the real samples", tol=1e-2)

    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    cot = cot * real[..., None, None]
    got = torch.autograd.grad((out.double() * cot).sum(), list(x.values()))
    want = torch.autograd.grad((ro * cot).sum(), list(ref.values()))
    for name, g, w in zip(x, got, want):
        close(g, w, f"grad {name}", tol=2e-2)
        pad_grad = g[~real]
        assert torch.equal(pad_grad, torch.zeros_like(pad_grad)), f"grad {name}: the real samples reach padding"


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("planted", ["off-by-one", "no-cu_seqlens"])
def test_planted_wrong_boundaries_fail(spy, family, planted):
    """The comparison above catches a wrong boundary argument: cu_seqlens off by one, or none at all."""
    op, naive, (module, attr), per_channel, _ = FAMILIES[family]
    calls = spy(module, attr)
    lengths = [20, 30, 14]
    x = {n: t.detach() for n, t in make_inputs(sum(lengths), per_channel=per_channel, seed=2).items()}
    wrong = {"off-by-one": {"cu_seqlens": cu_of([21, 29, 14])}, "no-cu_seqlens": {}}[planted]
    o, _ = op(*x.values(), **wrong)
    assert len(calls.calls) == 1
    ro, _ = naive(*(t.double() for t in x.values()), cu_seqlens=cu_of(lengths))
    with pytest.raises(AssertionError, match="max error"):
        close(o, ro, "output", tol=1e-2)


@pytest.mark.kernels_smoke
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_what_packfree_hands_fla_meets_its_contract(spy, family):
    """fla's stated contract (``chunk_gated_delta_rule`` / ``chunk_kda`` docstrings and checks): q, k
    ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV]`` (``[B, T, HV, K]`` for KDA), beta ``[B, T, HV]``, one dtype;
    with cu_seqlens: B == 1, a 1-D integer tensor on the data's device from 0 to T, one initial state per sample
    (float32 for KDA). The output is checked too (forward only: the smoke subset runs this)."""
    op, _, (module, attr), per_channel, _ = FAMILIES[family]
    calls = spy(module, attr)
    lengths = [5, 9, 2]
    x = {n: t.detach() for n, t in make_inputs(sum(lengths), per_channel=per_channel).items()}
    h0 = initial_states(len(lengths)).detach().to(HALF)  # the caller's dtype: packfree converts where fla needs it
    o, final = op(*x.values(), initial_state=h0, output_final_state=True, cu_seqlens=cu_of(lengths).long())
    args, kwargs = calls.only()
    naive = FAMILIES[family][1]
    ro, rfinal = naive(*(t.double() for t in x.values()), initial_state=h0.double(), output_final_state=True,
                       cu_seqlens=cu_of(lengths))
    close(o, ro, "output vs naive", tol=1e-2)
    close(final, rfinal, "final state vs naive", tol=1e-2)
    q, k, v, g, beta = args
    B, T = q.shape[:2]
    assert q.shape == k.shape == (B, T, H, K) and v.shape == (B, T, H, V)
    assert g.shape == ((B, T, H, K) if per_channel else (B, T, H)) and beta.shape == (B, T, H)
    assert {t.dtype for t in args} == {HALF}
    cu = kwargs["cu_seqlens"]
    assert B == 1 and cu.dim() == 1 and not cu.is_floating_point() and cu.device == q.device and cu.is_contiguous()
    assert cu.tolist() == cu_of(lengths).tolist()
    state = kwargs["initial_state"]
    assert state.shape == (len(lengths), H, K, V)
    if per_channel:
        assert state.dtype == torch.float32
    assert kwargs["output_final_state"] is True and kwargs["scale"] is None
    named = inspect.signature(calls.real).parameters
    unnamed = set(kwargs) - set(named)
    # fla reads A_log and dt_bias from **kwargs
    assert unnamed <= {"A_log", "dt_bias"}, f"{attr} has no parameter {sorted(unnamed)}"
