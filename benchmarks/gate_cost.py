"""What the gate costs at load: ``python -m packfree_plugin.gate.timing``.

For a few classes it times what a load costs at the gate: :func:`~.admission.admit` on a verified class (a
lookup), and :func:`~.admission.prove_tiny_copy`, the proof every unverified class pays once per config
(build the tiny packfree model and its stock twin, run the packed rows and each sample alone; for a class
the gate refuses, also the diagnosis that names the wrong modules). Prints the median of ``--repeats`` runs
after one warm-up each, as a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["main", "median_seconds"]

CASES = (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
         ("qwen3_next", "Qwen3NextForCausalLM"), ("mixtral", "MixtralForCausalLM"), ("bert", "BertModel"),
         ("roberta", "RobertaForMaskedLM"), ("llama4_text", "Llama4ForCausalLM"))
"""(model type, class): the first six are exact (proved like an unverified class), the last two refused."""


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``run`` after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packfree_plugin.gate.timing", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch
    import transformers

    from . import admission
    from .admission import bypassed
    from .shrink import tiny_config_for

    torch.set_num_threads(args.threads)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"median of {args.repeats}\n")
    print("| class | verified: admit() | unverified: proof on a tiny copy | verdict |\n|---|---|---|---|")
    for model_type, name in CASES:
        cls = getattr(transformers, name)
        with bypassed():
            model = cls._from_config(tiny_config_for(model_type), attn_implementation="sdpa")
        verdict = admission.prove_tiny_copy(model).kind
        unverified = median_seconds(lambda: admission.prove_tiny_copy(model), args.repeats)
        verified = "-"
        if admission.is_verified(model):
            verified = f"{median_seconds(lambda: admission.admit(model), args.repeats) * 1e6:.0f} us"
        print(f"| {name} | {verified} | {unverified:.2f} s | {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
