"""Packed attention benchmark: a tiny Llama, fwd+bwd, 16 samples of skewed lengths at 2k / 8k / 32k tokens.

Three ways to train on the same samples, side by side, in one run:

- ``packfree``: one packed row, ``attn_implementation="packfree"``;
- ``sdpa-packed``: one packed row with ``position_ids``, stock ``sdpa`` (builds an N x N mask);
- ``per-sample``: stock ``sdpa``, each sample alone, one after the other (the correctness floor).

The same three are also timed for the attention call alone (``attn-*``: one layer's q/k/v, 16 query
heads, 4 key/value heads, head dim 64), where the dense mask's cost is not diluted by the rest of the
model.

Each case runs in its own subprocess so its peak resident memory (``ru_maxrss``) is its own; the
reported memory is that peak minus the process's memory after the model was built. Run with
``python -m benchmarks.attention [--quick]``; ``nox -s bench`` runs it with the other benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

METHODS = ("packfree", "sdpa-packed", "per-sample", "attn-packfree", "attn-sdpa-packed", "attn-per-sample")
SIZES = (2048, 8192, 32768)
SAMPLES = 16
DENSE_MASK_LIMIT = 16384
"""Above this many tokens the stock N x N path is not run: its mask and scores need tens of GiB."""


def skewed_lengths(total: int, samples: int = SAMPLES, seed: int = 0) -> list[int]:
    """``samples`` lengths summing to ``total``, skewed (a few long, many short), each >= 1."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    raw = torch.rand(samples, generator=generator).pow(3.0) + 0.02
    lengths = (raw / raw.sum() * (total - samples)).floor().long() + 1
    lengths[0] += total - int(lengths.sum())
    return lengths.tolist()


def build_model(implementation: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import packfree_plugin

    packfree_plugin.register()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=2048, max_position_embeddings=65536,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).train()


def median_seconds(step, repeats: int) -> float:
    """Median wall time of ``step()`` over ``repeats`` runs, after one warm-up run."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(method: str, tokens: int, repeats: int) -> dict:
    """Time fwd+bwd of ``method`` on ``tokens`` tokens; returns seconds (median) and peak extra MiB."""
    import torch

    torch.set_num_threads(2)
    lengths = skewed_lengths(tokens)
    if method.startswith("attn-"):
        return _attention_case(method, lengths, repeats)
    model = build_model("packfree" if method == "packfree" else "sdpa")
    ids = torch.randint(3, 2048, (1, tokens), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    baseline = _rss_mib()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if method == "per-sample":
            for piece in ids.split(lengths, dim=1):
                model(input_ids=piece, labels=piece, use_cache=False).loss.backward()
        else:
            labels = ids.masked_fill(positions == 0, -100)  # no sample predicts another's first token
            model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()

    return {"method": method, "tokens": tokens, "samples": len(lengths), "seconds": median_seconds(step, repeats),
            "peak_extra_mib": _rss_mib() - baseline}


def attention_step(method: str, lengths: list[int]) -> Callable[[], None]:
    """One fwd+bwd of one attention call over the packed samples of ``lengths`` (16 query heads, 4 key/value heads,
    head dim 64): ``attn-packfree`` (packfree's packed attention, boundaries built per step as a training step builds
    them), ``attn-sdpa-packed`` (stock sdpa under the dense mask stock builds from packed ``position_ids``) or
    ``attn-per-sample`` (stock sdpa on each sample alone, one after the other)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import find_packed_sequence_indices, sdpa_mask, packed_sequence_mask_function, and_masks, causal_mask_function

    from packfree_plugin.attention import AttentionOptions, run_packed_attention
    from packfree_plugin.boundaries import Boundaries

    tokens = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    # [B, H, T, D] views of [B, T, H, D] tensors: the layout transformers' attention layers hand over
    q, k, v = (torch.randn(1, tokens, heads, 64, generator=generator).transpose(1, 2) for heads in (16, 4, 4))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True

    def step() -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        if method == "attn-packfree":
            out = run_packed_attention(qq, kk, vv, Boundaries.from_position_ids(positions),
                                       AttentionOptions(scale=0.125, causal=True))
        elif method == "attn-sdpa-packed":  # what stock transformers builds from packed position_ids
            segments = find_packed_sequence_indices(positions)
            mask = sdpa_mask(batch_size=1, q_length=tokens, kv_length=tokens,
                             mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(segments)),
                             allow_is_causal_skip=False)
            out = sdpa_attention_forward(module, qq, kk, vv, mask, scaling=0.125)[0]
        else:
            out = torch.cat([
                sdpa_attention_forward(module, a, b, c, None, scaling=0.125)[0]
                for a, b, c in zip(qq.split(lengths, 2), kk.split(lengths, 2), vv.split(lengths, 2))
            ], dim=1)
        out.square().mean().backward()

    return step


def _attention_case(method: str, lengths: list[int], repeats: int) -> dict:
    """fwd+bwd of one attention call over the packed samples (see module docstring)."""
    step = attention_step(method, lengths)
    baseline = _rss_mib()
    return {"method": method, "tokens": sum(lengths), "samples": len(lengths), "seconds": median_seconds(step, repeats),
            "peak_extra_mib": _rss_mib() - baseline}


def measure(method: str, tokens: int, repeats: int) -> dict:
    """Run one case in a fresh subprocess (own peak memory)."""
    if method.endswith("sdpa-packed") and tokens > DENSE_MASK_LIMIT:
        return {"method": method, "tokens": tokens, "samples": SAMPLES, "seconds": None, "peak_extra_mib": None,
                "note": f"not run: the dense {tokens}x{tokens} path needs tens of GiB"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.attention", "--case", method, str(tokens), str(repeats)],
        capture_output=True, text=True, check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    sizes = SIZES[:2] if quick else SIZES
    repeats = 1 if quick else 3
    rows = []
    for tokens in sizes:
        cases = {method: measure(method, tokens, repeats) for method in METHODS}
        for method, case in cases.items():
            packfree = cases["attn-packfree" if method.startswith("attn-") else "packfree"]
            if case["seconds"] is not None:
                case["time_vs_packfree"] = case["seconds"] / packfree["seconds"]
            rows.append(case)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| tokens | samples | method | fwd+bwd s | x packfree time | peak extra MiB |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        seconds = "-" if row["seconds"] is None else f"{row['seconds']:.3f}"
        ratio = "-" if row.get("time_vs_packfree") is None else f"{row['time_vs_packfree']:.2f}"
        memory = row.get("note") or f"{row['peak_extra_mib']:.0f}"
        lines.append(f"| {row['tokens']} | {row['samples']} | {row['method']} | {seconds} | {ratio} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2k and 8k only, one repeat")
    parser.add_argument("--case", nargs=3, metavar=("METHOD", "TOKENS", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        method, tokens, repeats = args.case
        print(json.dumps(run_case(method, int(tokens), int(repeats))))
        return
    print(markdown(run(quick=args.quick)))


if __name__ == "__main__":
    main()
