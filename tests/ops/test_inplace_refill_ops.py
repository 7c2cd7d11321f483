"""Every public boundary op called directly on a boundary tensor (``seq_idx`` or ``cu_seqlens``) that is refilled in
place between two calls: what the op keeps about the tensor (conv slots and boundary rows, SSD masks, Gated DeltaNet
masks, the ``seq_idx`` derived from ``cu_seqlens``, the value checks) must follow the write. After a forward and
backward on layout A, the tensor refilled with layout B gives what a fresh tensor of B gives, forward and every
gradient, and what the op's naive per-sample reference gives on B; a refill that breaks the contract is refused as a
fresh tensor would be.

The recurrent ops laid out by sample (linear attention, the LRU, the delta rules with initial states) read their
offsets through the host copy of ``cu_seqlens``, which on the CPU is a view of its storage: there they follow a write
whatever packfree keeps, and their cases hold the result; on CUDA the copy is real.

The model entry's side (buffers of a whole batch refilled): tests/test_inplace_refill.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from packfree_plugin.ops.conv import causal_conv1d, naive_causal_conv1d
from packfree_plugin.ops.conv import fast as conv_fast
from packfree_plugin.ops.gated_delta import (
    chunk_gated_delta_rule, chunk_gated_delta_rule_torch, chunk_kda, chunk_kda_torch, naive_gated_delta_rule,
    naive_kda,
)
from packfree_plugin.ops.linear_attention import chunk_linear_attention, naive_linear_attention
from packfree_plugin.ops.lru import linear_recurrence, naive_linear_recurrence
from packfree_plugin.ops.selective_scan import naive_selective_scan, selective_scan, selective_scan_chunked
from packfree_plugin.ops.selective_scan import fast as scan_fast
from packfree_plugin.ops.ssd import naive_ssd, ssd_chunk_scan, ssd_chunked
from tests.ops.harness import F64, assert_close, assert_same_grads, cu_seqlens_of, seq_idx_of

ROWS = {"A": [[5, 3, 8], [2, 9, 5]], "B": [[8, 1, 7], [6, 6, 4]]}
"""``seq_idx [2, 16]`` layouts: no sample start in common but the rows' (lengths around the tiny chunk sizes)."""
FLAT = {"A": [5, 3, 8, 4], "B": [2, 9, 1, 8]}
"""``cu_seqlens [5]`` layouts of one row of 20 tokens (the same sample count: the tensor keeps its shape)."""
BROKEN = {"seq_idx": [[0, 0, 1, 1, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], [0] * 16], "cu_seqlens": [0, 9, 5, 12, 20]}
"""A refill that breaks the contract: a ``seq_idx`` that goes back, ``cu_seqlens`` that decrease."""
CHUNK = 4
"""Chunk size of the ops that take one: several chunks per layout, samples across chunk borders."""


def boundary_tensor(kind: str, layout: str) -> torch.Tensor:
    """A fresh ``seq_idx [2, 16]`` int32 or ``cu_seqlens [5]`` int32 of ``layout``."""
    return seq_idx_of(ROWS[layout]) if kind == "seq_idx" else cu_seqlens_of(FLAT[layout])


def per_token_ids(kind: str, layout: str) -> torch.Tensor:
    """The ``seq_idx`` of ``layout`` for a naive reference that takes only that form (``[1, 20]`` for cu_seqlens)."""
    return seq_idx_of(ROWS[layout] if kind == "seq_idx" else [FLAT[layout]])


def _leaf(generator: torch.Generator, *shape: int, low: float | None = None, high: float | None = None,
          scale: float = 1.0) -> torch.Tensor:
    values = torch.randn(*shape, generator=generator, dtype=F64) * scale if low is None else \
        low + (high - low) * torch.rand(*shape, generator=generator, dtype=F64)
    return values.requires_grad_()


Inputs = dict[str, torch.Tensor | None]


