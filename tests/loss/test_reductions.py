"""Every reduction of :func:`packfree_plugin.packed_loss` x {no weights, per-token, per-sample weights} on packed rows
equals the same samples padded on the stock model (tests/loss/reference.py), loss and every parameter's gradient,
in float64, on Llama (attention), Qwen3-Next (Gated DeltaNet hybrid) and Mamba2 (SSD); over 2 micro-batches of
gradient accumulation too. An ordinary padded batch gives what stock gives, and ``torch.compile`` traces the
reductions without a graph break. Planted bugs (the per-sample mean over tokens, the boundaries dropped, the weights
dropped) must make the comparison fail."""

from __future__ import annotations

import functools

import pytest
import torch

from packfree_plugin import Boundaries, count_samples, packed_loss
from packfree_plugin import loss as loss_module
from tests.conftest import CountingBackend, assert_close
from tests.helpers import fresh_pair
from tests.loss.reference import REDUCTIONS, WEIGHTINGS, Samples, reference_loss
from tests.test_host_reads import HostReads

LENGTHS = [6, 1, 9, 4, 7, 3]  # the 1-token sample has no target: left out of the per-sample mean, NaN in "none"
BUDGET, ROWS = 12, 3  # 30 tokens in 3 rows of 12: several samples per row, padded tails
TOLERANCE = {"llama": dict(atol=1e-10, rtol=1e-9), "qwen3_next": dict(atol=1e-6, rtol=1e-5),
             "mamba2": dict(atol=1e-6, rtol=1e-5)}
"""Stock's Gated DeltaNet and Mamba2 torch paths compute in float32 inside a float64 model (and Mamba2's head casts
its logits to float32); Llama is float64 throughout."""


@functools.cache
def _forwards(model_type: str):
    """``(model, stock, samples, packed batch, packed outputs, padded batch, stock's outputs)``: one forward each (the
    packed batch carries both weights, which the forward takes out), graphs kept for every backward."""
    model, stock = fresh_pair(model_type)
    samples = Samples.drawn(LENGTHS)
    packed = samples.packed("both", BUDGET, ROWS)
    outputs = model(**{k: v for k, v in packed.items() if k != "labels"})
    padded = samples.padded()
    padded_outputs = stock(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False)
    return model, stock, samples, packed, outputs, padded, padded_outputs


