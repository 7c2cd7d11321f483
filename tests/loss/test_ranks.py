"""The loss over 2 gloo ranks on the CPU, one spawn of the ranks for every case:

- DDP: the docs' Trainer recipe (tests/loss/test_recipes.py) on 2 ranks, 16 weighted samples in one step of 2
  accumulated micro-batches per rank. ``attach`` gathers the sample count over the ranks as the Trainer gathers its
  tokens, and DDP (``find_unused_parameters=True``, the Trainer's default, which rebuilds the outputs) averages: the
  weights' change under SGD at learning rate 1 is the per-sample-mean gradient of the 16 samples padded on stock.
- packfree's sequence-parallel route (``shard_batch``, Mamba2 head-parallel): one packed row of 5 + 9 + 3 tokens (the
  9-token sample crosses the shard edge) with both weights; every reduction's loss summed over the ranks, and the
  gradient of a mix of them all summed over the ranks, equal the samples padded on stock. Planted: the per-sample
  counts left unsummed over the group (each rank divides by its own share of a sample's tokens): must differ.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import assert_close
from tests.helpers import COLLECTIVE_SECONDS, fresh_pair, wait_for_ranks
from tests.loss.reference import REDUCTIONS, Samples, reference_loss
from tests.parallel.cases import START_SECONDS, _free_port, run_on_rank, start_rank

DDP_LENGTHS = [6, 1, 9, 4, 7, 3, 5, 8, 2, 10, 4, 6, 1, 7, 3, 5]
SP_LENGTHS = [5, 9, 3]
COEFFICIENTS = (0.7, 1.3, (0.5, 1.0, 2.0))
"""The mix whose gradient holds every reduction's: token, sample, and each sample's "none" loss."""


def _mix(losses: dict[str, torch.Tensor]) -> torch.Tensor:
    """(On a shard, "none" lists shard_batch's filler sample last: it pads 17 tokens to 18, and has no target.)"""
    token, sample, each = COEFFICIENTS
    return token * losses["token"] + sample * losses["sample"] + (losses["none"][:3] * torch.tensor(each)).sum()


def _ddp_trainer(tmp: str) -> dict[str, torch.Tensor]:
    import datasets
    from transformers import TrainingArguments

    from tests.loss.test_recipes import STEP, recipe

    model, _ = fresh_pair("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    namespace = {"model": model.train(), "args": TrainingArguments(tmp, **STEP),
                 "dataset": datasets.Dataset.from_list(Samples.drawn(DDP_LENGTHS).features("both"))}
    exec(compile(recipe("trainer"), "docs/loss.md:trainer", "exec"), namespace)
    return {name: before[name] - p.detach() for name, p in model.named_parameters()}


def _sequence_parallel(rank: int, planted: bool) -> tuple[dict[str, float | list[float]], dict[str, torch.Tensor]]:
    from transformers import DataCollatorWithFlattening

    from packfree_plugin import loss as loss_module
    from packfree_plugin import packed_loss
    from packfree_plugin.packing import WithLossWeights
    from packfree_plugin.parallel import prepare_sequence_parallel, shard_batch

    model, _ = fresh_pair("mamba2")
    model.train()
    prepare_sequence_parallel(model)
    batch = WithLossWeights(DataCollatorWithFlattening())(Samples.drawn(SP_LENGTHS).features("both"))
    inputs, targets = shard_batch(batch, rank, 2)
    outputs = model(**inputs)
    of = loss_module.TargetLayout.of
    if planted:
        loss_module.TargetLayout.of = classmethod(lambda cls, *a, **k: _without_group(of(*a, **k)))
    try:
        losses = {reduction: packed_loss(outputs, shift_labels=targets, reduction=reduction)
                  for reduction in REDUCTIONS}
    finally:
        loss_module.TargetLayout.of = of
    _mix(losses).backward()
    summed = {}
    for reduction, value in losses.items():
        value = value.detach().clone()
        dist.all_reduce(value)
        summed[reduction] = value.tolist()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    return summed, grads


def _without_group(layout):
    layout.group = None
    return layout


def _worker(rank: int, port: int, tmp: str, out: str) -> None:
    from datetime import timedelta

    start_rank(rank, 2, port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_SECONDS))
    run_on_rank(rank, [("ddp trainer", functools.partial(_ddp_trainer, tmp)),
                       ("sequence parallel", functools.partial(_sequence_parallel, rank, False)),
                       ("sequence parallel planted", functools.partial(_sequence_parallel, rank, True))], out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("ranks")
    out = str(Path(tmp) / "results.pt")
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, str(tmp / "trainer"), out)) for rank in range(2)]
    for process in processes:
        process.start()
    codes = wait_for_ranks(processes, START_SECONDS + 600)
    assert codes == [0, 0], f"ranks exited with {codes} (None: still running; tracebacks on stderr)"
    return torch.load(out, weights_only=False)


def _padded_reference(lengths: list[int], model_type: str) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    _, stock = fresh_pair(model_type)
    samples = Samples.drawn(lengths)
    padded = samples.padded()
    logits = stock(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False).logits
    return {reduction: reference_loss(logits, padded["labels"], samples, "both", reduction)
            for reduction in REDUCTIONS}, stock


def _gradients(loss: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_ddp_trainer_sample_mean_equals_one_process_on_every_sample(results) -> None:
    change = results["ddp trainer"]
    assert not isinstance(change, Exception), change
    expected, stock = _padded_reference(DDP_LENGTHS, "llama")
    for name, grad in _gradients(expected["sample"], stock).items():
        assert_close(change[name], grad, atol=1e-10, rtol=1e-8, what=f"ddp {name}")


def test_sequence_parallel_shares_sum_to_one_process(results) -> None:
    losses, grads = results["sequence parallel"]
    expected, stock = _padded_reference(SP_LENGTHS, "mamba2")
    assert len(losses["none"]) == 4 and losses["none"][3] != losses["none"][3], "the filler sample: NaN, last"
    losses["none"] = losses["none"][:3]
    for reduction in REDUCTIONS:
        assert_close(torch.tensor(losses[reduction], dtype=torch.float64), expected[reduction], atol=1e-6, rtol=1e-5,
                     what=reduction)
    for name, grad in _gradients(_mix(expected), stock).items():
        assert_close(grads[name], grad.to(grads[name].dtype), atol=1e-6, rtol=1e-5, what=f"sp grad {name}")


def test_sequence_parallel_counts_left_unsummed_over_the_group_differ(results) -> None:
    losses, _ = results["sequence parallel planted"]
    expected, _ = _padded_reference(SP_LENGTHS, "mamba2")
    assert abs(losses["sample"] - float(expected["sample"].detach())) > 1e-3 * abs(float(expected["sample"].detach()))
