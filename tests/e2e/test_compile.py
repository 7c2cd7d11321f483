"""``torch.compile`` on packed rows: same results and gradients, how many graphs one forward runs, recompiles.

A counting backend wraps every graph Dynamo compiles, so a forward's number of graph *executions* is known
(``torch._dynamo.explain`` counts compilations, and a break repeated in every layer compiles once). Graph
breaks per forward = executions - 1. Measured at 2 and 4 layers: any growth is a break per layer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

import packfree_plugin
from packfree_plugin.cli.tiny import tiny_config
from packfree_plugin.gate.audit import packed_row
from tests.conftest import CountingBackend, assert_close
from tests.helpers import fresh_pair, samples_of
from tests.models.test_hybrids import tolerance
from packfree_plugin.gate.catalogue import catalogue_config

NATIVE_FAMILIES = ["llama", "qwen3_next", "kimi_linear", "mamba2", "falcon_mamba", "lfm2"]
"""Attention, Gated DeltaNet, KDA, Mamba2 SSD, Mamba1 selective scan, short conv."""


def _model(config, dtype: torch.dtype = torch.float32):
    packfree_plugin.register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=dtype,
                                            experts_implementation="eager")


def _row(lengths: tuple[int, ...], seed: int = 0, *, flash_kwargs: bool = False) -> dict[str, torch.Tensor]:
    """One packed row: position_ids only (TRL), or with ``cu_seq_lens_*``/``max_length_*`` as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` sends them."""
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(3, 128, (n,), generator=generator) for n in lengths]
    if flash_kwargs:
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in samples])
        return {k: v for k, v in batch.items() if k != "labels"}
    return packed_row(samples)


def labels_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The row's tokens as labels, -100 at every sample's first token (the label contract of packed rows)."""
    return batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100)


def eager_then_compiled(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, autocast: bool = False):
    """``((loss, gradients), (loss, gradients))`` of one packed training step, eager then compiled with AOT
    autograd (so the backward of packfree's custom op runs); ``autocast``: inside bf16 autocast."""

    def step(module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = module(**batch, labels=labels_of(batch), use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = step(model)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    assert len(compiled[1]) == len(eager[1]) > 0
    return eager, compiled


def graphs_per_forward(model_type: str, layers: int) -> int:
    """Graph executions in one compiled forward of a packed row (compiled logits checked against eager)."""
    # Kimi Linear's mixture-of-experts layers loop over the experts hit (a break per layer that is not
    # packfree's): give it dense MLPs here.
    overrides = dict(mlp_layer_types=["dense"] * layers) if model_type == "kimi_linear" else {}
    model = _model(tiny_config(model_type, num_hidden_layers=layers, **overrides)).eval()
    batch = _row((5, 9, 3))
    backend = CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        expected = model(**batch, use_cache=False).logits
        compiled(**batch, use_cache=False)  # compiles
        backend.runs = 0
        actual = compiled(**batch, use_cache=False).logits
    torch._dynamo.reset()
    assert_close(actual, expected, atol=1e-6, rtol=0, what=f"compiled {model_type}")
    return backend.runs


@pytest.mark.parametrize("model_type", NATIVE_FAMILIES)
def test_boundaries_cause_no_graph_break_per_layer(model_type: str, record_property) -> None:
    """One graph per forward. The outermost model's hook reads the batch before the compiled frame; the
    inner model (given the boundaries in its kwargs, or, from Mamba's heads, the same tokens with the cache
    off), decoder layers, mixers and attention are all traced."""
    counts = {layers: graphs_per_forward(model_type, layers) for layers in (2, 4)}
    record_property("graphs_per_forward", counts)
    assert counts == {2: 1, 4: 1}, f"{model_type} graphs per forward by layer count: {counts}"


@pytest.mark.parametrize(("model_type", "flash_kwargs"), [
    ("llama", False), ("qwen3_next", False), ("qwen3_next", True), ("mamba2", False), ("lfm2", False),
], ids=["llama", "qwen3_next", "qwen3_next-cu_seq_lens", "mamba2", "lfm2"])
def test_new_packings_do_not_recompile(model_type: str, flash_kwargs: bool) -> None:
    """Boundaries are graph data. After a warm-up (the first new sample count and the first new row length
    each compile once, as Dynamo then marks that size dynamic), new packings and row lengths compile nothing."""
    model = _model(tiny_config(model_type)).eval()
    backend = CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for lengths in ((5, 9, 3), (8, 9), (6, 10, 4)):  # warm-up: new sample count, new row length
            compiled(**_row(lengths, flash_kwargs=flash_kwargs), use_cache=False)
        warm = backend.compiled
        for lengths in ((1, 2, 3, 4, 7), (16, 1), (11, 12), (2, 3, 4, 5, 6, 7), (9, 3, 1, 8, 2, 2, 5)):
            batch = _row(lengths, flash_kwargs=flash_kwargs)
            assert_close(compiled(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits,
                         atol=1e-6, rtol=0, what=f"compiled {model_type} {lengths}")
        recompiles = backend.compiled - warm
    torch._dynamo.reset()
    assert warm <= 3, f"{model_type}: {warm} compilations during the warm-up (3 at most)"
    assert recompiles == 0, f"{model_type}: {recompiles} recompiles for new packings after the warm-up"


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_a_new_packing_of_the_same_row_length_is_not_served_stale_offsets(model_type: str) -> None:
    """Packings that share one row length reuse one compiled graph: every one must be computed with its own
    offsets (a graph that baked the first packing's offsets in would give the later ones its samples)."""
    model = _model(tiny_config(model_type)).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        for lengths in ((6, 9, 5), (10, 10), (1, 18, 1), (20,), (3, 3, 3, 3, 8)):  # all 20 tokens
            batch = _row(lengths, seed=sum(x * x for x in lengths))
            assert_close(compiled(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits,
                         atol=1e-5, rtol=0, what=f"compiled {model_type} {lengths}")
    torch._dynamo.reset()


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "falcon_mamba", "kimi_linear"])
def test_compiled_training_step_matches_eager(model_type: str) -> None:
    """Loss and every parameter gradient of a compiled packed step equal eager's, in float64."""
    model = _model(tiny_config(model_type), torch.float64).train()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = eager_then_compiled(model, _row((5, 9, 3), seed=1))
    # Stock Mamba1 runs parts of its layer in float32 even in a float64 model; compiled and eager round there
    # differently (1.9e-8 measured). Everything else stays float64.
    atol = 1e-7 if model_type == "falcon_mamba" else 1e-10
    assert_close(compiled_loss, eager_loss, atol=atol, rtol=0, what=f"{model_type} compiled loss")
    for index, (grad, expected) in enumerate(zip(compiled_grads, eager_grads)):
        assert_close(grad, expected, atol=atol, rtol=0, what=f"{model_type} compiled gradient {index}")


def test_generic_tier_runs_eagerly_inside_compiled_models() -> None:
    """Generic-tier mixers (here RWKV's) regroup samples by the packing, so they run outside the graph: the
    compiled model still matches eager and a new packing compiles nothing."""
    model = _model(catalogue_config("rwkv")).eval()
    backend = CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for lengths in ((5, 9, 3), (8, 9), (1, 2, 3, 4, 7)):
            batch = _row(lengths)
            assert_close(compiled(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits,
                         atol=1e-6, rtol=0, what=f"compiled rwkv {lengths}")
            if lengths == (5, 9, 3):
                first = backend.compiled
    torch._dynamo.reset()
    assert backend.compiled == first, f"rwkv recompiled {backend.compiled - first} times for new packings"


def test_attention_dropout_runs_in_the_graph_without_recompiles() -> None:
    """Training with attention dropout: the opaque op draws its dropout from a seed in the graph, so new
    packings recompile nothing after the warm-up, and the dropout is really applied (the loss moves)."""
    model = _model(tiny_config("llama", attention_dropout=0.3)).train()
    backend = CountingBackend()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)

    def loss(module, lengths: tuple[int, ...]) -> torch.Tensor:
        batch = _row(lengths)
        return module(**batch, labels=labels_of(batch), use_cache=False).loss

    for lengths in ((5, 9, 3), (8, 9), (6, 10, 4)):
        loss(compiled, lengths).backward()
    warm = backend.compiled
    losses = [loss(compiled, (1, 2, 3, 4, 7)) for _ in range(2)]
    for lengths in ((16, 1), (11, 12), (2, 3, 4, 5, 6, 7)):
        loss(compiled, lengths).backward()
    recompiles = backend.compiled - warm
    with torch.no_grad():
        undropped = loss(model.eval(), (1, 2, 3, 4, 7))
    torch._dynamo.reset()
    assert recompiles == 0, f"{recompiles} recompiles for new packings with attention dropout"
    assert all(torch.isfinite(value) for value in losses)
    assert float((losses[0] - losses[1]).abs()) > 1e-4 and float((losses[0] - undropped).abs()) > 1e-4


_COMPILED: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def _compiled_pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A compiled packfree model (Dynamo only) and its stock twin, float64, built once per model type."""
    if model_type not in _COMPILED:
        model, stock = fresh_pair(model_type)
        _COMPILED[model_type] = (torch.compile(model, backend="eager"), stock)
    return _COMPILED[model_type]


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2"])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_compiled_packed_row_equals_each_sample_alone(model_type: str, lengths: list[int]) -> None:
    """Property: whatever the packing, the compiled packed forward gives each sample the logits stock
    transformers gives it alone (float64; stock runs its GDN / SSD torch paths in float32 inside, hence
    the tolerance of tests/models/test_hybrids.py). One compiled model serves every drawn packing."""
    compiled, stock = _compiled_pair(model_type)
    samples = [torch.tensor(sample) for sample in samples_of(lengths)]
    with torch.no_grad():
        packed = compiled(**packed_row(samples), use_cache=False).logits[0]
        for index, (piece, sample) in enumerate(zip(packed.split(lengths), samples)):
            alone = stock(input_ids=sample[None], use_cache=False).logits[0]
            assert_close(piece, alone, atol=tolerance(model_type), rtol=0,
                         what=f"{model_type} sample {index} of {lengths}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_mamba"])
def test_compiled_checkpointed_step_matches_eager(model_type: str, reentrant: bool) -> None:
    """torch.compile together with gradient checkpointing: the recomputation still sees each layer's
    boundaries (FalconMamba's layers get them only through the checkpoint wrapper)."""
    model = _model(tiny_config(model_type), torch.float64).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = eager_then_compiled(model, _row((5, 9, 3), seed=2))
    assert_close(compiled_loss, eager_loss, atol=1e-7, rtol=0, what="loss")
    for index, (grad, expected) in enumerate(zip(compiled_grads, eager_grads)):
        assert_close(grad, expected, atol=1e-7, rtol=0, what=f"{model_type} gradient {index}")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "mamba2"])
def test_compiled_step_under_bf16_autocast_matches_eager(model_type: str) -> None:
    """bf16 autocast around a compiled packed step: RoPE leaves q/k in float32 next to a bf16 v, and the
    custom op runs with autocast off, so packed attention casts q/k/v itself (it crashed before). Compiled
    and eager agree to bf16 precision: loss within 1e-3, every gradient within 2% of the largest."""
    model = _model(tiny_config(model_type)).train()
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = eager_then_compiled(
        model, _row((5, 9, 3)), autocast=True)
    largest = max(float(g.abs().max()) for g in eager_grads)
    assert abs(float(compiled_loss - eager_loss)) <= 1e-3
    for index, (grad, expected) in enumerate(zip(compiled_grads, eager_grads)):
        assert_close(grad, expected, atol=0.02 * largest, rtol=0, what=f"{model_type} gradient {index}")
