"""The HF Trainer with accelerate's sequence-parallel config (``ParallelismConfig(sp_backend="deepspeed", sp_size=P)``)
trains a packfree model exactly: one Trainer step over P gloo CPU ranks, in a DeepSpeed engine (ZeRO 0-3, float32),
gives the loss and every parameter's gradient (as the engine holds it before the optimizer step) of the stock model
(eager attention, the same weights) run on each sample of the row alone (tests/parallel/cases.py).

The user's side is what docs/distributed.md shows: the model loaded with ``attn_implementation="packfree"``,
``sp_attn_implementation`` unset (``sp_allow_recurrent_layers=True`` for the Gated DeltaNet model, which accelerate
refuses otherwise), the collator wrapped in :class:`~packfree_plugin.integrations.deepspeed.UlyssesRows`. Tolerance:
float32, 1e-5 relative (loss and gradients).

Also: data parallelism over two sequence-parallel groups of 2 ranks, each group with its own row (the engine's
gradients are the two rows' averaged; ``nox -s distributed``); evaluation after the step (whole rows unsplit,
DeepSpeed's ``disable_in_eval``) equals the stock model on each sample alone with the trained weights; the refusals a
user meets on the stock path are packfree's, naming the fix; a planted bug (the Trainer's ZeRO-3 loss scale dropped)
moves the gradients. The default suite runs :data:`DEFAULT` (one spawn of 2 ranks); ``nox -s distributed``
(PACKFREE_SP_FULL=1) runs :data:`FULL` too.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, replace
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import COLLECTIVE_SECONDS, wait_for_ranks
from tests.parallel.cases import (
    CASE_SECONDS, START_SECONDS, Case, _batch, _free_port, _model, relative_error, run_on_rank, start_rank, stock_alone,
    targets_of,
)

TOLERANCE = 1e-5
"""float32 in the DeepSpeed engine, on both sides (measured: see docs/distributed.md)."""
ODD, EDGES2, EDGES4 = (5, 9, 3), (8, 1, 1, 7), (4, 1, 4, 1, 1, 8, 1)
SECOND = (3, 6, 2, 5)  # the second data-parallel group's row: as many samples as EDGES2, other tokens
MLA = (("v_head_dim", 8),)  # DeepSeek-V3's latent attention: v narrower than q/k


@dataclass(frozen=True)
class Run:
    model_type: str
    lengths: tuple[int, ...]
    zero: int = 0
    world: int = 2
    overrides: tuple[tuple[str, object], ...] = ()
    plant: str | None = None  # "scale": the Trainer's ZeRO-3 loss scale dropped
    stock: str | None = None  # load the model with this stock attention (a refusal case)
    sp_attn: str | None = None  # sp_attn_implementation (None: unset, as packfree's route wants)
    evaluate: bool = False  # evaluate after the step (whole rows, unsplit)
    padded: bool = False  # the collator pads rows (one per sample) instead of UlyssesRows (a refusal case)
    sp: int | None = None  # the sequence-parallel size (None: the world); the rest is data parallelism
    other: tuple[int, ...] | None = None  # the row of the second data-parallel group (with sp = world / 2)
    disable_in_eval: bool = True  # accelerate's sp_disable_in_eval (False: eval stays sequence-parallel)

    @property
    def name(self) -> str:
        parallel = f"{self.world}ranks" + (f"-sp{self.sp}" if self.sp else "")
        rows = "-".join(map(str, self.lengths)) + (f"+{'-'.join(map(str, self.other))}" if self.other else "")
        parts = [self.model_type, f"zero{self.zero}", parallel, rows]
        extra = [f"{key}={value}" for key, value in self.overrides]
        flags = [flag for flag, on in (("eval", self.evaluate), (f"stock={self.stock}", self.stock),
                                       (f"sp_attn={self.sp_attn}", self.sp_attn), (self.plant, self.plant),
                                       ("padded", self.padded), ("sp_eval", not self.disable_in_eval)) if on]
        return "/".join(parts + extra + flags)

    @property
    def case(self) -> Case:
        """The reference's case: the same model, weights and row, float32."""
        return Case(self.model_type, self.lengths, "ulysses", dtype=torch.float32, overrides=self.overrides,
                    world=self.world)


