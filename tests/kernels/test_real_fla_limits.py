"""A head dim fla refuses with an assert (K > 256): the auto route keeps it on packfree's torch path, and
backend="kernel" names the limit in a ValueError."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda, naive_gated_delta_rule, naive_kda

from .test_real_fla import as_float64, close, cu_of

OPS = {"gdn": (chunk_gated_delta_rule, naive_gated_delta_rule, False), "kda": (chunk_kda, naive_kda, True)}
SHAPES = {"K-272": (272, 16)}
"""(K, V): fla's forward asserts K <= 256."""


def _inputs(lengths: list[int], head_k: int, head_v: int, per_channel: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    T, H = sum(lengths), 2
    decay = (1, T, H, head_k) if per_channel else (1, T, H)
    x = {"q": torch.randn(1, T, H, head_k, generator=gen),
         "k": torch.nn.functional.normalize(torch.randn(1, T, H, head_k, generator=gen), dim=-1),
         "v": torch.randn(1, T, H, head_v, generator=gen), "g": -0.8 * torch.rand(*decay, generator=gen),
         "beta": torch.rand(1, T, H, generator=gen)}
    return {n: t.half().requires_grad_() for n, t in x.items()}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", list(OPS))
def test_head_dims_fla_refuses_take_the_torch_path(spy, family, shape):
    op, naive, per_channel = OPS[family]
    kernel = ("fla.ops.kda", "chunk_kda") if per_channel else ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    calls = spy(*kernel)
    lengths = [3, 5]
    x = _inputs(lengths, *SHAPES[shape], per_channel)
    o, _ = op(*x.values(), cu_seqlens=cu_of(lengths))
    assert calls.calls == []
    ref = as_float64(x)
    ro, _ = naive(*ref.values(), cu_seqlens=cu_of(lengths))
    close(o, ro, "output", tol=1e-2)
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, g, w in zip(x, torch.autograd.grad((o.double() * cot).sum(), list(x.values())),
                          torch.autograd.grad((ro * cot).sum(), list(ref.values()))):
        close(g, w, f"grad {name}", tol=2e-2)
    with pytest.raises(ValueError, match="fla"):
        op(*x.values(), cu_seqlens=cu_of(lengths), backend="kernel")
