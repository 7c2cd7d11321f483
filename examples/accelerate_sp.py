"""Your own training loop with accelerate's sequence-parallel config: one packed row split over several ranks.

    torchrun --nproc-per-node 2 examples/accelerate_sp.py --tiny     # tiny Qwen3-Next, 2 SGD steps, seconds on a CPU
    torchrun --nproc-per-node 1 examples/accelerate_sp.py --tiny     # one process: the same losses
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_sp.py --tiny

``Accelerator(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N), deepspeed_plugin=...)``
registers DeepSpeed Ulysses in ``prepare``; for a model loaded with ``attn_implementation="packfree"`` (and
``sp_attn_implementation`` unset) packfree takes that registration (packfree_plugin/integrations/deepspeed.py), and
accelerate wraps the data loader in DeepSpeed's ``UlyssesSPDataLoaderAdapter``, which hands every rank its shard of
the row and the row's ``shift_labels``. The loop computes each shard's share of the row's mean loss with
``shard_loss``; DeepSpeed sums the ranks' gradients (ZeRO 0-2; ZeRO-3 before DeepSpeed 0.20.2 averages them, hence
the scale). Plain SGD, so the second step's loss shows a gradient off by any factor. See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os

import torch


def samples(count: int, seed: int) -> list[dict[str, list[int]]]:
    """``count`` random samples of 8..64 tokens (a stand-in for a tokenized dataset)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 65, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(3, 120, (n,), generator=generator).tolist()} for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_next", help="a model type (tiny random weights) or a model directory")
    parser.add_argument("--tiny", action="store_true", help="a quick run: 2 steps of 4 samples per row")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 10; 2 with --tiny)")
    parser.add_argument("--samples-per-row", type=int, default=4, help="samples packed into each row")
    parser.add_argument("--zero", type=int, default=0, choices=range(4), help="DeepSpeed ZeRO stage")
    args = parser.parse_args()
    steps = args.steps or (2 if args.tiny else 10)

    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs, ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from packaging.version import Version
    from transformers import DataCollatorWithFlattening

    from packfree_plugin.integrations.deepspeed import UlyssesRows
    from packfree_plugin.parallel import init_deepspeed, shard_loss
    from packfree_plugin.cli.tiny import load_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_deepspeed()  # deepspeed.init_distributed without its CPU start-up build (docs/distributed.md)
    parallelism = None
    if world > 1:  # the whole world is one sequence-parallel group here
        handler = DeepSpeedSequenceParallelConfig(sp_allow_recurrent_layers=True)  # packfree splits them exactly
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=world, sp_handler=handler)
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                           "zero_optimization": {"stage": args.zero}})
    # On a CPU: not cpu=True (accelerate then takes the run for MULTI_CPU, which refuses a parallelism config) but
    # gloo named (else accelerate finds no backend for the CPU and runs every rank as a single process)
    backend = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(parallelism_config=parallelism, deepspeed_plugin=plugin, kwargs_handlers=backend)
    model = load_model(args.model, "packfree", dtype=torch.float32).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    rows = UlyssesRows(DataCollatorWithFlattening(), world, length=64 * args.samples_per_row)  # one length: gloo
    loader = torch.utils.data.DataLoader(samples(args.samples_per_row * steps, seed=0),
                                         batch_size=args.samples_per_row, collate_fn=rows)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    group = model.mpu.get_sequence_parallel_group() if world > 1 else None
    averaged = args.zero == 3 and Version(deepspeed.__version__) < Version("0.20.2")  # ZeRO-3 averages over SP
    scale = world if averaged else 1
    for step, batch in zip(range(steps), loader):
        if world > 1:  # a shard, and the row's targets already shifted
            targets = batch.pop("shift_labels")
        else:  # the whole row: shift its labels left by one (a sample's first label is -100)
            labels = batch.pop("labels")
            targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        loss = shard_loss(model(**batch).logits, targets.to(accelerator.device), group)
        accelerator.backward(loss * scale)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            torch.distributed.all_reduce(total, group=group)
        if accelerator.is_main_process:
            print(f"step {step}: {args.samples_per_row} samples in one row over {world} "
                  f"rank{'s' * (world > 1)}, loss {total.item():.6f}", flush=True)
    accelerator.end_training()  # ends the process groups before the interpreter's teardown (see trainer_sp.py)


if __name__ == "__main__":
    main()
