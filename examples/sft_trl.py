"""Supervised fine-tuning with TRL's SFTTrainer on packed rows, on a hybrid (Qwen3-Next: Gated DeltaNet + attention).

    python examples/sft_trl.py --tiny                    # a tiny random Qwen3-Next, offline, seconds on a CPU
    python examples/sft_trl.py --model path/to/model     # a saved causal LM (directory or hub name) and its tokenizer

`SFTConfig(padding_free=True)` makes TRL's collator put each batch into one row, with `position_ids` restarting at
every sample (and `cu_seq_lens`, `seq_idx`); loaded with `attn_implementation="packfree"`, every layer of the model,
the Gated DeltaNet and convolution layers included, keeps those samples apart. TRL 1.16 also needs:

- `max_length=None` when `padding_free=True` without `packing=True`: it refuses to truncate a row it did not pack;
- a `processing_class` (tokenizer): TRL loads one from the model's path otherwise, and a model built with
  `from_config` has none.
"""

from __future__ import annotations

import argparse

TEXTS = [
    "Packed rows hold several samples one after another.",
    "Each sample is trained as if it ran alone.",
    "No padding tokens are computed.",
    "A hybrid mixes tokens with Gated DeltaNet and attention.",
    "Short one.",
    "The loss of a packed batch equals the padded batch's loss.",
    "Position ids restart at every sample.",
    "Eight samples make two steps of four.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a saved causal LM: directory or hub name")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3-Next instead (nothing downloaded)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output-dir", default="sft-trl-output")
    args = parser.parse_args()
    if args.tiny == (args.model is not None):
        parser.error("give exactly one of --tiny and --model")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if args.tiny:
        from packfree_plugin.cli.tiny import tiny_config, tiny_tokenizer

        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation="packfree")
        tokenizer = tiny_tokenizer()  # characters as tokens; ids fit the tiny vocabulary
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="packfree")
        tokenizer = AutoTokenizer.from_pretrained(args.model)

    config = SFTConfig(
        output_dir=args.output_dir,
        padding_free=True,  # one row per batch, position_ids restarting per sample
        max_length=None,  # TRL 1.16: required with padding_free=True unless packing=True
        per_device_train_batch_size=4,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,  # TRL turns bf16 on by default, also on a CPU
        # the tiny Qwen3-Next is dense (no experts): it has no router loss to add
        **({"router_aux_loss_coef": 0.0} if args.tiny else {}),
    )

    class PrintLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"step {state.global_step}: loss {float(logs['loss']):.4g}", flush=True)

    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": TEXTS}),
                         processing_class=tokenizer, callbacks=[PrintLoss()])
    batch = trainer.data_collator([trainer.train_dataset[index] for index in range(4)])
    rows, tokens = batch["input_ids"].shape
    starts = batch["position_ids"][0].tolist().count(0)
    print(f"a batch of 4 samples: {rows} row of {tokens} tokens, position_ids restarting {starts} times", flush=True)
    trainer.train()


if __name__ == "__main__":
    main()
