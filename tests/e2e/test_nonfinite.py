"""A NaN or inf in one sample's embeddings never reaches another sample of the packed row (issue 10).

For every hybrid / recurrent type of the catalogue (float64, perturbed tiny weights, the pairs of
``tests/models/test_hybrids.py``): one token of one sample of a packed row gets a non-finite input embedding.
The other samples' outputs must be finite and equal to stock transformers running each of them alone, and
with the loss taken on those samples only, the gradient w.r.t. their input embeddings must be finite and
equal to stock's. The poisoned sample itself must not come out finite (it is never silently repaired).
Gradients w.r.t. shared weights are not compared: a batched run with a NaN input has NaN weight gradients
whatever the packing, padded stock included.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close
from tests.models.test_hybrids import MODEL_TYPES, output, pair, tolerance

LENGTHS = [6, 9, 3, 9]  # longer than the tiny chunk / block / window sizes of the catalogue configs
SICK = 1  # a sample with samples on both sides, and one of its length (packed attention groups equal lengths)
GRAD_SCALE = 10
"""Gradient tolerance over the outputs' (:func:`tests.models.test_hybrids.tolerance`): the backward sums over more
terms, and stock runs some scans in float32."""
GRAD_FLOOR = 1e-8
"""Float64 embedding gradients through a few layers: inkling_text's differ from stock's by 1.1e-9 (2e-7 relative)
with a finite input too: its short convs compute in float32 (stock keeps them in fp32 and casts their input), so that
is float32 rounding, not non-finite isolation."""
REPRESENTATIVES = {"mamba2", "mamba", "qwen3_next", "kimi_linear", "lfm2", "minimax", "recurrent_gemma"}
"""One type per mixer family: SSD, selective scan, Gated DeltaNet, KDA, short conv, lightning, RG-LRU."""


class _Replace:
    """Forward hook on the input embedding: returns ``embeds[:, piece]`` instead of the lookup, so that the
    NaN goes in and the gradient comes out at one leaf (models that read ``input_ids`` beside the embeddings,
    such as n-gram or hashed layers, still get their ids)."""

    def __init__(self, embeds: torch.Tensor):
        self.embeds, self.piece = embeds, slice(None)

    def __call__(self, module, args, out):
        return self.embeds[:, self.piece]


def _check(model_type: str, value: float) -> None:
    model, stock = pair(model_type)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, sum(LENGTHS)), generator=generator)
    embeds = model.get_input_embeddings()(ids).detach().clone()
    token = sum(LENGTHS[:SICK]) + LENGTHS[SICK] // 2
    embeds[0, token, int(torch.randint(embeds.shape[-1], (1,), generator=generator))] = value
    embeds.requires_grad_()
    replace = _Replace(embeds)
    hooks = [m.get_input_embeddings().register_forward_hook(replace) for m in (model, stock)]
    offsets = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    clean = [i for i in range(len(LENGTHS)) if i != SICK]
    try:
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        packed = output(model(input_ids=ids, position_ids=positions, use_cache=False)).split(LENGTHS, dim=1)
        alone = {}
        for i in clean:
            replace.piece = slice(offsets[i], offsets[i + 1])
            alone[i] = output(stock(input_ids=ids[:, replace.piece], use_cache=False))
    finally:
        for hook in hooks:
            hook.remove()
    tol = tolerance(model_type)
    for i in clean:
        assert_close(packed[i], alone[i], atol=tol, rtol=tol, what=f"{model_type} sample {i} output")
    assert not torch.isfinite(packed[SICK]).all(), f"{model_type}: the poisoned sample came out finite"

    weights = {i: torch.randn(alone[i].shape, generator=generator, dtype=alone[i].dtype) for i in clean}
    (grad,) = torch.autograd.grad(sum((packed[i] * weights[i]).sum() for i in clean), [embeds])
    (expected,) = torch.autograd.grad(sum((alone[i] * weights[i]).sum() for i in clean), [embeds])
    for i in clean:
        piece = slice(offsets[i], offsets[i + 1])
        grad_tol = max(GRAD_SCALE * tol, GRAD_FLOOR)
        assert_close(grad[:, piece], expected[:, piece], atol=grad_tol, rtol=grad_tol,
                     what=f"{model_type} sample {i} embedding gradient")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVES))
def test_one_type_per_family(model_type: str, value: float):
    _check(model_type, value)


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t not in REPRESENTATIVES])
def test_every_covered_type(model_type: str):
    _check(model_type, float("nan"))


class _NoQuarantine:
    """Stands in for :class:`packfree_plugin.ops._nonfinite.Quarantine` inside packfree's ops: a kernel that mixes a
    poisoned sample's NaN into its neighbours, as the CUDA kernels (fla, mamba-ssm, causal-conv1d) may."""

    def __init__(self, seq_idx, per_token, initial_state=None):
        self.per_token = per_token

    def clean(self):
        return [t for t, _ in self.per_token]

    def clean_state(self, state):
        return state

    def mark(self, y, time_dim=1):
        return y

    def mark_states(self, final, offsets):
        return final


