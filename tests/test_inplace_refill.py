"""A boundary buffer refilled in place: a data loader that reuses its batch tensors (``position_ids``, ``seq_idx``,
``cu_seq_lens_q/k`` with ``max_length_q/k``, the tokens, the labels) and writes the next batch into them with
``copy_``. packfree keeps host copies and derived forms of the tensors it reads (:mod:`packfree_plugin.boundaries.store`);
none may outlive the write. After one forward and backward on batch A's layout, the buffers refilled with batch B's
(other sample lengths, same shapes) must give what fresh tensors of B give (logits, loss, every parameter gradient)
and what stock gives on each sample of B alone.

The labels case matters on the CPU: there, the host copy of a tensor read on its own is a view of its storage and
would follow the write anyway, but the ids read together with the labels (one combined host read, as are
``cu_seq_lens_q/k`` with ``max_length_q/k``) get a real copy, as every CUDA tensor does. Under ``torch.inference_mode`` the tensors have no version counter: what packfree keeps
about them holds for one batch read.

Ops called directly on a refilled boundary tensor: tests/ops/test_inplace_refill_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pytest
import torch

from tests.conftest import assert_close
from tests.helpers import FAMILIES, gradients, max_grad_diff, samples_of, shared_pair

ROWS = {"A": ((5, 6, 5), (9, 7)), "B": ((3, 10, 3), (12, 4))}
"""Sample lengths per row of the two batches: the same ``[2, 16]`` rows and sample count (so ``cu_seq_lens`` keep
their shape), no boundary in common but the row starts, longer than the tiny configs' chunks and conv widths."""
SEEDS = {"A": 0, "B": 5}
"""The seed of each batch's token ids."""

FORMS = ("position_ids", "seq_idx", "cu_seq_lens")
"""The boundary inputs a batch may carry, each alone (packfree numbers positions from them)."""

INFERENCE_MODELS = ("llama", "mamba2")
"""Under inference mode, attention and a mixer (forward only: what is kept about the batch's tensors is the same)."""

FLOAT32_INSIDE = {"qwen3_next": 1e-5, "mamba2": 1e-5}
"""Stock runs the Gated DeltaNet and SSD paths in float32 even for float64 inputs (tests/models/test_hybrids.py)."""
LOSS_RTOL = 1e-6
"""transformers' causal-LM loss runs in float32: one over packed rows and a weighted sum of per-sample ones differ
by float32 rounding (5e-7 of 4.8 measured)."""
FRESH_TOLERANCE = 1e-12
"""Refilled against fresh tensors of the same batch: the same computation, to float64 rounding."""


def _stock_tolerance(model_type: str) -> float:
    return FLOAT32_INSIDE.get(model_type, 1e-10)


def _samples(batch: str) -> list[list[list[int]]]:
    """Token ids of ``batch`` (``"A"`` or ``"B"``) per row, per sample."""
    return [samples_of(list(lengths), seed=SEEDS[batch] + row) for row, lengths in enumerate(ROWS[batch])]


def packed_batch(name: str, form: str, *, labels: bool) -> dict[str, torch.Tensor]:
    """Batch ``name``'s samples packed: ``input_ids [B, T]``, the boundary input of ``form`` and, with ``labels``,
    ``labels [B, T]`` (-100 at every sample's first token). Every value is a tensor, so every one can be refilled."""
    rows, samples = ROWS[name], _samples(name)
    input_ids = torch.tensor([sum(row, []) for row in samples])
    batch = {"input_ids": input_ids}
    if form == "position_ids":
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    elif form == "seq_idx":
        batch["seq_idx"] = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                                        for row in rows]).to(torch.int32)
    else:
        lengths = [n for row in rows for n in row]
        offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        for side in ("q", "k"):  # separate buffers, as a loader that fills each keyword may hold them
            batch[f"cu_seq_lens_{side}"] = torch.tensor(offsets, dtype=torch.int32)
            batch[f"max_length_{side}"] = torch.tensor([max(lengths)])
    if labels:
        targets = input_ids.clone()
        for row, lengths in enumerate(rows):
            targets[row, [sum(lengths[:i]) for i in range(len(lengths))]] = -100
        batch["labels"] = targets
    return batch


