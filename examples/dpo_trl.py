"""DPO with TRL on packed rows: packfree's PackedDPOTrainer scores every prompt + chosen and prompt + rejected in
one packed row per batch (docs/rl.md).

    python examples/dpo_trl.py --tiny                    # a tiny random Qwen3-Next, offline, seconds on a CPU
    python examples/dpo_trl.py --model path/to/model     # a saved causal LM (directory or hub name) and its tokenizer

TRL 1.16 itself pads DPO batches (`DPOConfig(padding_free=True)` logs that it is unavailable). `PackedDPOTrainer`
is `trl.DPOTrainer` with the policy's and the reference model's scoring forwards run on packed rows; the loss, the
metrics and the gradients are TRL's, per pair, as padded. Both models must be loaded with
`attn_implementation="packfree"`; it raises a `ValueError` otherwise. `PackedRewardTrainer` and `PackedGRPOTrainer`
(same module) do the same for reward models and GRPO.
"""

from __future__ import annotations

import argparse

PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": " 5.", "rejected": " 6, or maybe 7."},
    {"prompt": "Name a colour.", "chosen": " Blue.", "rejected": " A number."},
    {"prompt": "", "chosen": "Hello.", "rejected": "Bye, see you later."},
    {"prompt": "Is ice cold?", "chosen": " Yes, it is cold.", "rejected": " No."},
    {"prompt": "Spell cat.", "chosen": " c-a-t", "rejected": " d-o-g"},
    {"prompt": "What comes after Monday?", "chosen": " Tuesday.", "rejected": " Sunday."},
    {"prompt": "Half of ten?", "chosen": " Five.", "rejected": " Twenty."},
    {"prompt": "Say hi.", "chosen": " Hi!", "rejected": " ..."},
]


def show_packing(model, role: str) -> None:
    """Print, once per ``role``, how one scoring forward ran: the padded batch TRL built and the packed row(s) the
    backbone was given inside that call (``position_ids`` restart at every sample)."""
    state: dict[str, object] = {}

    def enter(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("fused_lm_head") and mask is not None and mask.ndim == 2:
            state["padded"] = tuple(mask.shape)

    def leave(module, args, kwargs, output):
        state.pop("padded", None)

    def backbone(module, args, kwargs):
        if "padded" in state and not state.get("shown") and kwargs.get("position_ids") is not None:
            rows, tokens = kwargs["input_ids"].shape
            starts = int((kwargs["position_ids"] == 0).sum())
            sequences, length = state["padded"]
            print(f"{role} scoring forward: {sequences} sequences (TRL's padded batch: {sequences} rows of {length} "
                  f"tokens) ran as {rows} row of {tokens} tokens, position_ids restarting {starts} times", flush=True)
            state["shown"] = True

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True)
    model.base_model.register_forward_pre_hook(backbone, with_kwargs=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a saved causal LM: directory or hub name")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3-Next instead (nothing downloaded)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output-dir", default="dpo-trl-output")
    args = parser.parse_args()
    if args.tiny == (args.model is not None):
        parser.error("give exactly one of --tiny and --model")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig

    from packfree_plugin.integrations.trl import PackedDPOTrainer

    if args.tiny:
        from packfree_plugin.cli.tiny import tiny_config, tiny_tokenizer

        # each model gets its own config: the trainer may change one model's config, never the other's
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation="packfree")
        reference = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"), attn_implementation="packfree")
        reference.load_state_dict(model.state_dict())  # DPO's reference: the policy before training
        tokenizer = tiny_tokenizer()  # characters as tokens; ids fit the tiny vocabulary
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="packfree")
        reference = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="packfree")
        tokenizer = AutoTokenizer.from_pretrained(args.model)

    config = DPOConfig(
        output_dir=args.output_dir,
        padding_free=True,  # TRL's own flag; PackedDPOTrainer packs when it is on
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

    trainer = PackedDPOTrainer(model=model, ref_model=reference, args=config, train_dataset=Dataset.from_list(PAIRS),
                               processing_class=tokenizer, callbacks=[PrintLoss()],
                               max_tokens_per_row=None)  # None: a batch in one row; N: rows of at most N tokens
    show_packing(trainer.model, "policy")
    show_packing(trainer.ref_model, "reference")
    trainer.train()


if __name__ == "__main__":
    main()
