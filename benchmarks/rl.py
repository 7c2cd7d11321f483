"""DPO and GRPO scoring steps on GSM8K-shaped data: TRL's padded rows against packfree's packed rows, one run.

Both steps are what TRL's trainers run per batch, through TRL's own fused LM head (``add_fused_lm_head``):

- **DPO**: 8 pairs of the embedded GSM8K split, prompt = a question, chosen = its answer, rejected = another
  question's answer (character tokens, each sequence cut at 384), laid out as ``DataCollatorForPreference`` does
  (16 right-padded rows); the policy's forward + backward of the per-sequence log-prob sums and the reference's
  forward.
- **GRPO**: 4 questions x 4 completions of 16-320 tokens (answers cut at random lengths, as sampled completions
  end), left-padded prompts + right-padded completions as ``GRPOTrainer`` scores them; the policy's forward +
  backward and the reference's forward.

"padded" runs stock ``sdpa`` on those rows; "packed" runs packfree with
:func:`packfree_plugin.integrations.trl.pack_scoring`, all samples of a step in one row. Reported: real
(non-padding) tokens per second and the ratio packed / padded, the peak extra resident memory of the timed steps
(each case in its own subprocess, the peak reset once the models and rows are built) and padded / packed, and the
**padding ceiling**, which the speed ratio may not exceed beyond noise: the larger of the token ratio (tokens run
padded / packed: what the per-token layers can save) and the attention-pair ratio (padded ``B * W**2``, which sdpa
computes whole under a padding mask, / each sample's own ``L**2``), since a step's cost is a sum of the two kinds of
work. ``noise`` is the largest relative spread (max / min - 1) of either case's timed repeats, and ``within
ceiling`` is ``speed ratio <= ceiling * (1 + noise)``. The memory ratio has no such ceiling: padded sdpa holds
per-row ``W x W`` attention terms.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

from benchmarks.memory import current_mib, peak_mib, reset_peak

MAX_SEQUENCE = 384


def _rows(kind: str, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, labels)`` of one step, ``[B, L]`` as TRL pads them."""
    import torch

    from packfree_plugin.cli.tiny import tiny_tokenizer
    from packfree_plugin.cli.data import load_gsm8k

    tokenizer, rng = tiny_tokenizer(), random.Random(seed)
    records = load_gsm8k(limit=64)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    rows: list[tuple[list[int], int, int]] = []  # (ids, first real position in the padded row, prompt length)
    if kind == "dpo":
        pairs = [(encode(r["question"] + "\n"), encode(r["answer"] + "<eos>"), encode(o["answer"] + "<eos>"))
                 for r, o in zip(records[:8], records[8:16])]
        rows = [((pair[0] + pair[c])[:MAX_SEQUENCE], 0, len(pair[0])) for c in (1, 2) for pair in pairs]  # chosen rows, then rejected
        width = max(len(ids) for ids, _, _ in rows)
    else:
        prompts = [encode(r["question"] + "\n") for r in records[:4]]
        longest = max(len(p) for p in prompts)
        completions = [encode(records[4 + i]["answer"] + "<eos>")[:rng.randint(16, 320)] for i in range(16)]
        width = longest + max(len(c) for c in completions)
        rows = [(prompts[i // 4] + completions[i], longest - len(prompts[i // 4]), len(prompts[i // 4]))
                for i in range(16)]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (tokens, start, prompt) in enumerate(rows):
        ids[row, start:start + len(tokens)] = torch.tensor(tokens)
        mask[row, start:start + len(tokens)] = 1
        labels[row, start + prompt:start + len(tokens)] = torch.tensor(tokens[prompt:])
    return ids, mask, labels


def _model(implementation: str):
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from packfree_plugin.cli.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32)
    add_fused_lm_head(model)
    if implementation == "packfree":
        from packfree_plugin.integrations.trl import pack_scoring

        pack_scoring(model)
    return model


def run_case(kind: str, method: str, repeats: int) -> dict[str, Any]:
    """Time ``repeats`` steps of ``kind`` (dpo / grpo) with ``method`` (padded / packed)."""
    import torch

    from packfree_plugin.integrations.trl import PackedRows

    torch.set_num_threads(2)
    ids, mask, labels = _rows(kind)
    policy = _model("packfree" if method == "packed" else "sdpa").train()
    reference = _model("packfree" if method == "packed" else "sdpa").eval()
    baseline = current_mib()
    reset_peak()

    def step() -> None:
        policy.zero_grad(set_to_none=True)
        with torch.no_grad():
            reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out = policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.log_probs.sum(dim=1).mean().backward()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    rows, lengths = PackedRows.of(mask), mask.sum(dim=1)
    return {"step": kind, "method": method, "real_tokens": int(mask.sum()), "padded_tokens": rows.padded_tokens,
            "packed_tokens": rows.packed_tokens, "padded_pairs": mask.shape[0] * mask.shape[1] ** 2,
            "packed_pairs": int(lengths.square().sum()), "seconds": min(times), "spread": max(times) / min(times) - 1,
            "peak_extra_mib": peak_mib() - baseline}


def measure(kind: str, method: str, repeats: int) -> dict[str, Any]:
    """One case in a fresh subprocess, so its peak resident memory is its own."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.rl", "--case", kind, method, str(repeats)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict[str, Any]]:
    repeats = 2 if quick else 5
    rows = []
    for kind in ("dpo", "grpo"):
        padded, packed = measure(kind, "padded", repeats), measure(kind, "packed", repeats)
        token_ceiling = padded["padded_tokens"] / packed["packed_tokens"]
        pair_ceiling = padded["padded_pairs"] / packed["packed_pairs"]
        ceiling = max(token_ceiling, pair_ceiling)
        noise = max(padded["spread"], packed["spread"])
        speed = padded["seconds"] / packed["seconds"]
        memory = padded["peak_extra_mib"] / max(packed["peak_extra_mib"], 1e-9)
        rows.append({
            "step": kind.upper(), "real tokens": padded["real_tokens"],
            "padded tok/s": padded["real_tokens"] / padded["seconds"],
            "packed tok/s": packed["real_tokens"] / packed["seconds"], "speed ratio": speed,
            "padded peak MiB": padded["peak_extra_mib"], "packed peak MiB": packed["peak_extra_mib"],
            "memory ratio": memory, "token ceiling": token_ceiling, "pair ceiling": pair_ceiling, "ceiling": ceiling,
            "noise": noise,
            "within ceiling": speed <= ceiling * (1 + noise),
        })
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", nargs=3, metavar=("STEP", "METHOD", "REPEATS"))
    options = parser.parse_args()
    if options.case:
        step_kind, method_name, count = options.case
        print(json.dumps(run_case(step_kind, method_name, int(count))))
    else:
        from benchmarks.__main__ import _table

        print(_table(run(quick=options.quick)))
