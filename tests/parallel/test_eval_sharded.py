"""Evaluation under DeepSpeed sequence parallelism, on 2 gloo CPU ranks, as a user meets it: a model in eval mode on a
packed row gives what the stock model (eager, the same weights) gives on each sample alone, or is refused, naming
the fix.

With ``disable_in_eval=False`` (accelerate's ``sp_disable_in_eval=False``; DeepSpeed's own default) Ulysses stays on
in eval mode: eval forwards are exchanged over the ranks as in training, and DeepSpeed drops the attention mask. With
``disable_in_eval=True`` it stands aside, but drops the mask all the same: each rank runs its whole row unmasked.

Two routes:
- ``trainer``: ``Trainer.evaluate()`` (no training step: DeepSpeed then needs ZeRO-3) with accelerate's
  ``ParallelismConfig(sp_backend="deepspeed")`` and ``UlyssesRows``, as tests/parallel/test_trainer_ulysses.py sets
  it up: its eval loss against the stock model's mean token loss over the samples alone (float32, 1e-5). The Trainer
  does not shard eval batches: each rank's whole row goes through the exchange as its shard (the row twice, each copy
  its own samples);
- ``deepspeed``: DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` called directly, then one eval
  forward of this rank's shard (``shard_batch``; with ``disable_in_eval=True`` the whole row on every rank): the
  row's logits gathered over the ranks against the stock model's on each sample alone (float64, 1e-10).

A packfree model (attention: Llama; hybrids: Qwen3-Next's Gated DeltaNet, and in ``nox -s distributed`` Granite 4's
Mamba2 and Mamba2 alone) is exact on both routes. A model loaded with stock sdpa is refused: a packed row in its first
attention call (in eval too, and with ``disable_in_eval=True`` too, where the whole row runs unmasked: its eval loss
was 0.9 % off, its logits 0.6 off before packfree refused it), a hybrid at set-up (Ulysses splits only attention).
Planted: the packed-row refusal held only in training (``module.training and ...`` in
``integrations/deepspeed._refusing_packed_rows``): the stock sdpa cases evaluate, silently off.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.parallel.cases import SHARED, SHARED_WORLD, Case, _batch, _model, float64_inside, shared_results
from tests.parallel.test_trainer_ulysses import Run, _trainer, _undo, stock_loss_with

WORLD = SHARED_WORLD
EDGES2 = (8, 1, 1, 7)  # one-token samples on both sides of the shard edge at 9 (the row is padded to 18)
TOLERANCE = {"trainer": 1e-5, "deepspeed": 1e-10}
"""float32 in the Trainer's DeepSpeed engine; float64 on the direct route."""
PACKED_ROW = "a packed row.*reached sdpa attention under DeepSpeed Ulysses.*attn_implementation='packfree'"
MIXES = "mixes tokens outside attention.*attn_implementation='packfree'"


@dataclass(frozen=True)
class Eval:
    model_type: str
    route: str  # "trainer": Trainer.evaluate(); "deepspeed": register_with_transformers, then one eval forward
    stock: str | None = None  # load the model with this stock attention (and name it as Ulysses' core attention)
    disable_in_eval: bool = False

    @property
    def name(self) -> str:
        rows = "whole-rows" if self.disable_in_eval else "sp-eval"
        return "/".join([self.model_type, self.route, self.stock or "packfree", rows])

    @property
    def run(self) -> Run:
        """The Trainer route's run: ZeRO-3 (DeepSpeed evaluates without a training step under ZeRO-3 only)."""
        return Run(self.model_type, EDGES2, zero=3, stock=self.stock, sp_attn=self.stock,
                   disable_in_eval=self.disable_in_eval)

    @property
    def case(self) -> Case:
        """The direct route's case: float64."""
        return Case(self.model_type, EDGES2, "ulysses", world=WORLD)


DEFAULT = [Eval(model_type, route) for model_type in ("llama", "qwen3_next") for route in ("trainer", "deepspeed")]
REFUSED = {
    # run: what the refusal says
    **{Eval("llama", route, stock="sdpa", disable_in_eval=off): PACKED_ROW
       for route in ("trainer", "deepspeed") for off in (False, True)},
    Eval("qwen3_next", "deepspeed", stock="sdpa"): MIXES,
}
FULL = [Eval(model_type, route) for model_type in ("granitemoehybrid", "mamba2") for route in ("trainer", "deepspeed")]
FULL_REFUSED = {Eval("qwen3_next", "trainer", stock="sdpa"): MIXES,
                Eval("granitemoehybrid", "deepspeed", stock="sdpa", disable_in_eval=True): MIXES}
