"""A packed training step of the demo's GDN hybrid, eager against ``torch.compile`` (inductor), one run.

Same model, weights and packed row (16 samples of 60-300 tokens) for both; reported: median step time of
each, the ratio (compiled / eager) and the one-off compile time. Compiled steps pay for packfree's opaque
op recomputing each boundary-aware forward in backward; this shows what is left after inductor's fusion.
``python -m benchmarks.compiled [--quick]``; ``nox -s bench`` runs it with the others.
"""

from __future__ import annotations

import sys
import time

from benchmarks.attention import median_seconds


def run(quick: bool = False) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    import packfree_plugin
    from packfree_plugin.cli.demo import demo_config

    packfree_plugin.register()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(demo_config("qwen3_next", 30522),
                                                 attn_implementation="packfree").train()
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(60, 300, (16,), generator=generator).tolist()
        ids = torch.randint(3, 30000, (1, sum(lengths)), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.masked_fill(positions == 0, -100)  # no sample predicts another's first token

        def step(module) -> None:
            model.zero_grad(set_to_none=True)
            module(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()

        repeats = 3 if quick else 7
        eager = median_seconds(lambda: step(model), repeats)
        torch._dynamo.reset()
        compiled = torch.compile(model)
        start = time.perf_counter()
        step(compiled)
        compile_seconds = time.perf_counter() - start
        inductor = median_seconds(lambda: step(compiled), repeats)
        torch._dynamo.reset()
    finally:
        torch.set_num_threads(threads)
    return [{"model": "qwen3_next 4L h128 (demo)", "tokens": sum(lengths), "eager s": round(eager, 3),
             "inductor s": round(inductor, 3), "x eager": round(inductor / eager, 2),
             "compile s": round(compile_seconds, 1)}]


if __name__ == "__main__":
    rows = run(quick="--quick" in sys.argv)
    print(rows)
