"""Nothing packfree derives is written into the caller's tensors: after a packed forward and backward with labels, and
after every public boundary op called directly, each tensor the caller handed over has an empty ``__dict__``
(``vars(t) == {}``). What packfree keeps about a tensor (its host copy, the forms and masks derived from it) sits in
packfree's own store (:mod:`packfree_plugin.boundaries.store`), keyed by the tensor's identity: these tests also see
it there, and see the entry freed with its tensor (a kept value that held its own tensor would keep both forever).

That what is kept follows an in-place write: tests/test_inplace_refill.py and tests/ops/test_inplace_refill_ops.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from packfree_plugin.boundaries import store
from tests.helpers import shared_pair
from tests.ops.harness import assert_same_grads
from tests.ops.test_inplace_refill_ops import CASES, _applied, boundary_tensor, per_token_ids
from tests.test_inplace_refill import FORMS, packed_batch

MODELS = ("llama", "qwen3_next", "mamba2")
"""Attention, a Gated DeltaNet hybrid and Mamba2 (SSD and the causal conv)."""
KEEPING = ("causal_conv1d/seq_idx/boundary rows", "causal_conv1d/seq_idx/dense masks", "causal_conv1d/seq_idx/spread",
           "ssd_chunk_scan/seq_idx", "chunk_gated_delta_rule/no initial state", "chunk_gated_delta_rule/initial states")
"""Op calls that keep values derived from their boundary tensor (conv boundary rows, masks or slots, SSD masks, the
Gated DeltaNet's masks and the ``seq_idx`` of its ``cu_seqlens``, the value checks)."""


def _bare(tensors: dict[str, torch.Tensor | None], what: str) -> None:
    for name, tensor in tensors.items():
        if tensor is not None:
            assert vars(tensor) == {}, f"{what}: packfree left {sorted(vars(tensor))} on the caller's {name}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("model_type", MODELS)
def test_a_packed_forward_and_backward_leave_nothing_on_the_batch(model_type: str, form: str) -> None:
    """A packed batch with labels, forward and backward: its tensors hold nothing of packfree's; the boundary input's
    host copy, which the forward read, is in packfree's store."""
    model, _ = shared_pair(model_type)
    batch = packed_batch("A", form, labels=True)
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    assert torch.isfinite(loss)
    _bare(batch, f"{model_type}/{form}")
    source = batch["cu_seq_lens_q" if form == "cu_seq_lens" else form]
    assert store._kept_host(source) is not None, f"{model_type}/{form}: the forward's host copy was not kept"


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_op_called_directly_leaves_nothing_on_its_tensors(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every public boundary op, forward and backward on a boundary tensor: the result is the naive reference's, and
    neither the boundary tensor nor any input holds anything of packfree's."""
    case = CASES[name]
    inputs = _applied(case, monkeypatch)
    boundary = boundary_tensor(case.kind, "A")
    out = case.run(inputs, {case.kind: boundary})
    reference = {"cu_seqlens": boundary_tensor("cu_seqlens", "A")} if case.naive_takes == "cu_seqlens" else \
        {"seq_idx": per_token_ids(case.kind, "A")}
    leaves = {key: value for key, value in inputs.items() if value is not None}
    assert_same_grads(out, case.naive(inputs, reference), leaves)
    _bare({case.kind: boundary, **inputs}, name)
    if name in KEEPING:
        kept = store._kept_for(boundary)
        assert kept is not None and kept.derived, f"{name}: nothing derived from {case.kind} is in the store"


@pytest.mark.parametrize("name", KEEPING)
def test_what_is_kept_about_a_tensor_is_freed_with_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store holds its tensors weakly and no kept value holds its own tensor: once the caller drops the boundary
    tensor (and the op's output, whose graph saved it), the tensor is freed and its entry with it."""
    case = CASES[name]
    inputs = _applied(case, monkeypatch)
    boundary = boundary_tensor(case.kind, "A")
    out = case.run(inputs, {case.kind: boundary})
    torch.autograd.grad(out.sum(), [t for t in inputs.values() if t is not None])
    assert store._kept_for(boundary) is not None, f"{name}: nothing was kept about {case.kind}"
    entries = len(store._kept)
    alive = weakref.ref(boundary)
    del boundary, out
    gc.collect()
    assert alive() is None, f"{name}: {case.kind} outlived the caller's last reference"
    assert len(store._kept) < entries, f"{name}: the store kept its entry for a freed tensor"
