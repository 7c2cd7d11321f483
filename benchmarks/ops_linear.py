"""Packed vs per-sample vs unsplit cost of the boundary-aware recurrent ops (CPU, float32, forward + backward).

For each family one packed row of 4096 tokens in 16 samples of skewed lengths (not chunk-aligned):

* ``packed_ms``: one call with ``cu_seqlens`` (what packfree runs);
* ``per_sample_ms``: a Python loop calling the same op once per sample (the obvious exact alternative);
* ``unsplit_ms``: one call on the whole row ignoring boundaries (wrong, but the cost floor to compare with).

Targets: packed <= 0.8x per-sample and <= 1.3x unsplit. ``python benchmarks/ops_linear.py [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda
from packfree_plugin.ops.linear_attention import chunk_linear_attention
from packfree_plugin.ops.lru import linear_recurrence

# 16 samples, 4096 tokens, one long sample and a tail of short ones, none a multiple of 64.
LENGTHS = [1400, 610, 415, 333, 270, 201, 170, 150, 130, 111, 97, 77, 60, 40, 25, 7]
assert sum(LENGTHS) == 4096


def _inputs(family: str, T: int, gen: torch.Generator) -> tuple[list[torch.Tensor], dict]:
    f32 = torch.float32

    def r(*shape, lo=None, hi=None):
        if lo is None:
            return torch.randn(*shape, generator=gen, dtype=f32).requires_grad_()
        return (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=f32)).requires_grad_()

    if family in ("gated_delta", "kda"):
        H, K, V = 8, 128, 128
        g = r(1, T, H, K, lo=-0.1, hi=0.0) if family == "kda" else r(1, T, H, lo=-0.1, hi=0.0)
        return [r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), g, r(1, T, H, lo=0.0, hi=1.0)], {
            "use_qk_l2norm_in_kernel": True}
    if family == "linear_attention":  # MiniMax lightning attention shape: constant per-head decay, scale 1
        H, K, V = 8, 128, 128
        slope = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)])
        return [r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)], {"g_gamma": -slope, "scale": 1.0}
    if family == "lru":  # recurrent_gemma-2b lru_width
        D = 2560
        return [r(1, T, D, lo=0.5, hi=1.0), r(1, T, D)], {}
    raise ValueError(family)


OPS = {
    "gated_delta": chunk_gated_delta_rule,
    "kda": chunk_kda,
    "linear_attention": chunk_linear_attention,
    "lru": linear_recurrence,
}


def _fwd_bwd(op, tensors, opts, cu=None):
    out, _ = op(*tensors, cu_seqlens=cu, **opts)
    out.backward(torch.ones_like(out))


def _time_interleaved(fns: list, repeats: int) -> list[float]:
    """Median ms of each fn; the fns take turns so that they all see the same machine load."""
    for fn in fns:
        fn()  # warm-up (also builds and caches the chunk layout, as every later layer of a model would reuse it)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def run(quick: bool = False, threads: int = 1) -> list[dict]:
    """One row per family: tokens, samples, packed/per-sample/unsplit ms (median) and the two ratios.

    Runs with ``threads`` intra-op threads (restored afterwards): on a shared CPU, multi-threaded parallel
    regions swing by orders of magnitude with other tenants' load, which would drown the comparison.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(3 if quick else 7)
    finally:
        torch.set_num_threads(previous)


def _run(repeats: int) -> list[dict]:
    offsets = [0]
    for n in LENGTHS:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    T = offsets[-1]
    rows = []
    for family, op in OPS.items():
        tensors, opts = _inputs(family, T, torch.Generator().manual_seed(0))

        def packed():
            _fwd_bwd(op, tensors, opts, cu)

        def per_sample():
            for i in range(len(LENGTHS)):
                _fwd_bwd(op, [t[:, offsets[i] : offsets[i + 1]] for t in tensors], opts)

        def unsplit():
            _fwd_bwd(op, tensors, opts)

        p, s, u = _time_interleaved([packed, per_sample, unsplit], repeats)
        rows.append({
            "family": family,
            "tokens": T,
            "samples": len(LENGTHS),
            "packed_ms": round(p, 1),
            "per_sample_ms": round(s, 1),
            "unsplit_ms": round(u, 1),
            "ratio_vs_per_sample": round(p / s, 2),
            "ratio_vs_unsplit": round(p / u, 2),
        })
    return rows


def to_markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"torch {torch.__version__}, 1 thread, float32, CPU, fwd+bwd, median")
    print(to_markdown(run(quick="--quick" in sys.argv)))
