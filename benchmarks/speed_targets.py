"""Issue 34's speed targets as ratios, measured in one run, each with the machine's load while it ran.

- **attention**: fwd+bwd of one packed attention call (16 query heads, 4 key/value heads, head dim 64, 16 samples of
  skewed lengths) against the per-sample loop (stock sdpa on each sample alone, one after the other): target at most
  0.7x at 4k tokens and 1.0x at 32k;
- **generate**: greedy ``generate()`` time per new token of a tiny Llama, Qwen3-Next and Mamba2 (2 prompts, 48 new
  tokens; the time of 48 new tokens minus that of 1, over 47), packfree against stock: target at most 1.05x.

Packfree's and the reference's runs alternate, and each ratio is the ratio of their medians. A ratio whose run saw
other processes taking more than :data:`packfree_plugin.cli.load.OTHERS_PER_CORE` of each core is marked NOISY in
the output: on a loaded machine the packed path loses more than the reference, and such a figure is no figure.

``python -m benchmarks --only "speed targets (issue 34)"`` (or ``python -m benchmarks.speed_targets [--quick]``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from packfree_plugin.cli.load import LoadWatch

ATTENTION = ((4096, 0.7), (32768, 1.0))
"""(tokens, target ratio to the per-sample loop) of the packed attention call, 16 samples each."""
GENERATE_MODELS = ("llama", "qwen3_next", "mamba2")
GENERATE_TARGET = 1.05
NEW_TOKENS = 48


def alternating_medians(first: Callable[[], None], second: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and of ``second()``, run alternately ``repeats`` times after one warm-up each."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for step, found in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            step()
            found.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _row(target: str, limit: float, packfree: float, reference: float, load: LoadWatch) -> dict:
    ratio = packfree / reference
    return {"target": target, "packfree s": packfree, "reference s": reference, "ratio": ratio, "limit": limit,
            "meets": "yes" if ratio <= limit else "no", "others/core": load.others_per_core,
            "load avg/core (own included)": load.per_core, "noise": "NOISY" if load.too_loaded else "quiet"}


def attention_row(tokens: int, limit: float, repeats: int) -> dict:
    """Packed attention call against the per-sample loop at ``tokens`` tokens of 16 samples (module docstring)."""
    from benchmarks.attention import attention_step, skewed_lengths

    lengths = skewed_lengths(tokens)
    packed, per_sample = attention_step("attn-packfree", lengths), attention_step("attn-per-sample", lengths)
    with LoadWatch() as load:
        packfree, loop = alternating_medians(packed, per_sample, repeats)
    return _row(f"attention fwd+bwd, {tokens} tokens / {len(lengths)} samples vs per-sample loop", limit, packfree,
                loop, load)


def generate_row(model_type: str, repeats: int) -> dict:
    """Greedy generate() per new token, packfree against stock, on a tiny ``model_type`` (module docstring)."""
    import torch

    from packfree_plugin.cli.tiny import load_model

    model = load_model(model_type, "packfree", dtype=torch.float32)
    stock = load_model(model_type, "eager" if model_type == "mamba2" else "sdpa", dtype=torch.float32)  # no sdpa path
    stock.load_state_dict(model.state_dict())
    prompts = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def timed(which: torch.nn.Module, new_tokens: int) -> Callable[[], None]:
        def step() -> None:
            with torch.inference_mode():
                which.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return step

    with LoadWatch() as load:
        packfree_all, stock_all = alternating_medians(timed(model, NEW_TOKENS), timed(stock, NEW_TOKENS), repeats)
        packfree_one, stock_one = alternating_medians(timed(model, 1), timed(stock, 1), repeats)
    per_token = [(total - first) / (NEW_TOKENS - 1) for total, first in ((packfree_all, packfree_one),
                                                                          (stock_all, stock_one))]
    return _row(f"generate() per new token, {model_type} (2 prompts x {NEW_TOKENS})", GENERATE_TARGET, *per_token,
                load)


def run(quick: bool = False) -> list[dict]:
    """Every target once; ``quick``: attention at 4k tokens only, fewer repeats."""
    import torch

    torch.set_num_threads(2)
    repeats = 3 if quick else 7
    rows = [attention_row(tokens, limit, repeats) for tokens, limit in (ATTENTION[:1] if quick else ATTENTION)]
    # a per-token time is the difference of two medians: three times the repeats keep its noise near the attention rows'
    rows += [generate_row(model_type, 3 * repeats) for model_type in GENERATE_MODELS]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| target | packfree s | reference s | ratio | limit | meets | others/core | load avg/core (own included) "
             "| noise |", "|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for row in rows:
        others = "n/a" if row["others/core"] is None else f"{row['others/core']:.2f}"
        lines.append(f"| {row['target']} | {row['packfree s']:.4f} | {row['reference s']:.4f} | {row['ratio']:.3f} | "
                     f"{row['limit']:.2f} | {row['meets']} | {others} | "
                     f"{row['load avg/core (own included)']:.2f} | {row['noise']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="attention at 4k tokens only, fewer repeats")
    print(markdown(run(quick=parser.parse_args().quick)))


if __name__ == "__main__":
    main()
