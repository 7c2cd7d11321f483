"""Real sizes: five models at their published widths (layers cut to fit 24 GiB and 2 CPU cores), packfree
against stock transformers on the same weights, float32, CPU.

Per model, three figures a user decides on:

- **step**: one training step (forward + backward) on 16 samples of skewed lengths, 2,048 tokens in all:
  packfree on one packed row against stock ``sdpa`` on the same samples padded to the longest; seconds
  (median) and peak extra resident memory (MiB above the process after the model was built);
- **per layer**: peak extra memory of one more mixer layer (Mamba2 / Gated DeltaNet layers only, depth 1
  against depth 3, small vocabulary so the head cancels), packfree's packed row against stock's torch path
  on the same 2,048 tokens as one unsplit sequence;
- **precision**: float32 error of the logits against a float64 reference on 4 samples of 1,200 tokens in all,
  for packfree's packed row and for stock's own float32 run of each sample alone. The reference is packfree's
  packed row in float64: stock's torch paths run the Mamba2 and Gated DeltaNet scans in float32 even in a
  float64 model, while packfree's ops keep float64 (``tests/ops`` check them against per-sample references).

Depths are cut to fit 2 shared CPU cores (the step's depth, then the precision check's: 12 layers of mamba2-370m,
4 of Qwen3.5-0.8B). Widths are those of the published configs (Qwen3-0.6B, Qwen3.5-0.8B, mamba2-370m, LFM2-350M,
ModernBERT-base); weights are random (``from_config``), which changes no shape and no cost. Every case runs
in its own subprocess (its own peak memory). ``python -m benchmarks.real_sizes [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

TOKENS = 2048
SAMPLES = 16
PRECISION_LENGTHS = (300, 180, 420, 300)


@dataclass(frozen=True)
class Spec:
    """A published model: its type, width (config keywords), how many layers the benchmark keeps."""

    model_type: str
    config: dict[str, Any]
    layers: int  # the training step's depth (time on 2 shared cores)
    published_layers: int
    precision_layers: int
    layer_pattern: tuple[str, ...] = ()
    mixer: str | None = None  # layer type of its recurrent mixer (per-layer memory), None: no mixer row
    masked_lm: bool = False
    stock: str = "sdpa"  # stock's attention implementation ("eager" for attention-free models)


MODELS: dict[str, Spec] = {
    "Qwen3-0.6B": Spec("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                     tie_word_embeddings=True, rope_theta=1e6), layers=2, published_layers=28,
                       precision_layers=4),
    "Qwen3.5-0.8B": Spec("qwen3_5_text", dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                              linear_num_value_heads=16, linear_key_head_dim=128,
                                              linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                              vocab_size=248320, tie_word_embeddings=True),
                         layers=4, published_layers=24, precision_layers=4,
                         layer_pattern=("linear_attention",) * 3 + ("full_attention",), mixer="linear_attention"),
    "mamba2-370m": Spec("mamba2", dict(hidden_size=1024, num_heads=32, head_dim=64, state_size=128, n_groups=1,
                                       expand=2, conv_kernel=4, chunk_size=256, vocab_size=50288,
                                       tie_word_embeddings=True), layers=4, published_layers=48, precision_layers=12,
                        mixer="mamba2",
                        stock="eager"),
    "LFM2-350M": Spec("lfm2", dict(hidden_size=1024, intermediate_size=6656, num_attention_heads=16,
                                   num_key_value_heads=8, conv_L_cache=3, vocab_size=65536, tie_word_embeddings=True),
                      layers=3, published_layers=16, precision_layers=6,
                      layer_pattern=("conv", "conv", "full_attention", "conv", "conv", "full_attention")),
    "ModernBERT-base": Spec("modernbert", dict(hidden_size=768, intermediate_size=1152, num_attention_heads=12,
                                               vocab_size=50368, local_attention=128),
                            layers=3, published_layers=22, precision_layers=6, masked_lm=True,
                            layer_pattern=("full_attention", "sliding_attention", "sliding_attention")),
}
MEMORY_DEPTHS = (1, 3)
SMALL_VOCAB = 512


def skewed_lengths(total: int, samples: int, seed: int = 0) -> list[int]:
    """``samples`` lengths >= 4 summing to ``total``, skewed (a few long, many short)."""
    import torch

    raw = torch.rand(samples, generator=torch.Generator().manual_seed(seed)).pow(2.0) + 0.1
    lengths = (raw / raw.sum() * (total - 4 * samples)).floor().long() + 4
    lengths[int(lengths.argmax())] += total - int(lengths.sum())
    return lengths.tolist()


def build(name: str, implementation: str | None, *, layers: int | None = None, mixer_only: bool = False,
          vocab: int | None = None, dtype=None, seed: int = 0):
    """The model ``name`` with ``layers`` layers (default: the benchmark's cut), random weights from ``seed``;
    ``implementation`` None: stock's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    import packfree_plugin

    packfree_plugin.register()
    spec = MODELS[name]
    depth = spec.layers if layers is None else layers
    kwargs = dict(spec.config, num_hidden_layers=depth)
    if vocab is not None:
        kwargs["vocab_size"] = vocab
    if spec.layer_pattern or mixer_only:
        pattern = (spec.mixer,) if mixer_only and spec.mixer != "mamba2" else spec.layer_pattern
        if pattern:
            kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(depth)]
    if spec.model_type == "lfm2":
        kwargs["full_attn_idxs"] = [i for i, t in enumerate(kwargs["layer_types"]) if t == "full_attention"]
        del kwargs["layer_types"]
    config = AutoConfig.for_model(spec.model_type, **kwargs)
    torch.manual_seed(seed)
    auto = AutoModelForMaskedLM if spec.masked_lm else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=implementation or spec.stock)
    return model.to(dtype or torch.float32)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _batch(mode: str, lengths: list[int], vocab: int) -> dict:
    """Inputs of one step: ``packed`` (one row, position ids restart per sample), ``unsplit`` (one row, one
    sequence) or ``padded`` (a row per sample, right-padded, attention mask)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=gen)
    if mode == "unsplit":
        return dict(input_ids=ids, labels=ids)
    if mode == "packed":
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        return dict(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100))
    rows = ids.split(lengths, dim=1)
    width = max(lengths)
    padded = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : row.shape[1]], mask[i, : row.shape[1]] = row[0], 1
    return dict(input_ids=padded, attention_mask=mask, labels=padded.masked_fill(mask == 0, -100))


def step_case(name: str, mode: str, layers: int | None, mixer_only: bool, repeats: int) -> dict:
    """Seconds (median) and peak extra MiB of a training step; run in a fresh process."""
    import torch

    torch.set_num_threads(2)
    vocab = SMALL_VOCAB if mixer_only else None
    model = build(name, "packfree" if mode == "packed" else None, layers=layers, mixer_only=mixer_only,
                  vocab=vocab).train()
    batch = _batch(mode, skewed_lengths(TOKENS, SAMPLES), model.config.vocab_size)
    kwargs = {} if MODELS[name].masked_lm else {"use_cache": False}
    baseline = _current_mib()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch, **kwargs).loss.backward()

    times = []
    for _ in range(repeats + 1):  # the first is a warm-up, its memory counts (the peak is the peak)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times[1:] or times), "peak_extra_mib": _rss_mib() - baseline}


def precision_case(name: str) -> dict:
    """Max |float32 - float64 reference| of the logits: packfree packed, and stock float32 each sample alone."""
    import torch

    torch.set_num_threads(2)
    lengths = list(PRECISION_LENGTHS)
    layers = MODELS[name].precision_layers
    reference = build(name, "packfree", layers=layers, dtype=torch.float64).eval()
    stock32 = build(name, None, layers=layers).eval()
    packed32 = build(name, "packfree", layers=layers).eval()
    batch = _batch("packed", lengths, reference.config.vocab_size)
    ids, positions = batch["input_ids"], batch["position_ids"]
    kwargs = {} if MODELS[name].masked_lm else {"use_cache": False}
    with torch.no_grad():
        def alone(model):
            return torch.cat([model(input_ids=piece, **kwargs).logits.double() for piece in ids.split(lengths, 1)], 1)

        ref = reference(input_ids=ids, position_ids=positions, **kwargs).logits
        stock = alone(stock32)
        packed = packed32(input_ids=ids, position_ids=positions, **kwargs).logits.double()
    err_packed = (packed - ref).abs().max().item()
    err_stock = (stock - ref).abs().max().item()
    return {"fp32_err_packfree": err_packed, "fp32_err_stock": err_stock, "err_ratio": err_packed / err_stock}


def _subprocess(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "benchmarks.real_sizes", "--case", *args],
                            capture_output=True, text=True)
    if result.returncode != 0:
        killed = result.returncode in (-9, 137)  # the kernel's OOM killer
        last = (result.stderr.strip().splitlines() or [""])[-1]
        return {"error": "out of memory (killed)" if killed else f"failed: {last[:160]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(quick: bool = False, models: list[str] | None = None) -> list[dict]:
    repeats = 1 if quick else 2
    rows = []
    for name in models or list(MODELS):
        spec = MODELS[name]
        row: dict[str, Any] = {"model": name, "layers": f"{spec.layers} of {spec.published_layers}",
                               "precision layers": spec.precision_layers}
        packed = _subprocess("step", name, "packed", str(spec.layers), "0", str(repeats))
        padded = _subprocess("step", name, "padded", str(spec.layers), "0", str(repeats))
        row.update(packed_s=packed.get("seconds"), padded_s=padded.get("seconds"),
                   packed_mib=packed.get("peak_extra_mib"), padded_mib=padded.get("peak_extra_mib"))
        row.update({f"{mode}_error": case["error"] for mode, case in (("packed", packed), ("padded", padded))
                    if "error" in case})
        if spec.mixer is not None:
            for mode, key in (("packed", "layer_mib_packfree"), ("unsplit", "layer_mib_stock_unsplit")):
                lo, hi = (_subprocess("step", name, mode, str(d), "1", "0") for d in MEMORY_DEPTHS)
                if "error" not in lo and "error" not in hi:
                    row[key] = (hi["peak_extra_mib"] - lo["peak_extra_mib"]) / (MEMORY_DEPTHS[1] - MEMORY_DEPTHS[0])
        row.update(_subprocess("precision", name))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | layers | step s: packed / padded (×) | peak extra MiB: packed / padded | "
        "MiB per mixer layer: packfree / stock unsplit | fp32 err vs float64 (layers): packfree / stock (×) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "padded_error" in r:  # what stock's padded step hit instead of a time
            r = {**r, "padded_s": None, "padded_mib": None}
        ratio = r["packed_s"] / r["padded_s"] if r.get("packed_s") and r.get("padded_s") else None
        padded = r.get("padded_error") or f"{_fmt(r.get('padded_s'), '.2f')} ({_fmt(ratio, '.2f')})"
        layer = ("-" if "layer_mib_packfree" not in r else
                 f"{r['layer_mib_packfree']:.0f} / {_fmt(r.get('layer_mib_stock_unsplit'), '.0f')}")
        lines.append(
            f"| {r['model']} | {r['layers']} | {_fmt(r.get('packed_s'), '.2f')} / {padded} | "
            f"{_fmt(r.get('packed_mib'), '.0f')} / {_fmt(r.get('padded_mib'), '.0f')} | "
            f"{layer} | ({r['precision layers']}) {_fmt(r.get('fp32_err_packfree'), '.1e')} / "
            f"{_fmt(r.get('fp32_err_stock'), '.1e')} ({_fmt(r.get('err_ratio'), '.2f')}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timed repeat")
    parser.add_argument("--model", action="append", choices=list(MODELS), help="only these models")
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        kind, name, *rest = args.case
        if kind == "step":
            mode, layers, mixer_only, repeats = rest
            print(json.dumps(step_case(name, mode, int(layers), mixer_only == "1", int(repeats))))
        else:
            print(json.dumps(precision_case(name)))
        return
    print(markdown(run(quick=args.quick, models=args.model)))


if __name__ == "__main__":
    main()
