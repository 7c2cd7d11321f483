"""``packfree::boundary_function``, the custom op compiled graphs call: for every registered function, the op's
forward and its recomputing backward equal the direct call, and ``torch.library.opcheck`` accepts it (schema,
autograd registration, fake tensors with the real layout, AOT dispatch with dynamic shapes). Inputs are
non-contiguous, as transformers' layers hand them over."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import packfree_plugin.adapters.native_forwards  # noqa: F401  (registers the inline-recurrence functions)
import packfree_plugin.adapters.routes  # noqa: F401  (registers the mixer functions)
import packfree_plugin.attention.interface  # noqa: F401  (registers packed attention)
from packfree_plugin.ops import opaque
from packfree_plugin.boundaries import Boundaries
from tests.conftest import assert_close

B, T = 2, 10
F64 = torch.float64


def _boundaries() -> Boundaries:
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], list(range(T))])
    return Boundaries.from_position_ids(positions)


def _randn(*shape: int, seed: int, transpose: tuple[int, int] | None = None) -> torch.Tensor:
    """Random float64 tensor of ``shape``; with ``transpose``, a non-contiguous view of that shape."""
    generator = torch.Generator().manual_seed(seed)
    if transpose is None:
        return torch.randn(*shape, generator=generator, dtype=F64)
    a, b = transpose
    swapped = list(shape)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    return torch.randn(*swapped, generator=generator, dtype=F64).transpose(a, b)


def _conv() -> tuple[tuple, dict]:
    return (_randn(B, T, 8, seed=0, transpose=(1, 2)), _randn(8, 4, seed=1), _randn(8, seed=2)), dict(
        activation="silu")


def _delta_rule(key_decay: bool) -> Callable[[], tuple[tuple, dict]]:
    def build() -> tuple[tuple, dict]:
        q, k, v = (_randn(B, T, 2, 8, seed=s, transpose=(1, 2)) for s in (0, 1, 2))
        g = F.logsigmoid(_randn(B, T, 2, *((8,) if key_decay else ()), seed=3))
        beta = torch.sigmoid(_randn(B, T, 2, seed=4))
        return (q, k, v, g, beta), dict(scale=None, use_qk_l2norm_in_kernel=True)

    return build


def _ssd() -> tuple[tuple, dict]:
    x = _randn(B, T, 2, 4, seed=0, transpose=(1, 2))
    dt, A = _randn(B, T, 2, seed=1), -torch.rand(2, dtype=F64) - 0.5
    b, c = _randn(B, T, 1, 4, seed=2), _randn(B, T, 1, 4, seed=3)
    return (x, dt, A, b, c, _randn(2, seed=4), None, _randn(2, seed=5)), dict(
        chunk_size=4, dt_softplus=True, dt_limit=[0.0, float("inf")])


def _selective_scan() -> tuple[tuple, dict]:
    u, delta = _randn(B, 4, T, seed=0, transpose=(1, 2)), _randn(B, 4, T, seed=1)
    A = -torch.rand(4, 3, dtype=F64) - 0.5
    b, c = _randn(B, 3, T, seed=2), _randn(B, 3, T, seed=3)
    return (u, delta, A, b, c, _randn(4, seed=4), _randn(B, 4, T, seed=5), _randn(4, seed=6)), dict(
        delta_softplus=True, rows=(B, T))


def _decay_linear_attention() -> tuple[tuple, dict]:
    q, k, v = (_randn(B, T, 2, 4, seed=s, transpose=(1, 2)) for s in (0, 1, 2))
    return (q, k, v, -torch.rand(2, dtype=F64)), dict(scale=1.0)


def _rg_lru() -> tuple[tuple, dict]:
    x = _randn(B, T, 6, seed=0, transpose=(0, 1))
    input_gate = torch.sigmoid(_randn(B, T, 6, seed=1))
    log_decay = -8.0 * torch.sigmoid(_randn(B, T, 6, seed=2)) * F.softplus(_randn(6, seed=3))
    return (x, input_gate, log_decay), {}


def _attention(dropout: float) -> Callable[[], tuple[tuple, dict]]:
    def build() -> tuple[tuple, dict]:
        q = _randn(B, 4, T, 8, seed=0, transpose=(1, 2))
        k, v = _randn(B, 2, T, 8, seed=1, transpose=(1, 2)), _randn(B, 2, T, 8, seed=2)
        if dropout:  # SDPA takes no sinks or softcap together with dropout on the portable path's blocks
            return (q, k, v, None, torch.tensor(1234)), dict(scale=0.3, causal=True, window=None, softcap=None,
                                                             dropout=dropout, chunk=None, training=True, backend=None,
                                                             rows=(B, T))
        return (q, k, v, _randn(4, seed=3), None), dict(scale=0.3, causal=True, window=3, softcap=2.0, dropout=0.0,
                                                        chunk=None, training=True, backend=None, rows=(B, T))

    return build


CASES = {
    "packfree.causal_conv1d": _conv,
    "packfree.chunk_gated_delta_rule": _delta_rule(key_decay=False),
    "packfree.chunk_kda": _delta_rule(key_decay=True),
    "packfree.ssd_chunk_scan": _ssd,
    "packfree.selective_scan": _selective_scan,
    "packfree.decay_linear_attention": _decay_linear_attention,
    "packfree.rg_lru": _rg_lru,
    "packfree.packed_attention": _attention(dropout=0.0),
    "packfree.packed_attention with dropout": _attention(dropout=0.3),
}


def _registered(case: str) -> str:
    return case.split(" with ")[0]


def test_every_registered_function_has_a_case() -> None:
    assert {_registered(case) for case in CASES} == set(opaque._FUNCTIONS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_forward_and_recomputed_backward_match_the_direct_call(case: str) -> None:
    """With dropout, the seed input makes the op's forward, its recomputing backward and the direct call
    (seeded the same way) drop the same weights."""
    name = _registered(case)
    tensors, options = CASES[case]()
    wrt = [t.requires_grad_() for t in tensors if t is not None and t.is_floating_point()]
    boundaries = _boundaries()
    direct_options = {k: v for k, v in options.items() if k != "rows"}
    direct = opaque._FUNCTIONS[name].run(boundaries, *tensors, **direct_options)
    if direct_options.get("dropout"):
        undropped = opaque._FUNCTIONS[name].run(boundaries, *tensors, **{**direct_options, "dropout": 0.0})
        assert (direct - undropped).abs().max() > 1e-3, "dropout had no effect"
    weights = torch.randn(direct.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    expected_grads = torch.autograd.grad((direct * weights).sum(), wrt)

    arguments = opaque.op_arguments(name, boundaries, *tensors, **options)
    through_op = torch.ops.packfree.boundary_function(*arguments)
    grads = torch.autograd.grad((through_op * weights).sum(), wrt)
    assert_close(through_op, direct, what=f"{name} forward")
    for index, (grad, expected) in enumerate(zip(grads, expected_grads)):
        assert_close(grad, expected, what=f"{name} gradient of input {index}")
    torch.library.opcheck(torch.ops.packfree.boundary_function.default, arguments)


def test_options_round_trip_through_the_encoding() -> None:
    options = dict(a=None, b=True, c=3, d=-1.5, e="silu", f=[0.0, float("inf"), -float("inf")], g=(1, 2))
    _, _, _, _, _, _, encoded = opaque.op_arguments("packfree.causal_conv1d", _boundaries(), torch.zeros(B, T),
                                                    None, **options)
    tensors, decoded = opaque._decode([torch.zeros(B, T), torch.zeros(0)], encoded)
    assert decoded == options and tensors[1] is None


def test_attention_dropout_follows_its_seed_not_the_global_generator() -> None:
    """The compiled path's dropout is drawn from the seed the graph passes: the same seed gives the same mask
    whatever the global generator holds, another seed another mask. (Were the seed ignored, the op's forward
    and its backward's recomputation would draw different masks.)"""
    tensors, options = _attention(dropout=0.3)()
    options = {k: v for k, v in options.items() if k != "rows"}
    run = opaque._FUNCTIONS["packfree.packed_attention"].run
    q, k, v, sinks, _ = tensors
    torch.manual_seed(1)
    first = run(_boundaries(), q, k, v, sinks, torch.tensor(1234), **options)
    torch.manual_seed(2)
    again = run(_boundaries(), q, k, v, sinks, torch.tensor(1234), **options)
    other = run(_boundaries(), q, k, v, sinks, torch.tensor(99), **options)
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3
