"""Short samples: a packed row of 16 samples of 4-32 tokens against the same tokens as one unsplit sequence.

For Gated DeltaNet, Mamba2 SSD and the short causal conv, at real width (Qwen3.5-0.8B, mamba2-370m, LFM2-350M)
and at a tiny width where per-call overhead shows, forward + backward in float32 on one CPU thread:

- ``x stock unsplit``: packfree's packed row / stock transformers' own torch function on the same tokens as one
  sequence (``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ``causal_conv1d_fn``): what packing costs
  against the unpacked model (target <= 1.1);
- ``x packfree unsplit``: packed / packfree's op on the same row without boundaries: the price of the boundaries.

Boundaries sit inside chunks (no chunk per sample), so the packed row does the unsplit row's dense work.

Per-forward overhead: tiny models (``packfree_plugin.cli.tiny``), one forward of a 64-token row packed from 4 samples
under packfree against stock on one 64-token sample (``x stock``, target <= 1.2), attention-only and hybrid, in
this thread's CPU time. Median of interleaved repeats, every ratio from one run.
``python -m benchmarks.short_samples [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Iterator

import torch

SAMPLES = 16


def short_lengths(seed: int = 0) -> list[int]:
    """16 lengths drawn uniformly from 4..32."""
    return torch.randint(4, 33, (SAMPLES,), generator=torch.Generator().manual_seed(seed)).tolist()


def _median_ms(fns: dict[str, Callable[[], None]], repeats: int,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median milliseconds of every function over ``repeats`` interleaved runs (after one warm-up run each), so
    that a disturbance on the shared machine hits all of them alike. ``clock``: ``time.thread_time`` counts only
    this thread's CPU time (one-thread runs of a millisecond or so, which other processes would otherwise skew)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = clock()
            fn()
            times[k].append(clock() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _gdn(T: int, cu: torch.Tensor, H: int, K: int) -> dict[str, Callable[[], None]]:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).requires_grad_() for _ in range(3))
    g = (-torch.rand(1, T, H, generator=gen)).requires_grad_()
    beta = torch.rand(1, T, H, generator=gen).requires_grad_()

    def ours(bounds):
        return lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                              cu_seqlens=bounds)[0].sum().backward()

    def stock():
        torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].sum().backward()

    return {"packed": ours(cu), "packfree unsplit": ours(None), "stock unsplit": stock}


def _ssd(T: int, seq: torch.Tensor, H: int, P: int, N: int, chunk: int) -> dict[str, Callable[[], None]]:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    from packfree_plugin.ops.ssd import ssd_chunk_scan

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, P, generator=gen).requires_grad_()
    dt = torch.randn(1, T, H, generator=gen).requires_grad_()
    A = -torch.arange(1.0, H + 1)
    B, C = (torch.randn(1, T, 1, N, generator=gen).requires_grad_() for _ in range(2))
    D = torch.ones(H)

    def ours(bounds):
        return lambda: ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_softplus=True,
                                      seq_idx=bounds).sum().backward()

    def stock():
        mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_softplus=True).sum().backward()

    return {"packed": ours(seq), "packfree unsplit": ours(None), "stock unsplit": stock}


def _conv(T: int, seq: torch.Tensor, channels: int, K: int) -> dict[str, Callable[[], None]]:
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn

    from packfree_plugin.ops.conv import causal_conv1d

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, channels, generator=gen).requires_grad_()
    w = torch.randn(channels, K, generator=gen).requires_grad_()

    def ours(bounds):
        return lambda: causal_conv1d(x, w, None, activation="silu", seq_idx=bounds).sum().backward()

    def stock():
        causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").sum().backward()

    return {"packed": ours(seq), "packfree unsplit": ours(None), "stock unsplit": stock}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def overhead_rows(quick: bool = False) -> list[dict]:
    """One forward, tiny width: packfree on 64 tokens packed from 4 samples vs stock on one 64-token sample, on one
    torch thread (timed in this thread's CPU time, which a pool thread's work would escape)."""
    with _one_thread():
        return _overhead_rows(quick)


def _overhead_rows(quick: bool) -> list[dict]:
    from transformers import AutoModelForCausalLM

    import packfree_plugin
    from packfree_plugin.cli.tiny import tiny_config

    packfree_plugin.register()
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).repeat(4)[None]
    rows = []
    for model_type in ("llama", "qwen3_next", "mamba2", "lfm2"):
        models = {}
        for implementation in ("packfree", "sdpa"):
            torch.manual_seed(0)
            try:
                models[implementation] = AutoModelForCausalLM.from_config(
                    tiny_config(model_type), attn_implementation=implementation).eval()
            except ValueError:  # attention-free model: stock has no sdpa
                models[implementation] = AutoModelForCausalLM.from_config(
                    tiny_config(model_type), attn_implementation="eager").eval()

        def forward(model, **inputs) -> Callable[[], None]:
            def call() -> None:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False, **inputs)
            return call

        ms = _median_ms({"packed": forward(models["packfree"], position_ids=positions),
                         "stock": forward(models["sdpa"])}, repeats=20 if quick else 300, clock=time.thread_time)
        rows.append({"op": f"forward overhead, tiny {model_type}", "tokens": 64, "samples": 4,
                     "packed ms": ms["packed"], "x stock unsplit": ms["packed"] / ms["stock"],
                     "x packfree unsplit": None})
    return rows


def run(quick: bool = False) -> list[dict]:
    with _one_thread():
        return _op_rows(quick) + overhead_rows(quick)


def _op_rows(quick: bool) -> list[dict]:
    lengths = short_lengths()
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(SAMPLES, dtype=torch.int32), torch.tensor(lengths))[None]
    cases = {
        "Gated DeltaNet, Qwen3.5-0.8B width (H=16, K=V=128)": lambda: _gdn(T, cu, 16, 128),
        "Gated DeltaNet, tiny (H=2, K=V=16)": lambda: _gdn(T, cu, 2, 16),
        "Mamba2 SSD, mamba2-370m width (H=32, P=64, N=128, chunk 256)": lambda: _ssd(T, seq, 32, 64, 128, 256),
        "Mamba2 SSD, tiny (H=4, P=16, N=16, chunk 64)": lambda: _ssd(T, seq, 4, 16, 16, 64),
        "short conv, LFM2-350M width (C=1024, K=3)": lambda: _conv(T, seq, 1024, 3),
        "short conv, tiny (C=64, K=4)": lambda: _conv(T, seq, 64, 4),
    }
    rows = []
    for name, make in cases.items():
        ms = _median_ms(make(), repeats=3 if quick else 15)
        rows.append({"op": name, "tokens": T, "samples": SAMPLES, "packed ms": ms["packed"],
                     "x stock unsplit": ms["packed"] / ms["stock unsplit"],
                     "x packfree unsplit": ms["packed"] / ms["packfree unsplit"]})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| op | tokens (samples) | packed ms | × stock unsplit | × packfree unsplit |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        unsplit = "-" if r["x packfree unsplit"] is None else f"{r['x packfree unsplit']:.2f}"
        lines.append(f"| {r['op']} | {r['tokens']} ({r['samples']}) | {r['packed ms']:.2f} | "
                     f"{r['x stock unsplit']:.2f} | {unsplit} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(markdown(run(quick=parser.parse_args().quick)))