DEFAULT = [
    Run("llama", EDGES2, zero=0, evaluate=True),
    Run("llama", ODD, zero=3),
    Run("qwen3_next", EDGES2, zero=1),
    Run("mamba2", ODD, zero=2),
    Run("granitemoehybrid", ODD, zero=0),
    Run("deepseek_v3", ODD, zero=0, overrides=MLA),
]
DEFAULT_PLANTED = [Run("llama", ODD, zero=3, plant="scale")]
REFUSED = {
    # run: what the refusal says
    Run("llama", ODD, sp_attn="sdpa"): "sp_attn_implementation='sdpa'.*Leave sp_attn_implementation unset",
    Run("llama", ODD, stock="sdpa", sp_attn="sdpa"):
        "packed row.*reached sdpa attention.*attn_implementation='packfree'",
    Run("granitemoehybrid", ODD, stock="sdpa", sp_attn="sdpa"): "mixes tokens outside attention.*'packfree'",
    Run("llama", EDGES2, padded=True): "a batch of 4 rows.*UlyssesRows",
}
FULL = [
    *(Run(model_type, lengths, zero=zero, overrides=overrides)
      for model_type, lengths, overrides in (("llama", ODD, ()), ("qwen3_next", ODD, ()), ("mamba2", EDGES2, ()),
                                             ("granitemoehybrid", EDGES2, ()), ("deepseek_v3", EDGES2, MLA))
      for zero in (0, 1, 2, 3)),
    Run("qwen3_next", EDGES2, zero=3, evaluate=True),
    *(Run(model_type, EDGES4, zero=zero, world=4, overrides=overrides)
      for model_type, overrides, zero in (("llama", (), 0), ("llama", (), 3),
                                          ("qwen3_next", (("linear_num_key_heads", 4),), 2),
                                          ("mamba2", (("n_groups", 2),), 1), ("granitemoehybrid", (), 3),
                                          ("deepseek_v3", MLA, 0))),
    # data parallelism over two sequence-parallel groups, each with its own row
    Run("llama", EDGES2, zero=0, world=4, sp=2, other=SECOND),
    Run("qwen3_next", EDGES2, zero=3, world=4, sp=2, other=SECOND),
    Run("granitemoehybrid", EDGES2, zero=2, world=4, sp=2, other=SECOND),
]
RUN_FULL = os.environ.get("PACKFREE_SP_FULL") == "1"
EXACT = DEFAULT + (FULL if RUN_FULL else [])
PLANTED = DEFAULT_PLANTED


def _samples(run: Run) -> list[dict[str, list[int]]]:
    """The row's samples, in order (the reference's: tests/parallel/cases.py)."""
    tokens, start, samples = _batch(run.case)["input_ids"][0].tolist(), 0, []
    for length in run.lengths:
        samples.append({"input_ids": tokens[start:start + length]})
        start += length
    return samples


def _trainer(run: Run, model: torch.nn.Module, output_dir: str):
    """A Trainer as docs/distributed.md sets it up: parallelism config, DeepSpeed, one packed row per batch."""
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from packfree_plugin.integrations.deepspeed import UlyssesRows

    handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation=run.sp_attn, sp_allow_recurrent_layers=True,
                                              sp_disable_in_eval=run.disable_in_eval)
    sp = run.sp or run.world
    parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_shard_size=run.world // sp,
                                    sp_handler=handler)
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "zero_optimization": {"stage": run.zero}}
    samples = _samples(run)
    train = samples
    if run.other:  # batch i goes to rank i: ranks 0, 1 (the first group) get this row, ranks 2, 3 the other
        assert run.world == 4 and run.sp == 2 and len(run.other) == len(run.lengths)
        other = _samples(replace(run, lengths=run.other))
        train = samples + samples + other + other
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=len(samples),
                             per_device_eval_batch_size=len(samples), max_steps=1, use_cpu=True,
                             parallelism_config=parallelism, deepspeed=deepspeed, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential")
    collator = _padded_rows if run.padded else UlyssesRows(DataCollatorWithFlattening(), sp)
    return Trainer(model=model, args=args, train_dataset=train, eval_dataset=samples, data_collator=collator)


