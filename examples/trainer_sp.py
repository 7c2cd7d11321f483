"""Train with the HF Trainer, one packed row split over several ranks: accelerate's sequence-parallel config.

    torchrun --nproc-per-node 2 examples/trainer_sp.py --tiny     # tiny Qwen3-Next, 2 steps, seconds on a CPU
    torchrun --nproc-per-node 1 examples/trainer_sp.py --tiny     # one process: the same losses
    torchrun --nproc-per-node 2 examples/trainer_sp.py --tiny --sft   # TRL's SFTTrainer, padding_free=True
    torchrun --nproc-per-node 4 examples/trainer_sp.py --model PATH --samples-per-row 64 --steps 100

The user's side is three lines: load the model with ``attn_implementation="packfree"``, set
``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N), deepspeed=...)``
(``sp_attn_implementation`` left unset; ``sp_allow_recurrent_layers=True`` for hybrids, which accelerate refuses
otherwise), and wrap the collator in ``UlyssesRows``, so every batch is one packed row of a length divisible by N
(one fixed length: DeepSpeed's data loader adapter all-gathers the ranks' rows, and gloo needs them of equal size).
packfree takes DeepSpeed Ulysses' registration (packfree_plugin/integrations/deepspeed.py); the Trainer's loss is the
row's mean token loss, equal to one process's (tests/parallel/test_trainer_ulysses.py). See docs/distributed.md.
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
    parser.add_argument("--row-length", type=int, default=None,
                        help="tokens in every row, padded (default 64 per sample: the samples here are 8..64 tokens)")
    parser.add_argument("--zero", type=int, default=0, choices=range(4), help="DeepSpeed ZeRO stage")
    parser.add_argument("--sft", action="store_true",
                        help="TRL's SFTTrainer (SFTConfig(padding_free=True)) instead of transformers' Trainer")
    parser.add_argument("--output-dir", default="trainer-sp-output")
    args = parser.parse_args()
    steps = args.steps or (2 if args.tiny else 10)
    row_length = args.row_length or 64 * args.samples_per_row

    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    from packfree_plugin.integrations.deepspeed import UlyssesRows
    from packfree_plugin.parallel import init_deepspeed
    from packfree_plugin.cli.tiny import load_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_deepspeed()  # deepspeed.init_distributed without its CPU start-up build (docs/distributed.md)
    model = load_model(args.model, "packfree", dtype=torch.float32)
    parallelism = None
    if world > 1:  # the whole world is one sequence-parallel group here
        # sp_attn_implementation left unset; recurrent layers allowed: packfree splits them head-parallel, exactly
        handler = DeepSpeedSequenceParallelConfig(sp_allow_recurrent_layers=True)
        parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=world, sp_handler=handler)
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "zero_optimization": {"stage": args.zero},
                 "gradient_clipping": "auto"}  # max_grad_norm; without it DeepSpeed clips at 1.0 whatever it says
    settings = dict(output_dir=args.output_dir, per_device_train_batch_size=args.samples_per_row, max_steps=steps,
                    learning_rate=1e-3, use_cpu=not torch.cuda.is_available(), parallelism_config=parallelism,
                    deepspeed=deepspeed, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
                    report_to=[], disable_tqdm=True)

    class PrintLoss(TrainerCallback):
        def on_log(self, arguments, state, control, logs=None, **kwargs) -> None:
            if state.is_world_process_zero and logs and "loss" in logs:
                print(f"step {state.global_step}: {args.samples_per_row} samples in one row over {world} "
                      f"rank{'s' * (world > 1)}, loss {logs['loss']:.6f}", flush=True)

    dataset = samples(args.samples_per_row * steps, seed=0)
    if args.sft:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from packfree_plugin.cli.tiny import tiny_tokenizer

        # padding_free: TRL's collator packs each batch into one row (max_length=None: TRL 1.16 requires it then)
        # router_aux_loss_coef=0: the tiny Qwen3-Next is dense, with no router loss to add
        config = SFTConfig(padding_free=True, max_length=None, bf16=False, router_aux_loss_coef=0.0, **settings)
        trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(dataset),
                             processing_class=tiny_tokenizer(), callbacks=[PrintLoss()])
        trainer.data_collator = UlyssesRows(trainer.data_collator, world, length=row_length)
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=dataset,
                          data_collator=UlyssesRows(DataCollatorWithFlattening(), world, length=row_length),
                          callbacks=[PrintLoss()])
    trainer.train()
    # End the process groups (the world's and DeepSpeed's) before the interpreter's teardown: a gloo worker thread
    # still releasing a finished collective's tensors then needs the GIL, and exits the thread mid C++ frame:
    # "terminate called without an active exception" (SIGABRT) after a good run
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
