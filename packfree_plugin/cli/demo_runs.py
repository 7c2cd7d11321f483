"""The demo's timed runs: one model trained by the HF ``Trainer`` from the same initial weights on the same samples,
once per way of running it (:func:`compare_training`, four runs):

- *stock padded*: stock ``sdpa``, each step padded to its longest sample;
- *packfree padded*: the same padded batches under ``attn_implementation="packfree"`` (packfree's ops alone);
- *floor*: packfree padded with every token-mixing layer (attention, Gated DeltaNet, ...) skipped
  (:func:`skip_token_mixers`): what the padded step costs if those layers cost nothing, the bound of the first gain.
  It is a timing bound, not a training run: its losses are not meant to agree;
- *packfree packed*: the *same* samples of each step in rows of at most ``max_tokens`` tokens
  (:class:`~packfree_plugin.cli.demo_batches.StepPacker`; by default one unpadded row per step).

The three runs that mix tokens must give the same per-step losses.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .demo_batches import PaddedCollator, StepPacker, demo_config, gdn_chunk, tokenize_gsm8k, work_units
from .load import LoadWatch

__all__ = ["FLOOR_NOTE", "WARMUP_STEPS", "DemoOptions", "RunResult", "build_model", "compare_training",
           "default_threads", "skip_token_mixers", "token_mixer_paths", "train"]


@dataclass
class DemoOptions:
    model_type: str = "qwen3_next"
    steps: int = 24
    batch_size: int = 16
    max_tokens: int = 4096
    hidden_size: int = 128
    num_layers: int = 4
    learning_rate: float = 2e-3
    seed: int = 0
    data_file: str | None = None
    out: str = "packfree-report"
    progress: bool = True
    threads: int | None = None  # torch CPU threads; None: half the cores (see default_threads)


@dataclass
class RunResult:
    label: str
    attn_implementation: str
    losses: list[float]
    seconds: float
    step_seconds: list[float]
    real_tokens: int
    slot_tokens: int  # tokens the model ran on, padding included
    step_real_tokens: list[int]
    step_slot_tokens: list[int]  # per step, where the collator can say (its ``layout``); else empty
    step_work: list[dict[str, int]] = field(default_factory=list)  # per step, :func:`work_units` of its layout

    @property
    def tokens_per_second(self) -> float:
        """Real tokens per second over the steps after the first :data:`WARMUP_STEPS` (each run warms up on its own
        first steps: allocator, thread pool, lazy imports), so neither run carries the other's warm-up."""
        timed = slice(WARMUP_STEPS, None) if len(self.step_seconds) > WARMUP_STEPS else slice(None)
        return sum(self.step_real_tokens[timed]) / sum(self.step_seconds[timed])

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.slot_tokens


FLOOR_NOTE = ("a timing bound, not a training result: every token-mixing layer returns its input, so its losses "
              "are not meant to agree with the others")
"""What the floor run is, printed beside it and in the report."""
WARMUP_STEPS = 2
"""Optimizer steps at the start of each run left out of its throughput."""


