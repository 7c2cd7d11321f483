"""GRPO with TRL on packed rows: packfree's PackedGRPOTrainer scores every prompt + completion (the policy's, the old
policy's and the reference's log-probs) in one packed row per forward (docs/rl.md).

    python examples/grpo_trl.py --tiny                    # a tiny random Qwen3-Next, offline, seconds on a CPU
    python examples/grpo_trl.py --model path/to/model     # a saved causal LM (directory or hub name) and its tokenizer

TRL 1.16's GRPOTrainer pads its scoring batches: left-padded prompts, right-padded completions. `PackedGRPOTrainer`
is `trl.GRPOTrainer` with those forwards run on packed rows; generation, rewards, advantages, the loss and the KL are
TRL's, on the same per-token log-probs as padded. Give the model by path, with
`model_init_kwargs={"attn_implementation": "packfree"}`: TRL then loads the reference model (`beta > 0`) from the
same path the same way.
"""

from __future__ import annotations

import argparse
import tempfile

PROMPTS = ["2 + 3 =", "Name a colour:", "Say hi.", "The sky is", "Count to three:", "Ice is", "Spell cat:", "Hello"]


def reward_short_answers(completions: list[str], **kwargs) -> list[float]:
    """A toy reward: shorter completions score higher."""
    return [-float(len(completion)) for completion in completions]


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
    parser.add_argument("--output-dir", default="grpo-trl-output")
    args = parser.parse_args()
    if args.tiny == (args.model is not None):
        parser.error("give exactly one of --tiny and --model")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from packfree_plugin.integrations.trl import PackedGRPOTrainer

    folder = tempfile.TemporaryDirectory()
    if args.tiny:
        from packfree_plugin.cli.tiny import tiny_config, tiny_tokenizer

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config("qwen3_next")).save_pretrained(folder.name)
        path, tokenizer = folder.name, tiny_tokenizer()  # characters as tokens; ids fit the tiny vocabulary
    else:
        path, tokenizer = args.model, AutoTokenizer.from_pretrained(args.model)

    config = GRPOConfig(
        output_dir=args.output_dir,
        model_init_kwargs={"attn_implementation": "packfree"},  # the policy and TRL's reference model alike
        per_device_train_batch_size=4,
        num_generations=2,  # 2 prompts a step, 2 completions each
        max_completion_length=8,
        beta=0.1,  # a KL term, so TRL loads a reference model, whose forwards are packed too
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
                print(f"step {state.global_step}: reward {float(logs['reward']):.4g}, loss {float(logs['loss']):.4g}",
                      flush=True)

    trainer = PackedGRPOTrainer(model=path, reward_funcs=reward_short_answers, args=config,
                                train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in PROMPTS]),
                                processing_class=tokenizer, callbacks=[PrintLoss()],
                                max_tokens_per_row=None)  # None: a forward in one row; N: rows of at most N tokens
    show_packing(trainer.model, "policy")
    if trainer.ref_model is not None:
        show_packing(trainer.ref_model, "reference")
    trainer.train()
    folder.cleanup()


if __name__ == "__main__":
    main()