def conv_inputs(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
    """``x [B, T, C]``, ``weight [C, K=4]``, ``bias [C]``."""
    return {"x": _leaf(generator, batch, tokens, 3), "weight": _leaf(generator, 3, 4), "bias": _leaf(generator, 3)}


def ssd_inputs(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
    """Mamba2's ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, ``B``/``C [B, T, G, N]``, ``D [H]``, ``z``,
    ``dt_bias [H]``."""
    return {"x": _leaf(generator, batch, tokens, 4, 2), "dt": _leaf(generator, batch, tokens, 4, scale=0.5),
            "A": _leaf(generator, 4, low=-1.1, high=-0.1), "B": _leaf(generator, batch, tokens, 2, 3),
            "C": _leaf(generator, batch, tokens, 2, 3), "D": _leaf(generator, 4),
            "z": _leaf(generator, batch, tokens, 4, 2), "dt_bias": _leaf(generator, 4, scale=0.5)}


def scan_inputs(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
    """Mamba1's ``u``/``delta``/``z [B, D, T]``, ``A [D, N]``, ``B``/``C [B, N, T]``, ``D``/``delta_bias [D]``."""
    return {"u": _leaf(generator, batch, 4, tokens), "delta": _leaf(generator, batch, 4, tokens, scale=0.5),
            "A": _leaf(generator, 4, 3, low=-2.1, high=-0.1), "B": _leaf(generator, batch, 3, tokens),
            "C": _leaf(generator, batch, 3, tokens), "D": _leaf(generator, 4), "z": _leaf(generator, batch, 4, tokens),
            "delta_bias": _leaf(generator, 4, scale=0.5)}


def delta_inputs(per_channel: bool, with_state: bool) -> Callable[[int, int, torch.Generator], Inputs]:
    """Gated DeltaNet (``g [1, T, H]``) or KDA (``per_channel``: ``g [1, T, H, K]``) inputs, with per-sample
    initial states ``[N, H, K, V]`` or none."""
    def build(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
        gate = (batch, tokens, 2, 4) if per_channel else (batch, tokens, 2)
        return {"q": _leaf(generator, batch, tokens, 2, 4), "k": _leaf(generator, batch, tokens, 2, 4),
                "v": _leaf(generator, batch, tokens, 2, 3), "g": _leaf(generator, *gate, low=-1.5, high=0.0),
                "beta": _leaf(generator, batch, tokens, 2, low=0.0, high=1.0),
                "initial_state": _leaf(generator, len(FLAT["A"]), 2, 4, 3) if with_state else None}

    return build


def linear_attention_inputs(with_state: bool) -> Callable[[int, int, torch.Generator], Inputs]:
    """``q``/``k [1, T, H, K]``, ``v [1, T, H, V]``, ``g [1, T, H]``, ``g_gamma [H]``, initial states or none."""
    def build(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
        return {"q": _leaf(generator, batch, tokens, 2, 4), "k": _leaf(generator, batch, tokens, 2, 4),
                "v": _leaf(generator, batch, tokens, 2, 3), "g": _leaf(generator, batch, tokens, 2, low=-1.5, high=0.0),
                "g_gamma": _leaf(generator, 2, low=-0.5, high=0.0),
                "initial_state": _leaf(generator, len(FLAT["A"]), 2, 4, 3) if with_state else None}

    return build


def recurrence_inputs(with_state: bool) -> Callable[[int, int, torch.Generator], Inputs]:
    """``a``/``b [1, T, D]`` and initial states ``[N, D]`` or none."""
    def build(batch: int, tokens: int, generator: torch.Generator) -> Inputs:
        return {"a": _leaf(generator, batch, tokens, 5, low=-1.0, high=1.0), "b": _leaf(generator, batch, tokens, 5),
                "initial_state": _leaf(generator, len(FLAT["A"]), 5) if with_state else None}

    return build


def _with_final(result: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """An op's ``(output, final state)`` as one flat tensor (both differentiated)."""
    out, final = result
    return out.flatten() if final is None else torch.cat([out.flatten(), final.flatten()])


Call = Callable[[Inputs, dict[str, torch.Tensor]], torch.Tensor]
"""``(inputs, boundary keyword) -> output``."""


@dataclass(frozen=True)
class OpCase:
    """One public op on one boundary form (``kind``): ``run`` calls it with that keyword, ``naive`` its per-sample
    reference with the same layout as ``naive_takes`` (``seq_idx``, per token, or ``cu_seqlens``); ``settings``
    pick a path (module attributes set for the test); ``validates``: the op checks the values it is given (a refill
    that breaks them is refused)."""

    kind: str
    inputs: Callable[[int, int, torch.Generator], Inputs]
    run: Call
    naive: Call
    settings: tuple[tuple[Any, str, Any], ...] = ()
    validates: bool = True
    naive_takes: str = "seq_idx"


def _conv(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
    return causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"], activation="silu", backend="torch", **bounds)


def _conv_naive(inputs: Inputs, ids: dict[str, torch.Tensor]) -> torch.Tensor:
    return naive_causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"], activation="silu", **ids)


def _ssd_options(inputs: Inputs) -> dict[str, Any]:
    return dict(D=inputs["D"], z=inputs["z"], dt_bias=inputs["dt_bias"], dt_softplus=True)


def _ssd(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
    return ssd_chunk_scan(*(inputs[n] for n in ("x", "dt", "A", "B", "C")), chunk_size=CHUNK, backend="torch",
                          **_ssd_options(inputs), **bounds)


def _ssd_fast(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
    return ssd_chunked(*(inputs[n] for n in ("x", "dt", "A", "B", "C")), chunk_size=CHUNK, **_ssd_options(inputs),
                       **bounds)


def _ssd_naive(inputs: Inputs, ids: dict[str, torch.Tensor]) -> torch.Tensor:
    return naive_ssd(*(inputs[n] for n in ("x", "dt", "A", "B", "C")), **_ssd_options(inputs), **ids)


def _scan_options(inputs: Inputs) -> dict[str, Any]:
    return dict(D=inputs["D"], z=inputs["z"], delta_bias=inputs["delta_bias"], delta_softplus=True)


def _scan(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
    return selective_scan(*(inputs[n] for n in ("u", "delta", "A", "B", "C")), **_scan_options(inputs), **bounds)


def _scan_fast(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
    return selective_scan_chunked(*(inputs[n] for n in ("u", "delta", "A", "B", "C")), **_scan_options(inputs),
                                  **bounds)


def _scan_naive(inputs: Inputs, ids: dict[str, torch.Tensor]) -> torch.Tensor:
    return naive_selective_scan(*(inputs[n] for n in ("u", "delta", "A", "B", "C")), **_scan_options(inputs), **ids)


def _recurrent(op: Callable, names: tuple[str, ...], options: tuple[str, ...] = (), **fixed: Any) -> Call:
    """A call of a recurrent op (``cu_seqlens`` only) on ``names`` positionally and ``options`` by name, returning
    its output and final state together."""
    def call(inputs: Inputs, bounds: dict[str, torch.Tensor]) -> torch.Tensor:
        return _with_final(op(*(inputs[n] for n in names), **{n: inputs[n] for n in options}, output_final_state=True,
                              **fixed, **bounds))

    return call


_DELTA = ("q", "k", "v", "g", "beta")


def _cases() -> dict[str, OpCase]:
    """Every public op that takes a boundary tensor, on each form it takes, on each path that keeps something
    different on it."""
    cases: dict[str, OpCase] = {}
    conv_paths = {"spread": (), "boundary rows": ((conv_fast, "_SPREAD_UP_TO_BYTES", 0),),
                  "dense masks": ((conv_fast, "_SPARSE_ON_CPU", False),)}
    for kind in ("seq_idx", "cu_seqlens"):
        for path, settings in conv_paths.items():
            cases[f"causal_conv1d/{kind}/{path}"] = OpCase(kind, conv_inputs, _conv, _conv_naive, settings)
        cases[f"ssd_chunk_scan/{kind}"] = OpCase(kind, ssd_inputs, _ssd, _ssd_naive)
        for path, sparse in (("sparse resets", True), ("dense resets", False)):
            cases[f"selective_scan/{kind}/{path}"] = OpCase(kind, scan_inputs, _scan, _scan_naive,
                                                            ((scan_fast, "_SPARSE_ON_CPU", sparse),))
    cases["ssd_chunked/seq_idx"] = OpCase("seq_idx", ssd_inputs, _ssd_fast, _ssd_naive, validates=False)
    cases["selective_scan_chunked/seq_idx"] = OpCase("seq_idx", scan_inputs, _scan_fast, _scan_naive, validates=False)
    for state in (False, True):
        suffix = "initial states" if state else "no initial state"  # chunks laid out by sample / by row with masks
        delta = {
            "chunk_gated_delta_rule": (chunk_gated_delta_rule, False, {"backend": "torch"}),
            "chunk_gated_delta_rule_torch": (chunk_gated_delta_rule_torch, False, {"chunk_size": CHUNK}),
            "chunk_kda": (chunk_kda, True, {"backend": "torch"}),
            "chunk_kda_torch": (chunk_kda_torch, True, {"chunk_size": CHUNK}),
        }
        for name, (op, per_channel, fixed) in delta.items():
            naive = naive_kda if per_channel else naive_gated_delta_rule
            cases[f"{name}/{suffix}"] = OpCase(
                "cu_seqlens", delta_inputs(per_channel, state), _recurrent(op, _DELTA, ("initial_state",), **fixed),
                _recurrent(naive, _DELTA, ("initial_state",)), naive_takes="cu_seqlens")
        cases[f"chunk_linear_attention/{suffix}"] = OpCase(
            "cu_seqlens", linear_attention_inputs(state),
            _recurrent(chunk_linear_attention, ("q", "k", "v", "g"), ("g_gamma", "initial_state"), chunk_size=CHUNK),
            _recurrent(naive_linear_attention, ("q", "k", "v", "g"), ("g_gamma", "initial_state")),
            naive_takes="cu_seqlens")
        cases[f"linear_recurrence/{suffix}"] = OpCase(
            "cu_seqlens", recurrence_inputs(state),
            _recurrent(linear_recurrence, ("a", "b"), ("initial_state",), chunk_size=CHUNK),
            _recurrent(naive_linear_recurrence, ("a", "b"), ("initial_state",)), naive_takes="cu_seqlens")
    return cases


CASES = _cases()
FAMILY_OPS = {"causal_conv1d", "ssd_chunk_scan", "ssd_chunked", "selective_scan", "selective_scan_chunked",
              "chunk_gated_delta_rule", "chunk_gated_delta_rule_torch", "chunk_kda", "chunk_kda_torch",
              "chunk_linear_attention", "linear_recurrence"}
"""The public ops of ``packfree_plugin.ops`` that take ``seq_idx`` or ``cu_seqlens`` (the naive references aside)."""


def _applied(case: OpCase, monkeypatch: pytest.MonkeyPatch) -> Inputs:
    """Set the case's path settings (restored after the test) and build its inputs for its boundary form."""
    for module, name, value in case.settings:
        monkeypatch.setattr(module, name, value)
    batch, tokens = (len(ROWS["A"]), sum(ROWS["A"][0])) if case.kind == "seq_idx" else (1, sum(FLAT["A"]))
    return case.inputs(batch, tokens, torch.Generator().manual_seed(0))


def _backward(out: torch.Tensor, inputs: Inputs) -> None:
    """A backward of a random projection of ``out`` into ``inputs``' leaves (what a training step runs)."""
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    torch.autograd.grad((out * weight).sum(), [t for t in inputs.values() if t is not None])


def test_every_public_boundary_op_is_covered() -> None:
    """The cases name every public op of the op families that takes a boundary tensor."""
    import inspect

    from packfree_plugin.ops import conv, gated_delta, linear_attention, lru, selective_scan as scan, ssd

    public = {name for module in (conv, gated_delta, linear_attention, lru, scan, ssd) for name in module.__all__
              if not name.startswith("naive_") and {"seq_idx", "cu_seqlens"} & set(
                  inspect.signature(getattr(module, name)).parameters)}
    assert public == FAMILY_OPS == {name.split("/")[0] for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_boundary_tensor_refilled_in_place_gives_the_new_layout(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward on layout A, the same tensor refilled with layout B: equal to a fresh tensor of B and to
    the naive reference on B, forward and every gradient."""
    case = CASES[name]
    inputs = _applied(case, monkeypatch)
    buffer = boundary_tensor(case.kind, "A")
    _backward(case.run(inputs, {case.kind: buffer}), inputs)
    buffer.copy_(boundary_tensor(case.kind, "B"))
    refilled = case.run(inputs, {case.kind: buffer})
    leaves = {key: value for key, value in inputs.items() if value is not None}
    assert_same_grads(refilled, case.run(inputs, {case.kind: boundary_tensor(case.kind, "B")}), leaves, atol=1e-12,
                      rtol=0)
    reference = {"cu_seqlens": boundary_tensor("cu_seqlens", "B")} if case.naive_takes == "cu_seqlens" else \
        {"seq_idx": per_token_ids(case.kind, "B")}
    assert_same_grads(refilled, case.naive(inputs, reference), leaves)


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if case.validates))
def test_a_refill_that_breaks_the_contract_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call on layout A, then the tensor refilled with values no fresh tensor may hold (a ``seq_idx`` that goes
    back, decreasing ``cu_seqlens``): refused, as a fresh tensor is, not run on the checks of A."""
    case = CASES[name]
    inputs = _applied(case, monkeypatch)
    buffer = boundary_tensor(case.kind, "A")
    with torch.no_grad():
        case.run(inputs, {case.kind: buffer})
        broken = torch.tensor(BROKEN[case.kind], dtype=torch.int32)
        with pytest.raises(ValueError, match="non-decreasing"):
            case.run(inputs, {case.kind: broken.clone()})
        buffer.copy_(broken)
        with pytest.raises(ValueError, match="non-decreasing"):
            case.run(inputs, {case.kind: buffer})


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_inference_boundary_tensor_refilled_in_place_gives_the_new_layout(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.inference_mode`` the boundary tensor has no version counter, so no write can be seen: an op
    called directly keeps nothing on it from one call to the next. Layout A, the tensor refilled with layout B: equal
    to a fresh tensor of B and to the naive reference on B."""
    case = CASES[name]
    inputs = _applied(case, monkeypatch)
    with torch.inference_mode():
        buffer = boundary_tensor(case.kind, "A")
        assert buffer.is_inference()
        case.run(inputs, {case.kind: buffer})
        buffer.copy_(boundary_tensor(case.kind, "B"))
        refilled = case.run(inputs, {case.kind: buffer})
        fresh = case.run(inputs, {case.kind: boundary_tensor(case.kind, "B")})
        reference = {"cu_seqlens": boundary_tensor("cu_seqlens", "B")} if case.naive_takes == "cu_seqlens" else \
            {"seq_idx": per_token_ids(case.kind, "B")}
        naive = case.naive(inputs, reference)
    assert_close(refilled, fresh, f"{name}: refilled against a fresh tensor", atol=1e-12, rtol=0)
    assert_close(refilled, naive, f"{name}: refilled against the naive reference")