def _grads(loss: torch.Tensor, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
    return {name: grad for (name, _), grad in zip(named, grads) if grad is not None}


def _mix(losses: dict[str, torch.Tensor], order: list[int] | None = None) -> torch.Tensor:
    """One scalar whose gradient holds every reduction's: a fixed mix of ``"token"``, ``"sample"`` and each sample's
    ``"none"`` loss (``order``: where each sample sits in ``losses["none"]``; those without targets left out)."""
    coefficients = torch.linspace(0.5, 2.0, len(LENGTHS), dtype=losses["none"].dtype)
    picked = [index for index, length in enumerate(LENGTHS) if length > 1]
    places = picked if order is None else [order.index(index) for index in picked]
    return 0.7 * losses["token"] + 1.3 * losses["sample"] + (losses["none"][places] * coefficients[picked]).sum()


def _packed_losses(model_type: str, weighting: str) -> dict[str, torch.Tensor]:
    """Every reduction of the packed outputs, with the weights ``weighting`` names, passed explicitly."""
    _, _, _, packed, outputs, _, _ = _forwards(model_type)
    weights = {name: packed[name] if weighting in (kind, "both") else None
               for name, kind in (("token_weights", "token"), ("sample_weights", "sample"))}
    boundaries = outputs.packfree_loss_inputs.boundaries
    return {reduction: packed_loss(outputs.logits, packed["labels"], reduction=reduction, boundaries=boundaries,
                                   **weights) for reduction in REDUCTIONS}


def _compare(model_type: str, weighting: str) -> None:
    model, stock, samples, _, _, padded, padded_outputs = _forwards(model_type)
    got = _packed_losses(model_type, weighting)
    expected = {reduction: reference_loss(padded_outputs.logits, padded["labels"], samples, weighting, reduction)
                for reduction in REDUCTIONS}
    order = Samples.packed_order(LENGTHS, BUDGET)
    what = f"{model_type} weights={weighting}"
    assert torch.isnan(got["none"]).tolist() == [LENGTHS[i] == 1 for i in order], what
    finite = ~torch.isnan(got["none"])
    assert_close(got["none"][finite], expected["none"][order][finite].to(got["none"].dtype), **TOLERANCE[model_type],
                 what=f"{what} none")
    for reduction in ("token", "sample"):
        assert_close(got[reduction], expected[reduction].to(got[reduction].dtype), **TOLERANCE[model_type],
                     what=f"{what} {reduction}")
    mine, theirs = _grads(_mix(got, order), model), _grads(_mix(expected), stock)
    assert mine.keys() == theirs.keys(), what
    for name, grad in theirs.items():
        assert_close(mine[name], grad, **TOLERANCE[model_type], what=f"{what} grad {name}")


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("model_type", list(TOLERANCE))
def test_packed_rows_reduce_like_the_samples_padded(model_type: str, weighting: str) -> None:
    """Each reduction's loss, and the gradients of a mix of them all (one backward each side)."""
    _compare(model_type, weighting)


def test_the_forward_leaves_the_batch_for_the_loss() -> None:
    """The batch's weights reach the loss through the forward (which takes them out of the model's call), and its
    boundaries are the ones the forward read."""
    _, _, _, packed, outputs, _, _ = _forwards("llama")
    kept = outputs.packfree_loss_inputs
    assert set(kept.weights) == {"token_weights", "sample_weights"} and kept.boundaries.is_packed
    explicit = _packed_losses("llama", "both")
    for reduction in REDUCTIONS:
        torch.testing.assert_close(packed_loss(outputs, packed["labels"], reduction=reduction), explicit[reduction],
                                   equal_nan=True, msg=reduction)


PLANTS = {
    "sample mean over tokens": lambda self, weighted: (self._per_segment(weighted) / self.kept.sum(),
                                                       (self.segment_counts() > 0) & ~self.padding),
    "boundaries dropped": "of",
    "weights dropped": "weights",
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_bugs_fail_the_comparison(plant: str, monkeypatch) -> None:
    """Each planted bug makes a comparison above fail (Llama, both weights where the bug is about weights)."""
    if plant == "boundaries dropped":
        unpacked = loss_module.TargetLayout.of.__func__
        monkeypatch.setattr(loss_module.TargetLayout, "of", classmethod(
            lambda cls, boundaries, *args, **kwargs: unpacked(cls, None, *args, **kwargs)))
    elif plant == "weights dropped":
        monkeypatch.setattr(loss_module, "_weight", lambda *args, **kwargs: None)
    else:
        monkeypatch.setattr(loss_module.TargetLayout, "segment_means", PLANTS[plant])
    with pytest.raises(AssertionError):
        _compare("llama", "sample" if plant == "weights dropped" else "none")


@pytest.mark.parametrize("model_type", list(TOLERANCE))
def test_gradient_accumulation_over_two_micro_batches(model_type: str) -> None:
    """``"token"`` over ``num_items_in_batch`` and ``"sample"`` over :func:`count_samples` of both micro-batches: the
    summed losses and gradients equal the reduction of all samples in one padded batch."""
    model, stock = fresh_pair(model_type)
    lengths = [[6, 1, 9, 4], [7, 3, 5]]
    parts = [Samples.drawn(part, seed=index) for index, part in enumerate(lengths)]
    everything = Samples(*(sum((getattr(part, name) for part in parts), []) for name in Samples.__dataclass_fields__))
    batches = [part.packed("sample", BUDGET, 2) for part in parts]
    padded = everything.padded()
    logits = stock(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False).logits
    tokens = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    samples = sum(count_samples(batch) for batch in batches)
    assert int(samples) == sum(n > 1 for part in lengths for n in part)
    outputs = [model(**{k: v for k, v in batch.items() if k != "labels"}) for batch in batches]
    for reduction in ("token", "sample"):
        total = sum(packed_loss(out, batch["labels"], reduction=reduction, num_items_in_batch=tokens,
                                num_samples_in_batch=samples) for out, batch in zip(outputs, batches))
        expected = reference_loss(logits, padded["labels"], everything, "sample", reduction)
        assert_close(total, expected.to(total.dtype), **TOLERANCE[model_type], what=f"{model_type} {reduction}")
        mine, theirs = _grads(total, model), _grads(expected, stock)
        for name, grad in theirs.items():
            assert_close(mine[name], grad, **TOLERANCE[model_type], what=f"{model_type} {reduction} grad {name}")


def test_an_ordinary_padded_batch_gives_what_stock_gives() -> None:
    """On the stock model's padded batch: ``"token"`` is the model's own loss (transformers' ``ForCausalLMLoss``),
    ``"sample"`` the mean of the rows' means, and the boundaries read from the batch are one sample per row."""
    _, stock = fresh_pair("llama")
    samples = Samples.drawn(LENGTHS)
    padded = samples.padded()
    outputs = stock(**padded, use_cache=False)
    assert_close(packed_loss(outputs, padded["labels"], batch=padded), outputs.loss.to(torch.float64),
                 atol=1e-6, rtol=1e-6, what="token")  # transformers computes its loss in float32
    for reduction in ("sample", "none"):
        got = packed_loss(outputs, padded["labels"], reduction=reduction, batch=padded)
        expected = reference_loss(outputs.logits, padded["labels"], samples, "none", reduction)
        torch.testing.assert_close(got, expected, equal_nan=True, msg=reduction)
    with pytest.raises(ValueError, match="needs the batch's sample boundaries"):
        packed_loss(outputs.logits, padded["labels"], reduction="sample")


def test_shift_labels_read_like_labels() -> None:
    _, _, _, packed, outputs, _, _ = _forwards("llama")
    labels, weights = packed["labels"], packed["token_weights"]
    shift = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    shifted_weights = torch.cat([weights[:, 1:], weights.new_zeros(weights.shape[0], 1)], dim=1)
    for reduction in REDUCTIONS:
        expected = packed_loss(outputs.logits, labels, token_weights=weights, reduction=reduction,
                               boundaries=outputs.packfree_loss_inputs.boundaries)
        got = packed_loss(outputs.logits, shift_labels=shift, token_weights=shifted_weights, reduction=reduction,
                          boundaries=outputs.packfree_loss_inputs.boundaries)
        torch.testing.assert_close(got, expected, equal_nan=True, msg=reduction)


def test_a_target_that_crosses_into_the_next_sample_is_refused_or_dropped() -> None:
    """:func:`count_samples` (what the Trainer's count runs) refuses it, as the model's forward does; the loss itself
    drops it: it belongs to no sample alone."""
    _, _, _, batch, outputs, _, _ = _forwards("llama")
    labels = batch["labels"]
    crossing = labels.clone()
    second_start = int((batch["position_ids"][0] == 0).nonzero()[1])
    crossing[0, second_start] = batch["input_ids"][0, second_start]
    with pytest.raises(ValueError, match="not -100"):
        count_samples({**batch, "labels": crossing})
    for reduction in REDUCTIONS:
        torch.testing.assert_close(packed_loss(outputs, crossing, reduction=reduction),
                                   packed_loss(outputs, labels, reduction=reduction), equal_nan=True)


def test_weights_of_the_wrong_shape_are_refused() -> None:
    _, _, _, batch, outputs, _, _ = _forwards("llama")
    for weights, expected in ((torch.ones(len(LENGTHS)), r"token_weights must be a float tensor shaped like the "
                               r"labels \[3, 12\], got \[6\]"),
                              (torch.ones(3, 12, dtype=torch.int64), "of torch.int64")):
        with pytest.raises(ValueError, match=expected):
            packed_loss(outputs, batch["labels"], token_weights=weights)


def test_the_reductions_read_nothing_back_from_the_device() -> None:
    """Every reduction from the outputs (boundaries and both weights as the forward left them), and the backward of a
    mix of them all, hand no tensor value to Python: no synchronisation on a GPU."""
    _, _, _, packed, outputs, _, _ = _forwards("llama")
    with HostReads() as reads:
        losses = {reduction: packed_loss(outputs, packed["labels"], reduction=reduction) for reduction in REDUCTIONS}
        torch.autograd.grad(_mix(losses, Samples.packed_order(LENGTHS, BUDGET)), outputs.logits, retain_graph=True)
    assert reads.total == 0, reads.where


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_reductions_compile_without_graph_breaks(reduction: str) -> None:
    """``fullgraph=True`` (a break raises), the same result as eager, one graph per call, and no recompilation for a
    new packing after the first change of shapes (the boundaries reach the graph as their host offset tensors)."""
    backend = CountingBackend()

    def loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, boundaries: Boundaries):
        return packed_loss(logits, labels, reduction=reduction, boundaries=boundaries, sample_weights=weights)

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    for seed, lengths in enumerate(([6, 1, 9, 4, 7, 3], [5, 5, 8, 2, 6, 4], [3, 9, 9, 2, 1, 6], [11, 2, 2, 3, 4, 8])):
        batch = Samples.drawn(lengths, seed=seed).packed("sample", BUDGET, ROWS)
        boundaries = Boundaries.from_model_inputs(batch_size=ROWS, seq_len=BUDGET, device="cpu",
                                                  position_ids=batch["position_ids"],
                                                  attention_mask=batch.get("attention_mask"))
        logits = torch.randn(ROWS, BUDGET, 128, dtype=torch.float64, requires_grad=True)
        arguments = (logits, batch["labels"], batch["sample_weights"], boundaries)
        torch.testing.assert_close(compiled(*arguments), loss(*arguments), equal_nan=True)
    assert backend.runs == 4 and backend.compiled <= 2, (backend.compiled, backend.runs)


def test_loss_weights_reach_the_loss_from_a_compiled_forward() -> None:
    """A compiled forward given loss weights keeps them (outside its graph), with the boundaries it read."""
    model, _ = fresh_pair("llama")
    batch = Samples.drawn([5, 3, 4]).packed("both", 8, 2)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")(**inputs)
    eager = model(**inputs)
    assert set(compiled.packfree_loss_inputs.weights) == {"token_weights", "sample_weights"}
    for reduction in REDUCTIONS:
        torch.testing.assert_close(packed_loss(compiled, batch["labels"], reduction=reduction),
                                   packed_loss(eager, batch["labels"], reduction=reduction), equal_nan=True)
