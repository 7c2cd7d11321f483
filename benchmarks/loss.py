"""The loss on packed rows: what :func:`packfree_plugin.packed_loss` adds to a training step over the plain token mean.

One packed batch of 2 rows, each holding short samples (16-96 tokens) and a padded tail, with per-token and
per-sample weights. Timed, forward + backward, on one torch thread in its CPU time, median of interleaved repeats, every
ratio from one run:

- ``loss alone``: on given logits ``[2, T, V]``, each reduction against transformers' token mean
  (``ForCausalLMLoss``: ``cross_entropy(..., ignore_index=-100)`` on the shifted logits), where the reduction's own work
  shows;
- ``training step``: a small Llama (packfree), its forward without labels then each reduction, against the same
  forward with labels (the model's own token-mean loss).

``python -m benchmarks.loss [--quick]``; ``python -m benchmarks --only loss`` prints it with the machine's load.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from benchmarks.short_samples import _median_ms, _one_thread

VARIANTS = {
    "token": dict(reduction="token"),
    "sample": dict(reduction="sample"),
    "sample, both weights": dict(reduction="sample", weighted=True),
    "none (summed)": dict(reduction="none"),
}


def _batch(row_len: int, vocab: int) -> tuple[dict[str, torch.Tensor], int]:
    """2 packed rows of ``row_len`` tokens from samples of 16-96 tokens, with both weights (PackedCollator), and the
    number of samples."""
    from packfree_plugin.packing import PackedCollator

    generator = torch.Generator().manual_seed(0)
    features, total = [], 0
    while total < 2 * row_len - 100:
        length = int(torch.randint(16, 97, (1,), generator=generator))
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        features.append({"input_ids": ids, "token_weights": torch.rand(length, generator=generator).tolist(),
                         "sample_weight": float(torch.rand(1, generator=generator))})
        total += length
    return PackedCollator(rows_per_batch=2, max_tokens=row_len, truncate=True)(features), len(features)


def _loss_calls(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> dict[str, Callable[[], None]]:
    from packfree_plugin import Boundaries, packed_loss

    rows, row_len = batch["input_ids"].shape
    boundaries = Boundaries.from_model_inputs(batch_size=rows, seq_len=row_len, device=logits.device,
                                              position_ids=batch["position_ids"],
                                              attention_mask=batch.get("attention_mask"))
    weights = {name: batch[name] for name in ("token_weights", "sample_weights")}

    def ours(reduction: str, weighted: bool = False) -> Callable[[], None]:
        def call() -> None:
            loss = packed_loss(logits, batch["labels"], reduction=reduction, boundaries=boundaries,
                               **(weights if weighted else {}))
            (loss.nansum() if reduction == "none" else loss).backward()
        return call

    def stock() -> None:
        ForCausalLMLoss(logits, batch["labels"], logits.shape[-1]).backward()

    return {"stock token mean": stock, **{name: ours(**variant) for name, variant in VARIANTS.items()}}


def _step_calls(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, Callable[[], None]]:
    from packfree_plugin import packed_loss

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    unweighted = {k: v for k, v in inputs.items() if k not in ("token_weights", "sample_weights")}

    def ours(reduction: str, weighted: bool = False) -> Callable[[], None]:
        def call() -> None:
            loss = packed_loss(model(**(inputs if weighted else unweighted)), batch["labels"], reduction=reduction)
            (loss.nansum() if reduction == "none" else loss).backward()
        return call

    def stock() -> None:
        model(**unweighted, labels=batch["labels"]).loss.backward()

    return {"stock token mean": stock, **{name: ours(**variant) for name, variant in VARIANTS.items()}}


def _small_llama(vocab: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import packfree_plugin

    packfree_plugin.register()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="packfree").train()


def run(quick: bool = False) -> list[dict]:
    """On one torch thread, timed in this thread's CPU time (which other processes on the machine do not add to)."""
    with _one_thread():
        return _rows(quick)


def _rows(quick: bool) -> list[dict]:
    row_len, vocab, repeats = (256, 4096, 9) if quick else (1024, 32000, 15)
    batch, samples = _batch(row_len, vocab)
    logits = torch.randn(2, row_len, vocab, generator=torch.Generator().manual_seed(1), requires_grad=True)
    rows = []
    cases = {"loss alone": _loss_calls(batch, logits), "training step": _step_calls(batch, _small_llama(vocab))}
    for what, calls in cases.items():
        ms = _median_ms(calls, repeats=repeats, clock=time.thread_time)
        rows += [{"what": what, "loss": name, "tokens": 2 * row_len, "samples": samples, "vocab": vocab, "ms": value,
                  "x token mean": value / ms["stock token mean"]} for name, value in ms.items()]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| timed | loss | tokens (samples) | vocab | ms | × token mean |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['what']} | {row['loss']} | {row['tokens']} ({row['samples']}) | {row['vocab']} | "
                     f"{row['ms']:.2f} | {row['x token mean']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(markdown(run(quick=parser.parse_args().quick)))
