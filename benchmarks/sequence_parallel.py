"""One long packed row split over 4 ranks (DeepSpeed Ulysses + packfree, gloo on the CPU) against one process.

Two model shapes (:data:`SHAPES`, float32, random weights: a Llama and a Qwen3-Next of Gated DeltaNet + attention
layers) train on one packed row of :data:`TOKENS` tokens (samples of 64..1024 tokens, as
``DataCollatorWithFlattening`` packs them): first in one process (packfree, no sequence parallelism), then on
:data:`WORLD` ranks, each holding a quarter of the row (``register_ulysses``, ``shard_batch``, ``shard_loss``). Every
run is in this one bench run, each in fresh processes, every process with one CPU thread (each rank stands for one
device; the one process for one device of the same kind).

- **peak activation memory**: each process's peak resident memory during its training steps above its memory just
  before them (model, its gradient buffers and the batch built; the peak is reset there through
  ``/proc/self/clear_refs``); for the ranks, the largest rank's.
- **step time**: forward + backward of the row after a warm-up step (the median of the repeats): one process's time
  for the row against the slowest rank's.
- the losses of both runs (equal to float32 rounding: ``tests/parallel`` checks every gradient).

``python -m benchmarks.sequence_parallel [--quick] [--tokens N ...]``; needs deepspeed (a test dependency).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time

from benchmarks.memory import current_mib, peak_mib, reset_peak

TOKENS = (16384,)
"""Rows measured by default. 65,536 tokens (``--tokens 16384 65536``) needs about 4x the 16k peak in the one process
(some 14 GB for the Llama shape), more than a small shared machine has free."""
QUICK_TOKENS = (4096,)
WORLD = 4
_COMMON = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, head_dim=32, vocab_size=8192)
SHAPES: dict[str, dict] = {
    "llama": dict(_COMMON),
    "qwen3_next": dict(_COMMON, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_value_heads=8,
                       linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=0,
                       mlp_only_layers=[0, 1, 2, 3]),
}
"""4 layers, width 256, 8 query / 4 key-value attention heads of 32, vocabulary 8192 (the logits of a long row
dominate activation memory in real models too); Qwen3-Next: 3 Gated DeltaNet layers (8 value / 4 key heads of 32)
and 1 attention layer, dense MLPs."""


def packed_row(tokens: int, vocab_size: int) -> dict:
    """``[1, tokens]`` ids, position_ids and labels of random samples of 64..1024 tokens, packed."""
    import torch
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(0)
    samples, total = [], 0
    while total < tokens:
        length = min(int(torch.randint(64, 1025, (1,), generator=generator)), tokens - total)
        samples.append({"input_ids": torch.randint(3, vocab_size, (length,), generator=generator).tolist()})
        total += length
    return dict(DataCollatorWithFlattening()(samples))


def _worker(rank: int, world: int, port: int, shape: str, tokens: int, repeats: int, out: str) -> None:
    """One process of a run (``world`` 1: the baseline, no sequence parallelism); writes ``out.<rank>``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM

    from packfree_plugin.parallel import init_deepspeed, register_ulysses, shard_batch, shard_loss
    from packfree_plugin.loading.register import register

    init_deepspeed("gloo")
    register()
    torch.manual_seed(0)
    config = AutoConfig.for_model(shape, **SHAPES[shape], max_position_embeddings=tokens)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.float32).train()
    group = register_ulysses(model, world).get_sequence_parallel_group() if world > 1 else None
    inputs, targets = shard_batch(packed_row(tokens, config.vocab_size), rank, world)

    def step() -> float:
        model.zero_grad(set_to_none=False)  # gradients stay allocated between steps, as in training
        loss = shard_loss(model(**inputs, use_cache=False).logits, targets, group)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total.item()

    for parameter in model.parameters():  # allocated before the peak is reset: parameters' memory, not activations
        parameter.grad = torch.zeros_like(parameter)
    before = current_mib()
    reset_peak()
    times, loss = [], 0.0
    for _ in range(repeats + 1):  # the first is a warm-up; its memory counts (the peak is the peak)
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    result = {"peak_extra_mib": peak_mib() - before, "seconds": statistics.median(times[1:]), "loss": loss,
              "shard_tokens": inputs["input_ids"].shape[1]}
    with open(f"{out}.{rank}", "w") as file:
        json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can abort a finished process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, shape: str, tokens: int, repeats: int) -> list[dict]:
    """Run ``world`` fresh processes on one row; each one's result."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        out, port = os.path.join(folder, "result"), _free_port()
        processes = [context.Process(target=_worker, args=(rank, world, port, shape, tokens, repeats, out))
                     for rank in range(world)]
        for process in processes:
            process.start()
        try:
            for process in processes:
                process.join(timeout=1800)
                if process.exitcode != 0:
                    raise RuntimeError(f"a {world}-process run exited with {process.exitcode}")
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}") as file:
                results.append(json.load(file))
        return results


def run(quick: bool = False, tokens: tuple[int, ...] | None = None) -> list[dict]:
    rows_of = tokens or (QUICK_TOKENS if quick else TOKENS)
    if importlib.util.find_spec("deepspeed") is None:
        return [{"tokens": rows_of[0], "note": "not run: needs deepspeed (a test dependency)"}]
    repeats = 1 if quick else 2
    rows = []
    for length in rows_of:
        for shape in SHAPES:
            alone, = measure(1, shape, length, repeats)
            ranks = measure(WORLD, shape, length, repeats)
            memory = max(rank["peak_extra_mib"] for rank in ranks)
            seconds = max(rank["seconds"] for rank in ranks)
            rows.append({
                "shape": shape, "tokens": length, "ranks": WORLD,
                "one_process_peak_extra_mib": alone["peak_extra_mib"], "per_rank_peak_extra_mib": memory,
                "memory_ratio": memory / alone["peak_extra_mib"], "one_process_seconds": alone["seconds"],
                "ranks_seconds": seconds, "time_ratio": seconds / alone["seconds"], "one_process_loss": alone["loss"],
                "ranks_loss": ranks[0]["loss"], "per_rank_mib": [rank["peak_extra_mib"] for rank in ranks],
            })
    return rows


def markdown(rows: list[dict]) -> str:
    if "note" in rows[0]:
        return f"{rows[0]['tokens']} tokens: {rows[0]['note']}"
    lines = [
        f"Shapes: {', '.join(SHAPES)} (benchmarks/sequence_parallel.py SHAPES), float32; one packed row; one CPU "
        f"thread per process; {WORLD} ranks against 1 process.",
        "",
        "| shape | tokens | peak activation MiB, 1 process | per rank (largest) | ratio | step s, 1 process | "
        f"{WORLD} ranks (slowest) | ratio | loss, 1 process / ranks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['tokens']} | {row['one_process_peak_extra_mib']:.0f} | "
            f"{row['per_rank_peak_extra_mib']:.0f} | {row['memory_ratio']:.2f}x | {row['one_process_seconds']:.2f} | "
            f"{row['ranks_seconds']:.2f} | {row['time_ratio']:.2f}x | {row['one_process_loss']:.6f} / "
            f"{row['ranks_loss']:.6f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOKENS} tokens, one repeat")
    parser.add_argument("--tokens", type=int, nargs="+", help=f"row lengths (default {TOKENS})")
    arguments = parser.parse_args()
    print(markdown(run(quick=arguments.quick, tokens=tuple(arguments.tokens or ()) or None)), file=sys.stdout)
