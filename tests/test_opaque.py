"""``packfree::<name>``, the custom ops compiled graphs call: for every declared boundary function, the op's
forward and its recomputing backward equal the direct call, and ``torch.library.opcheck`` accepts it (schema,
autograd registration, fake tensors with the real layout, AOT dispatch with dynamic shapes). Inputs are
non-contiguous, as transformers' layers hand them over."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from packfree_plugin.ops.family import families
import packfree_plugin.attention.interface  # noqa: F401  (registers packed attention)
from packfree_plugin.ops import opaque
from packfree_plugin.boundaries import Boundaries
from tests.conftest import assert_close

families()  # declares every family's boundary op

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
    "causal_conv1d": _conv,
    "chunk_gated_delta_rule": _delta_rule(key_decay=False),
    "chunk_kda": _delta_rule(key_decay=True),
    "ssd_chunk_scan": _ssd,
    "selective_scan": _selective_scan,
    "decay_linear_attention": _decay_linear_attention,
    "rg_lru": _rg_lru,
    "packed_attention": _attention(dropout=0.0),
    "packed_attention with dropout": _attention(dropout=0.3),
}


def _registered(case: str) -> str:
    return case.split(" with ")[0]


def test_every_declared_op_has_a_case() -> None:
    assert {_registered(case) for case in CASES} == set(opaque.declared_ops())


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_forward_and_recomputed_backward_match_the_direct_call(case: str) -> None:
    """With dropout, the seed input makes the op's forward, its recomputing backward and the direct call
    (seeded the same way) drop the same weights."""
    name = _registered(case)
    tensors, options = CASES[case]()
    wrt = [t.requires_grad_() for t in tensors if t is not None and t.is_floating_point()]
    boundaries = _boundaries()
    direct_options = {k: v for k, v in options.items() if k != "rows"}
    declared = opaque.declared(name)
    direct = declared.run(boundaries, *tensors, **direct_options)
    if direct_options.get("dropout"):
        undropped = declared.run(boundaries, *tensors, **{**direct_options, "dropout": 0.0})
        assert (direct - undropped).abs().max() > 1e-3, "dropout had no effect"
    weights = torch.randn(direct.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    expected_grads = torch.autograd.grad((direct * weights).sum(), wrt)

    rows = options.pop("rows", tensors[0].shape[:2])
    arguments = (*tensors, boundaries.host_offsets, boundaries.host_padding, *rows)
    through_op = declared.op(*arguments, **options)
    grads = torch.autograd.grad((through_op * weights).sum(), wrt)
    assert_close(through_op, direct, what=f"{name} forward")
    for index, (grad, expected) in enumerate(zip(grads, expected_grads)):
        assert_close(grad, expected, what=f"{name} gradient of input {index}")
    torch.library.opcheck(declared.op.default, arguments, options)


def test_each_op_schema_is_its_declared_signature() -> None:
    """The op's arguments are the function's tensors, the boundaries' four, then its options, keyword-only; its
    layout (where declared) names every tensor."""
    for name, declared in opaque.declared_ops().items():
        schema = declared.op.default._schema
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        keywords = [a.name for a in schema.arguments if a.kwarg_only]
        assert positional == [*declared.tensors, "host_offsets", "host_padding", "batch_size", "seq_len"], name
        assert keywords == list(declared.options), name
        assert declared.layout is None or len(declared.layout.inputs) == len(declared.tensors), name


def test_a_declaration_that_cannot_be_a_schema_is_refused() -> None:
    def unannotated(boundaries: Boundaries, x, *, scale: float) -> torch.Tensor:
        return x

    def misshaped(boundaries: Boundaries, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(KeyError):
        opaque.boundary_op("test_unannotated")(unannotated)
    with pytest.raises(ValueError, match="layout names 1 tensors"):
        opaque.boundary_op("test_misshaped", layout=opaque.Layout((opaque.TOKENS,), opaque.TOKENS))(misshaped)
    assert "test_unannotated" not in opaque.declared_ops() and "test_misshaped" not in opaque.declared_ops()


def test_attention_dropout_follows_its_seed_not_the_global_generator() -> None:
    """The compiled path's dropout is drawn from the seed the graph passes: the same seed gives the same mask
    whatever the global generator holds, another seed another mask. (Were the seed ignored, the op's forward
    and its backward's recomputation would draw different masks.)"""
    tensors, options = _attention(dropout=0.3)()
    options = {k: v for k, v in options.items() if k != "rows"}
    run = opaque.declared("packed_attention").run
    q, k, v, sinks, _ = tensors
    torch.manual_seed(1)
    first = run(_boundaries(), q, k, v, sinks, torch.tensor(1234), **options)
    torch.manual_seed(2)
    again = run(_boundaries(), q, k, v, sinks, torch.tensor(1234), **options)
    other = run(_boundaries(), q, k, v, sinks, torch.tensor(99), **options)
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3
