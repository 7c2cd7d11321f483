"""Gradient checkpointing on packed rows gives the gradients of the same model without it (packfree both)."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from tests.helpers import fresh_pair, gradients, max_grad_diff, samples_of


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_checkpointed_packed_gradients_equal_plain(model_type: str, reentrant: bool, record_property) -> None:
    plain, _ = fresh_pair(model_type)
    checkpointed, _ = fresh_pair(model_type)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in samples_of([8, 3, 12, 6])])
    losses = []
    for model in (plain.train(), checkpointed.train()):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    assert checkpointed.is_gradient_checkpointing
    diff = max_grad_diff(gradients(plain), gradients(checkpointed))
    record_property("max_grad_diff", diff)
    assert torch.equal(losses[0], losses[1])
    assert len(gradients(checkpointed)) == len(gradients(plain)) > 0
    assert diff <= 1e-12, f"checkpointed gradients differ by {diff}"


def _batch(lengths: list[int]) -> dict[str, torch.Tensor]:
    return DataCollatorWithFlattening()([{"input_ids": s} for s in samples_of(lengths)])  # position_ids only


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "falcon_mamba"])
def test_two_forwards_in_flight_before_backward(model_type: str, reentrant: bool) -> None:
    """Two packed forwards with different packings, then both backwards in reverse order: the recomputation
    of each must use its own boundaries (the other forward's, or none, would give wrong gradients).
    FalconMamba's decoder layers get no ``**kwargs``: there the boundaries ride in the checkpoint function."""
    first, second = _batch([8, 3, 12, 6]), _batch([2, 9, 9, 1, 8])  # same row length, different samples
    assert first["input_ids"].shape == second["input_ids"].shape

    def alone(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        model, _ = fresh_pair(model_type)
        model.train()(**batch).loss.backward()
        return gradients(model)

    expected = {name: a + b for (name, a), b in zip(alone(first).items(), alone(second).values())}
    model, _ = fresh_pair(model_type)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    losses = [model(**batch).loss for batch in (first, second)]
    losses[1].backward()
    losses[0].backward()
    diff = max_grad_diff(gradients(model), expected)
    assert diff <= 1e-12, f"interleaved checkpointed gradients differ by {diff}"


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
def test_threads_each_see_their_own_boundaries(model_type: str) -> None:
    """The active boundaries are per thread: threads running different packings through one model at the
    same time (as ``nn.DataParallel`` does) each get their own outputs."""
    from concurrent.futures import ThreadPoolExecutor

    model, _ = fresh_pair(model_type)
    batches = [_batch(lengths) for lengths in ([8, 3, 12, 6], [2, 9, 9, 1, 8], [29], [5, 5, 5, 5, 9])]
    with torch.no_grad():
        expected = [model(**batch).logits for batch in batches]

        def run(index: int) -> list[torch.Tensor]:
            return [model(**batches[index]).logits for _ in range(3)]

        with ThreadPoolExecutor(max_workers=len(batches)) as pool:
            results = list(pool.map(run, range(len(batches))))
    for index, outputs in enumerate(results):
        for output in outputs:
            assert torch.equal(output, expected[index]), f"thread {index} got another packing's result"