RUN_FULL = os.environ.get("PACKFREE_SP_FULL") == "1"
EXACT = DEFAULT + (FULL if RUN_FULL else [])
REFUSALS = {**REFUSED, **(FULL_REFUSED if RUN_FULL else {})}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _trainer_eval(item: Eval) -> dict[str, object]:
    """``Trainer.evaluate()`` on the row's samples: its eval loss, and the weights it ran with."""
    run = item.run
    model = _model(run.case, run.stock or "packfree")
    weights = _weights(model)  # before ZeRO-3 partitions them
    with tempfile.TemporaryDirectory() as output_dir:
        loss = _trainer(run, model, output_dir).evaluate()["eval_loss"]
    return {"eval_loss": loss, "weights": weights}


def _direct_eval(item: Eval, rank: int) -> dict[str, object]:
    """DeepSpeed's registration, then one eval forward: the row's logits ``[T, V]`` (without the padding sample),
    and the weights."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from packfree_plugin.parallel import shard_batch

    case = item.case
    model = _model(case, item.stock or "packfree").eval()
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=item.stock or "packfree", sequence_parallel_size=WORLD,
        micro_batch_size=1, seq_length_is_variable=True, disable_in_eval=item.disable_in_eval)
    batch = _batch(case)
    if item.disable_in_eval:  # Ulysses stands aside: every rank runs the whole row
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    else:
        inputs, _ = shard_batch(batch, rank, WORLD)
    with torch.no_grad(), float64_inside(model):
        logits = model(**inputs).logits
    if not item.disable_in_eval:
        parts = [torch.empty_like(logits) for _ in range(WORLD)]
        dist.all_gather(parts, logits.contiguous())
        logits = torch.cat(parts, dim=1)
    return {"logits": logits[0, :sum(case.lengths)], "weights": _weights(model)}


def _evaluate(item: Eval, rank: int, snapshot: dict) -> dict[str, object] | AssertionError:
    """One evaluation; DeepSpeed's own shape assertion (raised alike on every rank) is its result, as a refusal is."""
    try:
        return _trainer_eval(item) if item.route == "trainer" else _direct_eval(item, rank)
    except AssertionError as error:
        return error
    finally:
        _undo(snapshot)


SHARED.update({item.name: (_evaluate, item) for item in EXACT + list(REFUSALS)})  # one spawn with other modules'


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    return shared_results([item.name for item in EXACT + list(REFUSALS)])


def _stock_logits_alone(item: Eval, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[T, V]``: the stock model (eager) with ``weights`` on every sample of the row alone, float64."""
    case = item.case
    model = _model(case, "eager").eval()
    model.load_state_dict(weights)
    tokens, start, logits = _batch(case)["input_ids"], 0, []
    with torch.no_grad(), float64_inside(model):
        for length in case.lengths:
            logits.append(model(input_ids=tokens[:, start:start + length], use_cache=False).logits[0])
            start += length
    return torch.cat(logits)


def _relative_error(item: Eval, result: dict[str, object]) -> float:
    """How far ``result`` is from the stock model on each sample alone: the eval loss's relative error, or the
    largest logit error over the largest logit (NaN where either holds one)."""
    if item.route == "trainer":
        expected = stock_loss_with(item.run, result["weights"])
        return abs(result["eval_loss"] - expected) / abs(expected)
    expected = _stock_logits_alone(item, result["weights"])
    if not (torch.isfinite(result["logits"]).all() and torch.isfinite(expected).all()):
        return float("nan")
    return ((result["logits"] - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("item", EXACT, ids=lambda item: item.name)
def test_sharded_eval_equals_stock_on_each_sample_alone(item: Eval, results) -> None:
    result = results[item.name]
    assert not isinstance(result, Exception), result
    error = _relative_error(item, result)
    assert error <= TOLERANCE[item.route], f"{item.name}: {error:.3g} (relative) from the stock model"


@pytest.mark.parametrize("item", list(REFUSALS), ids=lambda item: item.name)
def test_stock_attention_in_eval_is_refused_with_the_fix(item: Eval, results) -> None:
    result = results[item.name]
    if isinstance(result, dict):
        pytest.fail(f"{item.name} evaluated, {_relative_error(item, result):.3g} (relative) from the stock model on "
                    "each sample alone, instead of being refused")
    assert isinstance(result, ValueError), f"{type(result).__name__}: {result}, not packfree's refusal"
    assert "does not match" not in str(result)  # packfree's refusal, not DeepSpeed's mismatch advice
    with pytest.raises(ValueError, match=REFUSALS[item]):
        raise result