def _padded_rows(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """One right-padded row per sample ``[B, L]`` with ``position_ids`` and ``labels`` (what Ulysses' data loader
    adapter takes, without UlyssesRows)."""
    width = max(len(feature["input_ids"]) for feature in features)
    tokens = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full_like(tokens, -100)
    for row, feature in enumerate(features):
        tokens[row, :len(feature["input_ids"])] = labels[row, :len(feature["input_ids"])] = torch.tensor(
            feature["input_ids"])
    return {"input_ids": tokens, "position_ids": torch.arange(width).expand_as(tokens).clone(), "labels": labels}


def _step(run: Run, output_dir: str) -> dict[str, object]:
    """One Trainer step (and an evaluation after it); the loss, the engine's gradients, the eval loss and weights."""
    import deepspeed.runtime.engine as engine_module
    from deepspeed.utils import safe_get_full_grad

    import transformers.integrations.deepspeed as hf_deepspeed

    model = _model(run.case, run.stock or "packfree")
    trainer = _trainer(run, model, output_dir)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    compute_loss, step = trainer.compute_loss, engine_module.DeepSpeedEngine.step

    def recorded_loss(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
        return loss

    def recorded_step(engine, *args, **kwargs):
        if not grads:  # before the optimizer: the gradients the engine reduced (every rank gathers, ZeRO 1-3)
            for name, parameter in engine.module.named_parameters():
                grad = safe_get_full_grad(parameter)
                if grad is not None:
                    grads[name] = grad.detach().clone()
        return step(engine, *args, **kwargs)

    trainer.compute_loss = recorded_loss
    engine_module.DeepSpeedEngine.step = recorded_step
    zero3 = hf_deepspeed.is_deepspeed_zero3_enabled
    if run.plant == "scale":
        hf_deepspeed.is_deepspeed_zero3_enabled = lambda: False  # the Trainer's loss then skips its x P
    try:
        trainer.train()
    finally:
        engine_module.DeepSpeedEngine.step, hf_deepspeed.is_deepspeed_zero3_enabled = step, zero3
    result: dict[str, object] = {"loss": losses[0], "grads": grads}
    if run.evaluate:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        result["weights"] = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return result


def _undo(snapshot: dict) -> None:
    """Undo what a run registered (DeepSpeed's groups, the attention functions it wrapped, accelerate's state)."""
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    unset_hf_deepspeed_config()  # else the next model is built partitioned (ZeRO-3's zero.Init)
    ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
    ALL_ATTENTION_FUNCTIONS._local_mapping.update(snapshot)
    parallel_state_sp._release_sequence_parallel_groups()
    AcceleratorState._reset_state()


def _run_step(run: Run, snapshot: dict) -> object:
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            return _step(run, output_dir)
    finally:
        _undo(snapshot)


def _worker(rank: int, world: int, port: int, runs: list[Run], out: str) -> None:
    start_rank(rank, world, port)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packfree_plugin.parallel import init_deepspeed
    from packfree_plugin.loading.register import register

    register()
    init_deepspeed("gloo", timeout=timedelta(seconds=COLLECTIVE_SECONDS))
    snapshot = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    run_on_rank(rank, [(run.name, functools.partial(_run_step, run, snapshot)) for run in runs], out)


def _run_on_ranks(runs: list[Run], out: str) -> dict[str, object]:
    (world,) = {run.world for run in runs}
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, runs, out)) for rank in range(world)]
    for process in processes:
        process.start()
    codes = wait_for_ranks(processes, START_SECONDS + CASE_SECONDS * len(runs))
    assert codes == [0] * world, f"ranks exited with {codes} (None: still running; tracebacks on stderr)"
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    everything = EXACT + PLANTED + list(REFUSED)
    found: dict[str, object] = {}
    for world in sorted({run.world for run in everything}):
        runs = [run for run in everything if run.world == world]
        found.update(_run_on_ranks(runs, str(tmp_path_factory.mktemp("trainer") / f"results{world}.pt")))
    return found


def _engine_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's gradients of the parameters the reference has a gradient for; the others (experts no token
    reached: None in eager, zeros in a ZeRO partition) must be zero."""
    for name in got.keys() - expected.keys():
        assert not got[name].any(), name
    return {name: got[name] for name in expected.keys() & got.keys()}


def stock_loss_with(run: Run, weights: dict[str, torch.Tensor]) -> float:
    """The stock model (eager) with ``weights`` on every sample of the row alone: the row's mean token loss."""
    case = run.case
    model = _model(case, "eager")
    model.load_state_dict(weights)
    batch = _batch(case)
    targets = targets_of(case, batch)
    total, start = 0.0, 0
    with torch.no_grad():
        for length in case.lengths:
            mine = slice(start, start + length)
            logits = model(input_ids=batch["input_ids"][:, mine], use_cache=False).logits[0]
            total += torch.nn.functional.cross_entropy(logits.float(), targets[mine], ignore_index=-100,
                                                       reduction="sum").item()
            start += length
    return total / (targets != -100).sum().item()


def _expected(run: Run) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: rank 0's row loss, and the gradients averaged over the data-parallel groups' rows."""
    loss, grads = stock_alone(run.case)
    if run.other is None:
        return loss, grads
    _, others = stock_alone(replace(run, lengths=run.other).case)
    names = grads.keys() | others.keys()
    zero = {name: torch.zeros_like(grads.get(name, others.get(name))) for name in names}
    return loss, {name: (grads.get(name, zero[name]) + others.get(name, zero[name])) / 2 for name in names}


@pytest.mark.parametrize("run", EXACT, ids=lambda run: run.name)
def test_trainer_step_equals_stock_on_each_sample_alone(run: Run, results) -> None:
    result = results[run.name]
    assert not isinstance(result, Exception), result
    expected_loss, expected = _expected(run)
    assert result["loss"] == pytest.approx(expected_loss, rel=TOLERANCE)
    error, name = relative_error(_engine_grads(result["grads"], expected), expected)
    assert error <= TOLERANCE, (name, error)
    if run.evaluate:
        assert result["eval_loss"] == pytest.approx(stock_loss_with(run, result["weights"]), rel=TOLERANCE)


@pytest.mark.parametrize("run", PLANTED, ids=lambda run: run.name)
def test_planted_bug_is_caught(run: Run, results) -> None:
    result = results[run.name]
    assert not isinstance(result, Exception), result
    _, expected = stock_alone(run.case)
    error, _ = relative_error(_engine_grads(result["grads"], expected), expected)
    assert error > 1e-3


@pytest.mark.parametrize("run", list(REFUSED), ids=lambda run: run.name)
def test_stock_paths_are_refused_with_the_fix(run: Run, results) -> None:
    result = results[run.name]
    assert isinstance(result, ValueError), result
    assert "does not match" not in str(result)  # packfree's refusal, not DeepSpeed's mismatch advice
    with pytest.raises(ValueError, match=REFUSED[run]):
        raise result
