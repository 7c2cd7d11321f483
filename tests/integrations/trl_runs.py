"""Shared helpers for the TRL integration tests: tiny text data, model pairs, and one training run recorded
(per-step logs and the gradients seen just before each optimizer step)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from transformers import AutoModelForCausalLM

from packfree_plugin.cli.tiny import tiny_config

STOCK = {"mamba2": "eager"}
"""Stock implementation of the padded reference (pure Mamba has no sdpa path); sdpa otherwise."""

LM_HEAD_TOLERANCE = 1e-6
"""Relative tolerance of packed against padded log-prob paths: TRL's fused LM head computes its log-softmax in
float32 whatever the model's dtype, so float64 hidden states that agree to 1e-15 can land one float32 ulp apart
(1.2e-7 relative) in a log-prob, and one step's update carries that into the next."""
TOLERANCE = {"qwen3_next": 2e-6, "qwen3_5_text": 2e-6, "mamba2": 3e-5}
"""Stock's Gated DeltaNet and Mamba2 torch paths also compute in float32 inside (norms, gates); stock Mamba2 runs
GRPO's left-padded prompts through its masked path. On a float64 tiny Mamba2 one forward/backward of four samples
puts gradients 6.6e-8 (stock left-padded) and 1.3e-7 (packfree packed) from stock with each sample alone; GRPO's
step-0 gradients then differ by 2.7e-6 and step 1's, after an update, by 1.2e-5 on a Xeon (under 1e-5 on an EPYC)."""


@pytest.fixture
def packings(monkeypatch) -> list:
    """The :class:`PackedRows` of every packed forward during the test (proof that it packed, and how)."""
    from packfree_plugin.integrations.trl import PackedRows

    seen: list[PackedRows] = []
    original = PackedRows.of.__func__

    def counting(cls, *args, **kwargs):
        rows = original(cls, *args, **kwargs)
        seen.append(rows)
        return rows

    monkeypatch.setattr(PackedRows, "of", classmethod(counting))
    return seen


def tolerance(model_type: str) -> float:
    return TOLERANCE.get(model_type, LM_HEAD_TOLERANCE)


def text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyz0123456789+=") for _ in range(length))


def preference_rows(count: int, *, seed: int = 0, empty_prompt: bool = True) -> list[dict[str, str]]:
    """``count`` prompt / chosen / rejected rows of varied lengths; with ``empty_prompt`` the first has an empty
    prompt, so its completion starts at the sample's first token (which nothing may predict)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        prompt = "" if empty_prompt and index == 0 else text(rng, rng.randint(2, 14))
        rows.append({"prompt": prompt, "chosen": text(rng, rng.randint(1, 12)), "rejected": text(rng, rng.randint(1, 12))})
    return rows


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True,
           router_aux_loss_coef=0.05, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Qwen3-MoE kept small (its shrunk default keeps 128 experts) and returning router logits, so TRL adds the
load-balancing loss, which packing must leave unchanged."""


def _model(model_type: str, implementation: str, seed: int, dtype: torch.dtype, head: Any):
    import packfree_plugin

    packfree_plugin.register()
    config = tiny_config(model_type, **(MOE if model_type == "qwen3_moe" else {}))
    if head is not None:
        config.num_labels = 1
    torch.manual_seed(seed)
    cls = head or AutoModelForCausalLM
    return cls.from_config(config, attn_implementation=implementation, dtype=dtype, experts_implementation="eager")


def models(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, head: Any = None) -> tuple[Any, Any]:
    """``(packfree, stock)`` tiny models (causal LMs, or the ``head`` auto class) with the same random weights."""
    packed = _model(model_type, "packfree", seed, dtype, head)
    stock = _model(model_type, STOCK.get(model_type, "sdpa"), seed, dtype, head)
    stock.load_state_dict(packed.state_dict())
    return packed.train(), stock.train()


def common_config(tmp_path, **overrides: Any) -> dict[str, Any]:
    """Training arguments both runs share: full precision, no shuffling, a log and a gradient record every step,
    plain SGD (Adam would turn rounding-level differences in near-zero gradients into steps of a full learning rate)."""
    return {**dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.5, optim="sgd",
                   lr_scheduler_type="constant", report_to="none", logging_steps=1, save_strategy="no", use_cpu=True,
                   train_sampling_strategy="sequential", disable_tqdm=True, bf16=False, max_grad_norm=0.0,
                   dataloader_drop_last=True), **overrides}


@dataclass
class Record:
    losses: list[float] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    gradients: list[dict[str, torch.Tensor]] = field(default_factory=list)


def recorder(record: Record):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            record.gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                                     if p.grad is not None})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record.logs.append(dict(logs))

    return Recorder()


def train(trainer) -> Record:
    """Train, recording each step's loss (unrounded, as ``compute_loss`` returns it), logs and gradients."""
    record = Record()
    trainer.add_callback(recorder(record))
    compute_loss = trainer.compute_loss

    def recording(*args, **kwargs):
        result = compute_loss(*args, **kwargs)
        record.losses.append(float((result[0] if isinstance(result, tuple) else result).detach()))
        return result

    trainer.compute_loss = recording
    trainer.train()
    return record


def worst_relative(packed: dict[str, torch.Tensor], padded: dict[str, torch.Tensor]) -> float:
    """Largest ``|packed - padded|`` over all gradients, relative to the largest padded gradient entry (absolute
    when every padded gradient is 0)."""
    assert packed.keys() == padded.keys(), sorted(packed.keys() ^ padded.keys())
    scale = max(float(g.abs().max()) for g in padded.values())
    if scale == 0.0:
        return max(float(g.abs().max()) for g in packed.values())
    return max(float((packed[name] - padded[name]).abs().max()) for name in padded) / scale


def assert_runs_equal(packed: Record, padded: Record, *, rtol: float, keys: tuple[str, ...],
                      scale_key: str | None = None) -> None:
    """Same loss, logged values (each key) and gradients at every step, to ``rtol`` of each value, or of the step's
    ``scale_key`` value (DPO's log-prob sums: rewards are differences of them, as exact as they are)."""
    assert len(packed.logs) == len(padded.logs) > 0 and len(packed.gradients) == len(padded.gradients) > 0
    for step, (mine, theirs) in enumerate(zip(packed.losses, padded.losses)):
        assert abs(mine - theirs) <= rtol * max(1.0, abs(theirs)), f"step {step} loss: {mine} vs {theirs}"
    for step, (mine, theirs) in enumerate(zip(packed.logs, padded.logs)):
        assert set(keys) & theirs.keys() == set(keys) & mine.keys(), step
        for key in set(keys) & theirs.keys():  # a step logs what it computed (GRPO rewards at generation steps)
            scale = max(1.0, abs(theirs[key]), abs(theirs.get(scale_key, 0.0)))
            assert abs(mine[key] - theirs[key]) <= rtol * scale, f"step {step} {key}: {mine[key]} vs {theirs[key]}"
    for step, (mine, theirs) in enumerate(zip(packed.gradients, padded.gradients)):
        assert worst_relative(mine, theirs) <= rtol, f"step {step} gradients differ by {worst_relative(mine, theirs)}"
