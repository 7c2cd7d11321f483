"""The recipes of docs/loss.md, run as they are written there (each ``<!-- recipe: name -->`` block, executed with a
tiny Llama, a dataset of weighted samples and the test's arguments): one optimizer step of 2 accumulated micro-batches
(4 samples each, 3 and 4 of them with targets), whose gradient, read back from plain SGD at learning rate 1 (the
weights' change), must equal the per-sample-mean loss's of the 8 samples padded on stock (both weights)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_close
from tests.helpers import fresh_pair
from tests.loss.reference import Samples, reference_loss

DOC = Path(__file__).resolve().parents[2] / "docs" / "loss.md"
LENGTHS = [6, 1, 9, 4, 7, 3, 5, 8]
STEP = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, optim="sgd", learning_rate=1.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, train_sampling_strategy="sequential",
            remove_unused_columns=False, report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
            disable_tqdm=True)
"""One plain SGD step (no clipping, no decay) over the samples in dataset order, every column kept."""


def recipe(name: str) -> str:
    """The code of the ``python`` block under ``<!-- recipe: name -->`` in docs/loss.md (after the invisible set-up
    blocks that tests/test_docs.py runs before it, if any)."""
    found = re.search(rf"<!-- recipe: {name} -->\n(?:<!--.*?-->\n)*```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert found, f"docs/loss.md has no recipe {name!r}"
    return found.group(1)


def _expected_gradients(stock: torch.nn.Module, samples: Samples) -> dict[str, torch.Tensor]:
    padded = samples.padded()
    logits = stock(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False).logits
    stock.zero_grad()
    reference_loss(logits, padded["labels"], samples, "both", "sample").backward()
    return {name: p.grad.clone() for name, p in stock.named_parameters() if p.grad is not None}


def _run(name: str, args: object | None, tmp_path: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """Run recipe ``name``; ``(its namespace, the weights' change per parameter, the expected gradients)``."""
    datasets = pytest.importorskip("datasets")
    from packfree_plugin.cli.tiny import tiny_tokenizer

    model, stock = fresh_pair("llama")
    samples = Samples.drawn(LENGTHS)
    expected = _expected_gradients(stock, samples)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    namespace = {"model": model.train(), "dataset": datasets.Dataset.from_list(samples.features("both")),
                 "args": args, "tokenizer": tiny_tokenizer()}
    exec(compile(recipe(name), f"docs/loss.md:{name}", "exec"), namespace)
    change = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    return namespace, change, expected


def test_trainer_recipe(tmp_path) -> None:
    from transformers import TrainingArguments

    _, change, expected = _run("trainer", TrainingArguments(str(tmp_path), **STEP), tmp_path)
    for name, grad in expected.items():
        assert_close(change[name], grad, atol=1e-10, rtol=1e-8, what=f"trainer {name}")


def test_sft_recipe(tmp_path) -> None:
    pytest.importorskip("trl")
    from trl import SFTConfig

    args = SFTConfig(str(tmp_path), **STEP, padding_free=True, max_length=None, bf16=False,
                     dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.warns(FutureWarning, match="compute_loss_func"):
        namespace, change, expected = _run("sft", args, tmp_path)
    dtype = next(namespace["model"].parameters()).dtype
    tolerance = dict(atol=1e-10, rtol=1e-8) if dtype == torch.float64 else dict(atol=1e-6, rtol=1e-4)
    for name, grad in expected.items():
        assert_close(change[name], grad.to(dtype), **tolerance, what=f"sft {name} ({dtype})")


def test_loop_recipe(tmp_path) -> None:
    namespace, _, expected = _run("loop", None, tmp_path)
    grads = {name: p.grad for name, p in namespace["model"].named_parameters() if p.grad is not None}
    for name, grad in expected.items():
        assert_close(grads[name], grad, atol=1e-10, rtol=1e-8, what=f"loop {name}")
    assert namespace["per_sample"].shape == (4,)  # the second micro-batch's samples, all with targets


def test_sample_reduction_refuses_an_accumulated_batch_it_did_not_count(tmp_path) -> None:
    """Without ``attach`` the Trainer's ``num_items_in_batch`` comes with no sample count: refused, not guessed."""
    from transformers import TrainingArguments

    code = recipe("trainer").replace("loss.attach(trainer)", "")
    datasets = pytest.importorskip("datasets")
    model, _ = fresh_pair("llama")
    namespace = {"model": model.train(), "args": TrainingArguments(str(tmp_path), **STEP),
                 "dataset": datasets.Dataset.from_list(Samples.drawn(LENGTHS).features("both"))}
    with pytest.raises(ValueError, match=r"call loss.attach\(trainer\)"):
        exec(compile(code, "docs/loss.md:trainer without attach", "exec"), namespace)
