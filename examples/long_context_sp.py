"""Train on one packed row split over several ranks (DeepSpeed Ulysses + packfree), on the CPU or on GPUs.

    torchrun --nproc-per-node 2 examples/long_context_sp.py --tiny                # 256 tokens, 2 steps: seconds
    torchrun --nproc-per-node 2 examples/long_context_sp.py                       # tiny Qwen3-Next, gloo, CPU
    torchrun --nproc-per-node 2 examples/long_context_sp.py --model lfm2 --tokens 8192 --steps 5
    torchrun --nproc-per-node 1 examples/long_context_sp.py                       # one process: the same losses

Every rank holds T/P tokens of the same packed row; the loss printed is the row's mean token loss, the sum of the
ranks' shares, which equals one process's (tests/parallel checks the loss and every gradient). See
docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def packed_row(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """One packed row of about ``tokens`` tokens: random samples of 64..1024 tokens, as DataCollatorWithFlattening
    packs them (labels -100 at every sample's first token)."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(seed)
    samples, total = [], 0
    while total < tokens:
        length = min(int(torch.randint(64, 1025, (1,), generator=generator)), tokens - total)
        samples.append({"input_ids": torch.randint(3, 120, (length,), generator=generator).tolist()})
        total += length
    return dict(DataCollatorWithFlattening()(samples))


def main() -> None:
    from packfree_plugin.cli.tiny import is_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_next", help="a model type (tiny random weights) or a model directory")
    parser.add_argument("--tiny", action="store_true",
                        help="a quick run: a tiny random model of --model's type, a 256-token row, 2 steps")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens in the packed row (default 4096; 256 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 3; 2 with --tiny)")
    parser.add_argument("--local_rank", type=int, default=None,
                        help="set by DeepSpeed's launcher (the rank is read from the environment, as torchrun sets it)")
    args = parser.parse_args()
    if args.tiny and is_model_dir(args.model):
        parser.error("--tiny takes a model type, not a model directory")
    args.tokens = args.tokens or (256 if args.tiny else 4096)
    args.steps = args.steps or (2 if args.tiny else 3)

    from packfree_plugin.parallel import init_deepspeed, register_ulysses, shard_batch, shard_loss
    from packfree_plugin.cli.tiny import load_model

    init_deepspeed()  # deepspeed.init_distributed (NCCL on CUDA, else gloo) without its CPU start-up build
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    model = load_model(args.model, "packfree", dtype=torch.float32).to(device).train()
    # the whole world is one sequence-parallel group here; one process runs the row as it is (the baseline)
    group = register_ulysses(model, world).get_sequence_parallel_group() if world > 1 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        inputs, targets = shard_batch(packed_row(args.tokens, seed=step), rank, world)
        inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
        loss = shard_loss(model(**inputs).logits, targets.to(device), group)
        loss.backward()
        for parameter in model.parameters():  # each rank holds its share of every gradient: sum them
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=group)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        if rank == 0:
            print(f"step {step}: {args.tokens} tokens over {world} ranks "
                  f"({inputs['input_ids'].shape[1]} each), loss {total.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
