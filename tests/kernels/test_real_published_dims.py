"""The real fla and mamba-ssm Triton kernels at the head sizes of published models (the tiny tests use 16): fla
blocks its state by 64 along K, so K = 128 and 256 take code the tiny heads never reach; SSD's chunk of 256 with a
128-wide state is what Mamba2 checkpoints run. One head (the head count does not change the code), a packed row
whose middle sample crosses a chunk boundary, against each sample alone through packfree's float64 naive reference,
values and gradients."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import KimiLinearConfig

from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda, naive_gated_delta_rule, naive_kda
from packfree_plugin.ops.ssd import naive_ssd, ssd_chunk_scan

from .test_real_fla import close, cu_of

PUBLISHED = Path(__file__).parents[1] / "gate" / "published"


def published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.json").read_text())


QWEN35 = published("Qwen3.5-0.8B-text")
ZAMBA2 = published("Zamba2-1.2B")
KIMI = KimiLinearConfig()
DELTA_RULES = {
    # name: (packfree op, naive, K, V, per-channel decay)
    "gdn-qwen3.5-0.8b": (chunk_gated_delta_rule, naive_gated_delta_rule, QWEN35["linear_key_head_dim"],
                         QWEN35["linear_value_head_dim"], False),
    "gdn-K256": (chunk_gated_delta_rule, naive_gated_delta_rule, 256, 256, False),  # the widest fla takes
    "kda-kimi-linear": (chunk_kda, naive_kda, KIMI.linear_head_dim, KIMI.linear_head_dim, True),
}


def each_alone(naive, inputs: list[torch.Tensor], lengths: list[int], **kwargs) -> torch.Tensor:
    """The naive reference on each sample's slice, concatenated along T (dim 1)."""
    pieces = zip(*(t.split(lengths, dim=1) for t in inputs))
    return torch.cat([naive(*piece, **kwargs)[0] for piece in pieces], dim=1)


@pytest.mark.parametrize("name", list(DELTA_RULES))
def test_delta_rules_at_published_head_dims(spy, name):
    op, naive, head_k, head_v, per_channel = DELTA_RULES[name]
    calls = spy(*(("fla.ops.kda", "chunk_kda") if per_channel
                  else ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")))
    lengths = [3, 66, 5]  # fla's chunk is 64 tokens
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    raw = [torch.randn(1, T, 1, head_k, generator=gen), F.normalize(torch.randn(1, T, 1, head_k, generator=gen), dim=-1),
           torch.randn(1, T, 1, head_v, generator=gen),
           -0.8 * torch.rand(1, T, 1, *((head_k,) if per_channel else ()), generator=gen),
           torch.rand(1, T, 1, generator=gen)]
    x = [t.half().requires_grad_() for t in raw]
    out, _ = op(*x, cu_seqlens=cu_of(lengths))
    assert len(calls.calls) == 1, "the packed call did not reach fla"
    ref = [t.detach().double().requires_grad_() for t in x]
    want = each_alone(naive, ref, lengths)
    close(out, want, "output vs each sample alone", tol=1e-2)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), x)
    expected = torch.autograd.grad((want * cot).sum(), ref)
    for field, g, w in zip(("q", "k", "v", "g", "beta"), got, expected):
        close(g, w, f"grad {field} vs each sample alone", tol=3e-2)


def test_ssd_at_zamba2_dims(spy):
    """Zamba2-1.2B's Mamba2 layers: head dim 64, state 128, one group, chunks of 256."""
    calls = spy("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    P, N, G, chunk = ZAMBA2["mamba_headdim"], ZAMBA2["mamba_d_state"], ZAMBA2["mamba_ngroups"], ZAMBA2["chunk_size"]
    H = 1
    lengths = [3, chunk + 5, 2]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    x = {"x": torch.randn(1, T, H, P, generator=gen), "dt": torch.randn(1, T, H, generator=gen) - 1.0,
         "A": -torch.rand(H, generator=gen) - 0.5, "B": torch.randn(1, T, G, N, generator=gen),
         "C": torch.randn(1, T, G, N, generator=gen), "D": torch.randn(H, generator=gen),
         "dt_bias": 0.5 * torch.randn(H, generator=gen)}
    x = {n: t.requires_grad_() for n, t in x.items()}
    options = dict(dt_softplus=True, dt_limit=(0.0, math.inf))

    def run(fn, v: dict, **kwargs) -> torch.Tensor:
        return fn(v["x"], v["dt"], v["A"], v["B"], v["C"], D=v["D"], dt_bias=v["dt_bias"], **options, **kwargs)

    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].to(torch.int32)
    y = run(ssd_chunk_scan, x, chunk_size=chunk, seq_idx=seq_idx)
    assert len(calls.calls) == 1, "the packed call did not reach mamba-ssm"
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    per_token = ("x", "dt", "B", "C")
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    want = torch.cat([run(naive_ssd, {**ref, **{n: ref[n][:, a:b] for n in per_token}})
                      for a, b in zip(starts, starts[1:])], dim=1)
    close(y, want, "output vs each sample alone", tol=1e-5)
    cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((y.double() * cot).sum(), list(x.values()))
    expected = torch.autograd.grad((want * cot).sum(), list(ref.values()))
    for field, g, w in zip(x, got, expected):
        close(g, w, f"grad {field} vs each sample alone", tol=1e-4)