def default_threads() -> int:
    """Half the CPU cores, at least one. On a shared machine, BLAS/OpenMP threads that spin-wait for a core
    another process holds make step times jump by 10x and more (measured on 2 busy cores); one thread per two
    cores keeps both runs' timings comparable."""
    import os

    return max(1, (os.cpu_count() or 2) // 2)


def build_model(config, attn_implementation: str, state: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                *, auto_class: str = "AutoModelForCausalLM"):
    """A float32 model of ``config`` (copied) through ``transformers.<auto_class>``, with ``state`` if given."""
    import transformers

    if attn_implementation == "packfree":
        from ..loading.register import register

        register()
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(copy.deepcopy(config),
                                                          attn_implementation=attn_implementation, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def _bar_only():
    """transformers' progress bar without its end-of-training metrics dict (an unlabelled ``{'train_runtime':
    ...}`` per run; :func:`train` says what each run was)."""
    from transformers import ProgressCallback

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            return None

    return BarOnly


def train(model, features: list[dict[str, Any]], collator: Callable, *, steps: int, batch_size: int,
          learning_rate: float, seed: int, out: str | Path, label: str, progress: bool = True,
          chunk: int | None = None, note: str = "", echo: Callable[[str], None] | None = print) -> RunResult:
    """``steps`` optimizer steps of the HF ``Trainer`` on ``features`` (dicts with ``input_ids``, and whatever
    else the collator reads) in order, ``batch_size`` per step. ``chunk``: as :func:`work_units`'.

    ``echo`` gets one line naming the run (``label``, its attention, ``note``: what it is for) before it starts
    and one with its first and last loss after; the Trainer's own end-of-training metrics dict is not printed."""
    from transformers import PrinterCallback, ProgressCallback, Trainer, TrainerCallback, TrainingArguments

    losses: list[float] = []
    step_seconds: list[float] = []
    clock: dict[str, float] = {}

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["begin"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            clock["step"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - clock["step"])

        def on_train_end(self, args, state, control, **kwargs):
            clock["end"] = time.perf_counter()

    class LossRecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            losses.append(float(loss.detach()))
            return result

    args = TrainingArguments(
        output_dir=str(Path(out) / f"trainer-{label}"), per_device_train_batch_size=batch_size, max_steps=steps,
        learning_rate=learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        seed=seed, data_seed=seed, train_sampling_strategy="sequential", logging_strategy="no",
        save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        dataloader_pin_memory=False, disable_tqdm=not progress, remove_unused_columns=False,
    )
    dataset = features[: steps * batch_size]
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                                   callbacks=[Recorder()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if progress:
        trainer.add_callback(_bar_only())
    what = f"training run: {label} ({model.config._attn_implementation}), {steps} steps of {batch_size} samples"
    if echo:
        echo(what + (f"; {note}" if note else ""))
    counts_slots = hasattr(collator, "slot_tokens")  # a collator that counts its tokens as it goes (demo_vlm's)
    if counts_slots:
        collator.slot_tokens = 0
    trainer.train()
    lengths = [len(s["input_ids"]) for s in dataset]
    step_real = [sum(lengths[i:i + batch_size]) for i in range(0, len(lengths), batch_size)]
    step_work = ([work_units(collator.layout(dataset[i:i + batch_size]), chunk=chunk)
                  for i in range(0, len(dataset), batch_size)] if hasattr(collator, "layout") else [])
    step_slots = [work["tokens run"] for work in step_work]
    slots = sum(step_slots) if step_slots else collator.slot_tokens if counts_slots else sum(lengths)
    if echo and losses:
        echo(f"  {label}: loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {len(losses)}")
    return RunResult(label, model.config._attn_implementation, losses, clock["end"] - clock["begin"], step_seconds,
                     sum(lengths), slots, step_real, step_slots, step_work)


def compare_training(options: DemoOptions) -> dict[str, Any]:
    """Tokenize, build one initial model, and train it four times (the module docstring). Returns a dict with
    the :class:`RunResult` of ``padded`` (stock), ``packfree_padded``, ``floor`` and ``packed``, the ``skipped``
    layer paths, the config, the stock padded and packed trained models, and the machine's ``load`` (a
    :class:`~packfree_plugin.cli.load.LoadWatch` sampled before and after the runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads or default_threads())
    try:
        with LoadWatch() as load:
            result = _compare(options)
        return {**result, "load": load}
    finally:
        torch.set_num_threads(threads)


def token_mixer_paths(config) -> list[str]:
    """Module paths of every layer of ``config``'s causal LM that mixes tokens along the sequence (attention,
    Gated DeltaNet, Mamba, convs, ...), as ``packfree doctor`` lists them."""
    import tempfile

    from .doctor import plan

    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        return [layer.path for layer in plan(folder, device="cpu", dtype=torch.float32)]


def skip_token_mixers(model, paths: Sequence[str]) -> None:
    """Make each module at ``paths`` of ``model`` return its input ``hidden_states`` unchanged (in the structure its
    own forward returns: a tensor, or a tuple whose other entries are ``None``), so that what is left of a step is
    everything but those layers' own work."""
    for path in paths:
        module = model.get_submodule(path)
        forward = module.forward
        width: list[int | None] = []  # learned from one real call: None for a tensor, n for an n-tuple

        def skipped(*args, forward=forward, width=width, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if not width:
                with torch.no_grad():
                    output = forward(*args, **kwargs)
                width.append(len(output) if isinstance(output, tuple) else None)
            return hidden if width[0] is None else (hidden, *([None] * (width[0] - 1)))

        module.forward = skipped


def _compare(options: DemoOptions) -> dict[str, Any]:
    count = options.steps * options.batch_size
    samples, vocab = tokenize_gsm8k(count, data_file=options.data_file, max_tokens=options.max_tokens,
                                    progress=options.progress)
    config = demo_config(options.model_type, vocab, hidden_size=options.hidden_size, num_layers=options.num_layers)
    initial = build_model(config, "eager", seed=options.seed).state_dict()
    initial = {k: v.clone() for k, v in initial.items()}
    common = dict(steps=options.steps, batch_size=options.batch_size, learning_rate=options.learning_rate,
                  seed=options.seed, out=options.out, progress=options.progress, chunk=gdn_chunk(config))
    try:
        padded_model = build_model(config, "sdpa", initial, options.seed)
    except ValueError:  # a family without an sdpa path (Mamba2): its stock implementation is eager
        padded_model = build_model(config, "eager", initial, options.seed)
    features = [{"input_ids": sample} for sample in samples]
    padded = train(padded_model, features, PaddedCollator(), label="stock padded", **common)
    packfree_padded_model = build_model(config, "packfree", initial, options.seed)
    packfree_padded = train(packfree_padded_model, features, PaddedCollator(), label="packfree padded", **common)
    floor_model = build_model(config, "packfree", initial, options.seed)
    skipped = token_mixer_paths(config)
    skip_token_mixers(floor_model, skipped)
    floor = train(floor_model, features, PaddedCollator(), label="floor: packfree padded, token mixers skipped",
                  note=FLOOR_NOTE, **common)
    packed_model = build_model(config, "packfree", initial, options.seed)
    packed = train(packed_model, features, StepPacker(options.max_tokens), label="packfree packed", **common)
    return {"padded": padded, "packfree_padded": packfree_padded, "floor": floor, "packed": packed,
            "skipped": skipped, "config": config, "vocab": vocab, "samples": count, "padded_model": padded_model,
            "packed_model": packed_model}
