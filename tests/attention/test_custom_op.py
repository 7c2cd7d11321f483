"""``packfree::segment_attention``: the compile-time form of the portable path."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.attention.segments import segment_attention, segment_attention_op
from packfree_plugin.boundaries import Boundaries
from tests.conftest import assert_close, build_pair


def _inputs(lengths: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    seq_len = sum(lengths)
    q = torch.randn(1, 4, seq_len, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, seq_len, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, seq_len, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    return q, k, v, Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in lengths])[None])


def test_op_forward_and_recomputed_backward_match_the_direct_path() -> None:
    q, k, v, boundaries = _inputs([4, 7, 2])
    sinks = torch.tensor([0.5, -0.2, 0.1, 0.0], dtype=torch.float64, requires_grad=True)
    options = AttentionOptions(scale=0.3, causal=True, window=3, softcap=2.0, sinks=sinks)
    direct = segment_attention(q, k, v, boundaries, options)
    grads_direct = torch.autograd.grad(direct.square().sum(), (q, k, v, sinks))
    through_op = segment_attention_op(q, k, v, boundaries.host_offsets, boundaries.host_padding, sinks, 0.3, True, 3, 2.0)
    grads_op = torch.autograd.grad(through_op.square().sum(), (q, k, v, sinks))
    assert_close(through_op, direct)
    for a, b in zip(grads_op, grads_direct):
        assert_close(a, b)
    torch.library.opcheck(segment_attention_op, (q, k, v, boundaries.host_offsets, boundaries.host_padding, sinks,
                                                 0.3, True, 3, 2.0))


def test_compiled_model_does_not_recompile_when_the_packing_changes() -> None:
    model, _ = build_pair("llama")
    compiled = torch.compile(model, backend="eager")
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for lengths in ([8, 12], [5, 15], [11, 9], [2, 18]):
        ids = torch.randint(3, 128, (1, 20), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        with torch.no_grad():
            assert_close(compiled(input_ids=ids, position_ids=positions).logits,
                         model(input_ids=ids, position_ids=positions).logits, what=str(lengths))
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 3, f"graphs compiled after each new packing: {graphs}"