KERNEL_FAMILIES = {"mamba2", "qwen3_next", "kimi_linear", "lfm2"}
"""The families whose ops may call a CUDA kernel package (causal-conv1d, mamba-ssm, fla); the others run packfree's
torch ops on every device."""


def _non_isolating_kernels(monkeypatch) -> None:
    """Make every op pick a stand-in for its CUDA kernel: packfree's torch path with its quarantine taken out, so
    that, as fla, mamba-ssm and causal-conv1d may, it mixes a poisoned sample's NaN into its neighbours."""
    from packfree_plugin.ops.conv import fast as conv_fast, op as conv_op
    from packfree_plugin.ops.gated_delta import fast as delta_fast, op as delta_op
    from packfree_plugin.ops.ssd import fast as ssd_fast, op as ssd_op

    for module in (ssd_fast, delta_fast):
        monkeypatch.setattr(module, "Quarantine", _NoQuarantine)

    def conv_kernel(x, weight, bias=None, seq_idx=None, activation=None):  # [B, C, T], causal_conv1d_fn's contract
        return conv_fast.causal_conv1d_masked(x.transpose(1, 2), weight, bias, seq_idx=seq_idx,
                                              activation=activation).transpose(1, 2)

    def ssd_kernel(x, dt, A, B, C, chunk_size, *, seq_idx=None, dt_limit=(0.0, float("inf")), **options):
        return ssd_fast.ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, seq_idx=seq_idx, dt_limit=dt_limit,
                                    **options)

    kernels = {delta_op.FLA_GDN: delta_fast.chunk_gated_delta_rule_torch, delta_op.FLA_KDA: delta_fast.chunk_kda_torch}
    monkeypatch.setattr(conv_op, "pick_kernel", lambda backend, probe, *target: conv_kernel)
    monkeypatch.setattr(conv_op, "_kernel_fits", lambda x, weight: True)
    monkeypatch.setattr(ssd_op, "pick_kernel", lambda backend, probe, *target: ssd_kernel)
    monkeypatch.setattr(ssd_op, "_KERNEL_DTYPES", (torch.float64, torch.float32))
    monkeypatch.setattr(delta_op, "_pick", lambda backend, q, target: kernels[target])


@pytest.mark.parametrize("model_type", sorted(KERNEL_FAMILIES))
def test_ops_isolate_around_kernels_that_do_not(model_type: str, monkeypatch):
    """Where an op picks a CUDA kernel package, the op quarantines a sample whose inputs are non-finite before the
    kernel runs, so isolation does not depend on the kernel (here: stand-ins that mix NaN across samples)."""
    _non_isolating_kernels(monkeypatch)
    _check(model_type, float("nan"))
