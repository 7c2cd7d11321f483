"""Packed vs per-sample vs unsplit cost of the boundary-aware conv / SSD / selective-scan ops.

One row per family, forward + backward, float32 on the CPU (2 threads), median of interleaved
repeats:

* ``packed``: the public op on one packed row with ``cu_seqlens`` (boundaries honoured);
* ``per_sample``: the same op called once per sample (no boundaries), outputs concatenated, i.e.
  what you run without packing when you still want every sample exact and unpadded;
* ``unsplit``: the same op on the same row with no boundaries at all (a single sequence): the
  price floor of the kernel, so ``ratio_vs_unsplit`` is the overhead of honouring boundaries.

Sample lengths are skewed (seeded log-normal, a few long samples and many short ones) and listed
in the output. Run ``python benchmarks/ops_scan_conv.py`` for a Markdown table.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from packfree_plugin.ops.conv import causal_conv1d
from packfree_plugin.ops.selective_scan import selective_scan
from packfree_plugin.ops.ssd import ssd_chunk_scan

THREADS = 2


def skewed_lengths(tokens: int, samples: int, seed: int = 0) -> list[int]:
    """``samples`` log-normal (sigma 1) lengths >= 1 summing to ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(samples, generator=gen, dtype=torch.float64))
    lengths = [max(1, int(v)) for v in (raw / raw.sum() * tokens).tolist()]
    lengths[int(torch.tensor(lengths).argmax())] += tokens - sum(lengths)
    return lengths


_CLOCK = time.perf_counter


def _median_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for fn in fns.values():  # warm-up (allocator, first-call dispatch)
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):  # interleaved, so background load hits every variant alike
        for k, fn in fns.items():
            t0 = _CLOCK()
            fn()
            times[k].append(_CLOCK() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _fwd_bwd(make_out: Callable[[], torch.Tensor], inputs: list[torch.Tensor], cot: torch.Tensor):
    def run() -> None:
        torch.autograd.grad(make_out(), inputs, cot)

    return run


def _row(family: str, lengths: list[int], ms: dict[str, float], config: str) -> dict:
    return dict(
        family=family, tokens=sum(lengths), samples=len(lengths), config=config,
        packed_ms=round(ms["packed"], 1), per_sample_ms=round(ms["per_sample"], 1),
        unsplit_ms=round(ms["unsplit"], 1),
        ratio_vs_per_sample=round(ms["packed"] / ms["per_sample"], 3),
        ratio_vs_unsplit=round(ms["packed"] / ms["unsplit"], 3),
    )


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def bench_conv(lengths: list[int], repeats: int, C: int = 1024, K: int = 4) -> dict:
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, C, generator=gen).requires_grad_()
    w = torch.randn(C, K, generator=gen).requires_grad_()
    b = torch.randn(C, generator=gen).requires_grad_()
    cot = torch.randn(1, T, C, generator=gen)
    cu = _cu(lengths)
    ins = [x, w, b]

    def conv(xs, **kw):
        return causal_conv1d(xs, w, b, activation="silu", **kw)

    ms = _median_ms({
        "packed": _fwd_bwd(lambda: conv(x, cu_seqlens=cu), ins, cot),
        "per_sample": _fwd_bwd(lambda: torch.cat([conv(p) for p in x.split(lengths, 1)], 1), ins, cot),
        "unsplit": _fwd_bwd(lambda: conv(x), ins, cot),
    }, repeats)
    return _row("conv (causal depthwise, silu)", lengths, ms, f"C={C}, K={K}")


def bench_ssd(lengths: list[int], repeats: int, H: int = 16, P: int = 64, G: int = 1, N: int = 64,
              chunk: int = 64) -> dict:
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, P, generator=gen).requires_grad_()
    dt = torch.randn(1, T, H, generator=gen).requires_grad_()
    A = (-torch.rand(H, generator=gen) * 8 - 0.5).requires_grad_()
    B = torch.randn(1, T, G, N, generator=gen).requires_grad_()
    C = torch.randn(1, T, G, N, generator=gen).requires_grad_()
    D = torch.randn(H, generator=gen).requires_grad_()
    dt_bias = torch.randn(H, generator=gen).requires_grad_()
    z = torch.randn(1, T, H, P, generator=gen).requires_grad_()
    cot = torch.randn(1, T, H, P, generator=gen)
    cu = _cu(lengths)
    ins = [x, dt, A, B, C, D, dt_bias, z]

    def ssd(xs, dts, Bs, Cs, zs, **kw):
        return ssd_chunk_scan(xs, dts, A, Bs, Cs, chunk_size=chunk, D=D, z=zs, dt_bias=dt_bias,
                              dt_softplus=True, **kw)

    def per_sample():
        parts = zip(*(t.split(lengths, 1) for t in (x, dt, B, C, z)))
        return torch.cat([ssd(*p) for p in parts], 1)

    ms = _median_ms({
        "packed": _fwd_bwd(lambda: ssd(x, dt, B, C, z, cu_seqlens=cu), ins, cot),
        "per_sample": _fwd_bwd(per_sample, ins, cot),
        "unsplit": _fwd_bwd(lambda: ssd(x, dt, B, C, z), ins, cot),
    }, repeats)
    return _row("ssd (Mamba2)", lengths, ms, f"H={H}, P={P}, G={G}, N={N}, chunk={chunk}")


