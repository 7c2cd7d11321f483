"""Native forwards against the generic per-sample tier, for the families whose recurrence is inline.

MiniMax (lightning attention) and RecurrentGemma (RG-LRU) each get a packed training step (forward and
backward, float32) of one model with the same weights and row, once with packfree's native forward
(:mod:`packfree_plugin.mixers.seam`, or the family's own forward in ``ops/<family>/family.py``) and once with the layer's adapter switched to the generic tier,
which unpacks the row and runs the layer per sample. Reported: median step time of each and the ratio.
``python -m benchmarks.native_tiers [--quick]``; ``nox -s bench`` runs it with the others.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

MIXERS = {"minimax": "MiniMaxLightningAttention", "recurrent_gemma": "RecurrentGemmaRecurrentBlock"}


def _config(model_type: str):
    from packfree_plugin.gate.catalogue import catalogue_config

    config = catalogue_config(model_type)
    config.hidden_size = 256
    if model_type == "minimax":
        config.block_size = 64
    if model_type == "recurrent_gemma":
        config.lru_width = 256
    return config


def run(quick: bool = False) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    import packfree_plugin
    from packfree_plugin.mixers import entry as mixers
    from packfree_plugin.mixers import registry  # noqa: F401 - mixers fills the adapters
    from packfree_plugin.classes import CLASSES

    packfree_plugin.register()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 200, (8 if quick else 16,), generator=generator).tolist()
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)  # no sample predicts another's first token
    rows = []
    for model_type, mixer in MIXERS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="packfree",
                                                 experts_implementation="eager").train()
        family = CLASSES[mixer].mixer
        native = registry.ADAPTERS[family]
        generic = dataclasses.replace(native, native=None)

        def step(adapter: registry.MixerAdapter) -> None:
            registry.ADAPTERS[family] = adapter
            try:
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
            finally:
                registry.ADAPTERS[family] = native

        step(native)  # warm-up of both
        step(generic)
        times: dict[str, list[float]] = {"native": [], "generic": []}
        for _ in range(3 if quick else 7):  # interleaved, so drift on a shared machine hits both alike
            for name, adapter in (("native", native), ("generic", generic)):
                start = time.perf_counter()
                step(adapter)
                times[name].append(time.perf_counter() - start)
        native_s, generic_s = statistics.median(times["native"]), statistics.median(times["generic"])
        rows.append({"model": f"{model_type} h256", "mixer": mixer, "tokens": sum(lengths), "samples": len(lengths),
                     "native s": round(native_s, 3), "generic s": round(generic_s, 3),
                     "x generic": round(native_s / generic_s, 2)})
    return rows


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
