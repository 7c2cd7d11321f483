"""What the load-time gate costs: ``python -m benchmarks.gate_cost [--quick]``; ``nox -s bench`` runs it too.

For a few classes it times what a load costs at the gate: :func:`packfree_plugin.gate.admit` on a verified
class (a lookup), and :func:`packfree_plugin.gate.admission.prove_tiny_copy`, the proof every unverified class
pays once per config (build the tiny packfree model and its stock twin, run the packed rows and each sample
alone; for a class the gate refuses, also the diagnosis that names the wrong modules). Median of several runs
after one warm-up each.
"""

from __future__ import annotations

import sys

from benchmarks.attention import median_seconds

CASES = (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM"),
         ("qwen3_next", "Qwen3NextForCausalLM"), ("mixtral", "MixtralForCausalLM"), ("bert", "BertModel"),
         ("roberta", "RobertaForMaskedLM"), ("llama4_text", "Llama4ForCausalLM"))
"""(model type, class): the first six are exact (proved like an unverified class), the last two refused."""


def run(quick: bool = False) -> list[dict]:
    import torch
    import transformers

    from packfree_plugin.gate import admission
    from packfree_plugin.gate.admission import bypassed
    from packfree_plugin.gate.shrink import tiny_config_for

    repeats = 2 if quick else 5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    rows = []
    try:
        for model_type, name in CASES:
            cls = getattr(transformers, name)
            with bypassed():
                model = cls._from_config(tiny_config_for(model_type), attn_implementation="sdpa")
            verdict = admission.prove_tiny_copy(model).kind
            unverified = median_seconds(lambda: admission.prove_tiny_copy(model), repeats)
            verified = None
            if admission.is_verified(model):
                verified = round(median_seconds(lambda: admission.admit(model), repeats) * 1e6)
            rows.append({"class": name, "verified: admit() us": verified,
                         "unverified: proof on a tiny copy s": round(unverified, 2), "verdict": verdict})
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
