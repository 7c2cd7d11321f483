"""The host-read budget: a packed forward and backward reads values back from the device (a synchronisation on a GPU)
no more often than stock on the same samples padded, and packfree itself reads once per forward, never per layer.

Reads are counted on the CPU by a ``TorchFunctionMode`` that sees every call which hands a tensor's values to Python
(``item``, ``tolist``, ``numpy``, ``bool()``, ``float()``, ``int()``...), attributed to the innermost caller outside
torch: packfree's own, or the model's (transformers'). Every counted run starts from fresh copies of the batch, so a
host copy kept for a tensor by an earlier run hides nothing; and each packed run's loss equals stock's on the samples
padded, so the count is that of a run that computes the right thing.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from packfree_plugin.packing.rows import PackedCollator
from packfree_plugin.cli.tiny import auto_class, tiny_config
from tests.conftest import assert_close
from tests.helpers import padded_batch, samples_of

_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
                    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__,
                    torch.Tensor.__array__, torch.equal})
"""The calls that hand a tensor's values to Python (``torch.equal`` returns a Python bool)."""

LAYERS = 4
MODELS = {"llama": "sdpa", "qwen3_next": "sdpa", "mamba2": "eager", "mamba": "eager"}
"""Model type -> stock's implementation (pure Mamba models have no sdpa path): attention, a Gated DeltaNet hybrid,
Mamba2 (SSD) and Mamba1 (selective scan)."""


class HostReads(TorchFunctionMode):
    """Counts value reads by who made them: ``"packfree"`` (the innermost caller outside torch is packfree's) or
    ``"model"``."""

    def __init__(self) -> None:
        super().__init__()
        self.by: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            caller = next(frame for frame in reversed(traceback.extract_stack()[:-1])
                          if "/torch/" not in frame.filename and frame.filename != __file__)
            self.by["packfree" if "packfree_plugin" in caller.filename else "model"] += 1
            self.where[f"{func.__name__} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by.values())


def _model(model_type: str, implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(model_type, num_hidden_layers=LAYERS)
    return auto_class(config).from_config(config, attn_implementation=implementation, dtype=torch.float64,
                                          experts_implementation="eager").train()


def _fresh(batch: dict[str, Any]) -> dict[str, Any]:
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}


def counted_step(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[HostReads, torch.Tensor]:
    """One forward and backward on fresh copies of ``batch`` (after an uncounted one), its reads and its loss."""
    model(**_fresh(batch)).loss.backward()
    model.zero_grad()
    with HostReads() as reads:
        loss = model(**_fresh(batch)).loss
        loss.backward()
    return reads, loss.detach()


def _runs(model_type: str) -> dict[str, tuple[HostReads, torch.Tensor]]:
    """The counted steps of stock on the samples padded, and of packfree on them packed, with the collator's
    boundary keywords and with ``position_ids`` only."""
    from packfree_plugin.loading.register import register

    register()
    samples = samples_of([23, 17, 30, 12, 9])
    packed = PackedCollator()([{"input_ids": sample} for sample in samples])
    ids_only = {name: packed[name] for name in ("input_ids", "labels", "position_ids")}
    stock, model = _model(model_type, MODELS[model_type]), _model(model_type, "packfree")
    return {"stock padded": counted_step(stock, padded_batch(samples)), "packed kwargs": counted_step(model, packed),
            "packed ids": counted_step(model, ids_only)}


def _shown(runs: dict[str, tuple[HostReads, torch.Tensor]]) -> str:
    return "; ".join(f"{name}: {reads.total} {dict(reads.where)}" for name, (reads, _) in runs.items())


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_packed_step_reads_once_and_no_more_than_stock_padded(model_type: str) -> None:
    """Per model, one test (so that ``nox -s mutants`` maps every function the steps call to the checks of their
    reads, which a module fixture's calls would tie to the first test only):

    - the counted packed steps are right ones: their loss is stock's on the samples padded (each sample alone in
      its row);
    - packfree's own reads in a forward and backward of a 4-layer model are the batch's one read (its boundary
      inputs and labels copied together), none per layer or per op call, with the collator's keywords and with
      ``position_ids`` only;
    - with ``cu_seq_lens``/``seq_idx`` given, a packed step reads no more than stock's padded one (which reads its
      padding mask); where stock reads nothing (a Mamba1 padded forward), packfree reads the boundaries once;
    - with ``position_ids`` only, a packed step reads at most once more than stock's padded one: the ids."""
    runs = _runs(model_type)
    stock_reads, expected = runs["stock padded"]
    for name in ("packed kwargs", "packed ids"):
        assert_close(runs[name][1], expected, atol=1e-10, what=name)
        assert runs[name][0].by["packfree"] <= 1, f"{name}: {_shown(runs)}"
    assert runs["packed kwargs"][0].total <= max(stock_reads.total, 1), _shown(runs)
    assert runs["packed ids"][0].total <= stock_reads.total + 1, _shown(runs)


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_a_packed_forward_under_inference_mode_reads_once(model_type: str) -> None:
    """Under ``torch.inference_mode`` (evaluation, a prefill) every tensor is an inference tensor, which has no
    version counter. What packfree keeps about the forms its boundaries built (``cu_seqlens``, ``seq_idx``) and
    about the inputs its entry read still holds for the forward: with the collator's keywords and with
    ``position_ids`` only, it reads once, as in training, and its logits are stock's on each sample alone (planted:
    a form's kept values never holding for an inference tensor made Qwen3-Next read 3 times from ids only)."""
    from packfree_plugin.loading.register import register

    register()
    samples = samples_of([23, 17, 30, 12, 9])
    packed = PackedCollator()([{"input_ids": sample} for sample in samples])
    layouts = {"packed kwargs": packed, "packed ids": {name: packed[name] for name in ("input_ids", "position_ids")}}
    stock = _model(model_type, MODELS[model_type]).eval()
    model = _model(model_type, "packfree").eval()
    tolerance = 1e-10 if model_type == "llama" else 1e-6  # stock's scans run in float32 inside a float64 model
    with torch.inference_mode():
        alone = [stock(input_ids=torch.tensor([sample]), use_cache=False).logits[0] for sample in samples]
        for name, batch in layouts.items():
            model(**_fresh(batch))
            with HostReads() as reads:
                logits = model(**_fresh(batch)).logits[0]
            assert reads.by["packfree"] <= 1, f"{name}: {dict(reads.where)}"
            for index, (piece, expected) in enumerate(zip(logits.split([len(s) for s in samples]), alone)):
                assert_close(piece, expected, atol=tolerance, what=f"{name} sample {index}")