def bench_selective_scan(lengths: list[int], repeats: int, Dm: int = 512, N: int = 16) -> dict:
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(1, Dm, T, generator=gen).requires_grad_()
    delta = torch.randn(1, Dm, T, generator=gen).requires_grad_()
    A = (-torch.arange(1, N + 1, dtype=torch.float32).repeat(Dm, 1)).requires_grad_()  # Mamba init
    B = torch.randn(1, N, T, generator=gen).requires_grad_()
    C = torch.randn(1, N, T, generator=gen).requires_grad_()
    D = torch.randn(Dm, generator=gen).requires_grad_()
    delta_bias = (torch.rand(Dm, generator=gen) * -4).requires_grad_()
    z = torch.randn(1, Dm, T, generator=gen).requires_grad_()
    cot = torch.randn(1, Dm, T, generator=gen)
    cu = _cu(lengths)
    ins = [u, delta, A, B, C, D, delta_bias, z]

    def scan(us, ds, Bs, Cs, zs, **kw):
        return selective_scan(us, ds, A, Bs, Cs, D=D, z=zs, delta_bias=delta_bias, delta_softplus=True, **kw)

    def per_sample():
        parts = zip(*(t.split(lengths, 2) for t in (u, delta, B, C, z)))
        return torch.cat([scan(*p) for p in parts], 2)

    ms = _median_ms({
        "packed": _fwd_bwd(lambda: scan(u, delta, B, C, z, cu_seqlens=cu), ins, cot),
        "per_sample": _fwd_bwd(per_sample, ins, cot),
        "unsplit": _fwd_bwd(lambda: scan(u, delta, B, C, z), ins, cot),
    }, repeats)
    return _row("selective_scan (Mamba1)", lengths, ms, f"D={Dm}, N={N}")


def run(quick: bool = False, *, threads: int = THREADS, clock: str = "wall") -> list[dict]:
    """One row per family (fwd+bwd, float32, CPU). ``quick``: 1024 tokens, 1 repeat (smoke test).

    ``clock="wall"`` (the reported figure) or ``"thread_cpu"`` (CPU time of the calling thread;
    with ``threads=1`` it is insensitive to other processes competing for the cores).
    """
    global _CLOCK
    saved = torch.get_num_threads(), _CLOCK
    torch.set_num_threads(threads)
    _CLOCK = {"wall": time.perf_counter, "thread_cpu": time.thread_time}[clock]
    try:
        tokens, samples, repeats = (1024, 16, 1) if quick else (4096, 24, 9)
        lengths = skewed_lengths(tokens, samples)
        rows = [bench_conv(lengths, repeats), bench_ssd(lengths, repeats),
                bench_selective_scan(lengths, max(1, repeats - 4))]
        for row in rows:
            row.update(lengths=lengths, threads=threads, clock=clock,
                       load_avg=round(os.getloadavg()[0], 2))
        return rows
    finally:
        torch.set_num_threads(saved[0])
        _CLOCK = saved[1]


def markdown(rows: list[dict]) -> str:
    cols = ["family", "config", "tokens", "samples", "packed_ms", "per_sample_ms", "unsplit_ms",
            "ratio_vs_per_sample", "ratio_vs_unsplit"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    r0 = rows[0]
    lines.append("")
    lines.append(f"sample lengths: {r0['lengths']}")
    lines.append(f"fwd+bwd, float32, CPU, {r0['threads']} thread(s), {r0['clock']} clock, median; "
                 f"1-min load average at the end: {r0['load_avg']}. "
                 "Targets: ratio_vs_per_sample <= 0.8, ratio_vs_unsplit <= 1.3.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(run()))
    print()
    print("Same, one thread, CPU time of the calling thread (robust to other load on the machine):")
    print()
    print(markdown(run(threads=1, clock="thread_cpu")))
