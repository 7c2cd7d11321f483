"""The plain transformers Trainer on packed rows: DataCollatorWithFlattening puts each batch into one row, and
packfree keeps its samples apart in every layer.

    python examples/trainer_flattening.py --tiny                    # a tiny random Qwen3-Next, offline, seconds
    python examples/trainer_flattening.py --model path/to/model     # a saved causal LM and its tokenizer

DataCollatorWithFlattening concatenates a batch's samples into one row of shape [1, total tokens], restarts
`position_ids` at every sample and sets the label of each sample's first token to -100, so no sample predicts
the next one's first token. With `attn_implementation="packfree"`, attention and the Gated DeltaNet and
convolution layers of the hybrid see each sample alone: the loss and the gradients are those of the samples run
one by one.
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
    parser.add_argument("--output-dir", default="trainer-output")
    args = parser.parse_args()
    if args.tiny == (args.model is not None):
        parser.error("give exactly one of --tiny and --model")

    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer,
                              TrainerCallback, TrainingArguments)

    if args.tiny:
        from packfree_plugin.cli.tiny import tiny_config, tiny_tokenizer

        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation="packfree")
        tokenizer = tiny_tokenizer()  # characters as tokens; ids fit the tiny vocabulary
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="packfree")
        tokenizer = AutoTokenizer.from_pretrained(args.model)

    samples = [{"input_ids": tokenizer(text)["input_ids"]} for text in TEXTS]  # unpadded, of any length
    collator = DataCollatorWithFlattening()  # labels = input_ids, -100 at each sample's first token
    batch = collator(samples[:4])
    rows, tokens = batch["input_ids"].shape
    starts = batch["position_ids"][0].tolist().count(0)
    print(f"a batch of 4 samples: {rows} row of {tokens} tokens, position_ids restarting {starts} times", flush=True)

    class PrintLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"step {state.global_step}: loss {float(logs['loss']):.4g}", flush=True)

    arguments = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=4, max_steps=args.steps,
                                  learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                                  disable_tqdm=True)
    Trainer(model=model, args=arguments, train_dataset=samples, data_collator=collator,
            callbacks=[PrintLoss()]).train()


if __name__ == "__main__":
    main()