def refill(buffers: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
    """Write ``batch`` into ``buffers`` in place, as a loader that reuses its tensors does."""
    assert buffers.keys() == batch.keys()
    for name, buffer in buffers.items():
        buffer.copy_(batch[name])


def _projection(shape: torch.Size) -> torch.Tensor:
    """A fixed random weight on the logits, for a backward without labels."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


@dataclass
class Result:
    """What one call gives: ``logits [B, T, V]``, the loss, every parameter's gradient (empty: no backward)."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, backward: bool = True) -> Result:
    """One forward (and backward) of ``model`` on ``batch``: the loss is the model's own with labels, else a fixed
    projection of the logits. Gradients are left at None."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out.loss if "labels" in batch else (out.logits * _projection(out.logits.shape)).sum()
    grads = {}
    if backward:
        loss.backward()
        grads = gradients(model)
        model.zero_grad(set_to_none=True)
    return Result(out.logits.detach(), loss.detach(), grads)


@cache
def alone(model_type: str, labels: bool) -> Result:
    """Stock on each sample of batch B alone: the logits laid out as B's packed rows, and the loss and gradients of
    the packed call's loss (a token-weighted mean of the samples' losses with labels, else the projection's sum)."""
    _, stock = shared_pair(model_type)
    samples = _samples("B")
    lengths = [n for row in ROWS["B"] for n in row]
    predicted = sum(n - 1 for n in lengths)
    weight = _projection(torch.Size([len(ROWS["B"]), sum(ROWS["B"][0]), stock.config.vocab_size]))
    stock.zero_grad(set_to_none=True)
    rows, total = [], torch.zeros((), dtype=torch.float64)
    for row, (row_lengths, row_samples) in enumerate(zip(ROWS["B"], samples)):
        pieces, start = [], 0
        for length, sample in zip(row_lengths, row_samples):
            ids = torch.tensor([sample])
            if labels:
                out = stock(input_ids=ids, labels=ids, use_cache=False)
                loss = out.loss * (length - 1) / predicted
            else:
                out = stock(input_ids=ids, use_cache=False)
                loss = (out.logits[0] * weight[row, start: start + length]).sum()
            loss.backward()
            total = total + loss.detach()
            pieces.append(out.logits[0].detach())
            start += length
        rows.append(torch.cat(pieces))
    grads = gradients(stock)
    stock.zero_grad(set_to_none=True)
    return Result(torch.stack(rows), total, grads)


def _compare(got: Result, want: Result, *, atol: float, loss_rtol: float = 0.0, what: str) -> None:
    """Logits within ``atol``, the loss within ``atol`` and ``loss_rtol`` (float64), every gradient within ``atol``
    of the largest one's size (at least 1)."""
    assert_close(got.logits, want.logits, atol=atol, rtol=0, what=f"{what}: logits")
    assert_close(got.loss.double(), want.loss.double(), atol=atol, rtol=loss_rtol, what=f"{what}: loss")
    if want.grads:
        assert got.grads.keys() == want.grads.keys(), f"{what}: parameters with a gradient differ"
        worst = max_grad_diff(got.grads, want.grads)
        scale = max([1.0, *(float(grad.abs().max()) for grad in want.grads.values())])
        assert worst <= atol * scale, f"{what}: gradients differ by up to {worst:.3g} (largest {scale:.3g})"


def _compare_with_alone(got: Result, model_type: str, labels: bool, *, backward: bool, what: str) -> None:
    """``got`` against stock on each sample of B alone. With labels the loss is transformers' float32 cross
    entropy, whose sum over other token orders differs by float32 rounding."""
    expected = alone(model_type, labels)
    if not backward:
        expected = Result(expected.logits, expected.loss, {})
    _compare(got, expected, atol=_stock_tolerance(model_type), loss_rtol=LOSS_RTOL if labels else 0.0,
             what=f"{what}: refilled against each sample alone")


@pytest.mark.parametrize("labels", [False, True], ids=["no labels", "labels"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_buffers_refilled_in_place_run_the_new_batch(model_type: str, form: str, labels: bool) -> None:
    """Batch A, then the same tensors refilled with batch B: the forward and backward of B's layout, equal to
    fresh tensors of B and to stock on each sample of B alone."""
    model, _ = shared_pair(model_type)
    buffers = packed_batch("A", form, labels=labels)
    step(model, buffers)
    refill(buffers, packed_batch("B", form, labels=labels))
    refilled = step(model, buffers)
    fresh = step(model, packed_batch("B", form, labels=labels))
    _compare(refilled, fresh, atol=FRESH_TOLERANCE, what=f"{model_type}/{form}: refilled against fresh tensors")
    _compare_with_alone(refilled, model_type, labels, backward=True, what=f"{model_type}/{form}")


@pytest.mark.parametrize("labels", [False, True], ids=["no labels", "labels"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("model_type", INFERENCE_MODELS)
def test_inference_tensors_refilled_in_place_run_the_new_batch(model_type: str, form: str, labels: bool) -> None:
    """The same under ``torch.inference_mode``: the buffers are inference tensors (no version counter), written in
    place between two forwards."""
    model, _ = shared_pair(model_type)
    with torch.inference_mode():
        buffers = packed_batch("A", form, labels=labels)
        assert all(tensor.is_inference() for tensor in buffers.values())
        step(model, buffers, backward=False)
        refill(buffers, packed_batch("B", form, labels=labels))
        refilled = step(model, buffers, backward=False)
        fresh = step(model, packed_batch("B", form, labels=labels), backward=False)
    _compare(refilled, fresh, atol=FRESH_TOLERANCE, what=f"{model_type}/{form}: refilled against fresh tensors")
    _compare_with_alone(refilled, model_type, labels, backward=False, what=f"{model_type}/{form}")


def test_an_inference_buffer_read_by_a_forward_holds_nothing_after_it() -> None:
    """A ``seq_idx`` inference tensor read by a Mamba2 forward (with labels: a real host copy), refilled in place after
    that forward and handed to an op directly: the op runs the new layout, not what the forward read."""
    from packfree_plugin.ops.conv import causal_conv1d, naive_causal_conv1d

    model, _ = shared_pair("mamba2")
    generator = torch.Generator().manual_seed(3)
    x, weight = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((2, 16, 8), (8, 4)))
    with torch.inference_mode():
        buffers = packed_batch("A", "seq_idx", labels=True)
        step(model, buffers, backward=False)
        buffers["seq_idx"].copy_(packed_batch("B", "seq_idx", labels=False)["seq_idx"])
        refilled = causal_conv1d(x, weight, None, seq_idx=buffers["seq_idx"], backend="torch")
        fresh = causal_conv1d(x, weight, None, seq_idx=packed_batch("B", "seq_idx", labels=False)["seq_idx"],
                              backend="torch")
        naive = naive_causal_conv1d(x, weight, None, seq_idx=packed_batch("B", "seq_idx", labels=False)["seq_idx"])
    assert_close(refilled, fresh, atol=FRESH_TOLERANCE, rtol=0, what="refilled after a forward against fresh")
    assert_close(refilled, naive, what="refilled after a forward against the naive reference")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_batch_run_under_inference_mode_then_trained_on(model_type: str, form: str) -> None:
    """The same batch tensors evaluated under ``torch.inference_mode`` and then trained on (what stock runs): nothing
    packfree built in inference mode is reused in the training step, whose loss and gradients equal each sample
    alone on stock."""
    model, _ = shared_pair(model_type)
    batch = packed_batch("B", form, labels=True)
    with torch.inference_mode():
        step(model, batch, backward=False)
    _compare_with_alone(step(model, batch), model_type, True, backward=True, what=f"{model_type}/{form}")
