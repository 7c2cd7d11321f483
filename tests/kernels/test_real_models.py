"""Whole transformers models loaded with packfree, their mixers running the real fla / mamba-ssm Triton kernels
(interpreted on the CPU). A packed batch equals, in logits, loss and the gradient of every parameter:

(a) each sample run alone through the same model, whose stock layers call the same real kernels, and
(b) each sample run alone through a float64 copy of the same weights, kernel mode off, on transformers' own torch
    code (transformers binds fla / mamba-ssm when its modeling module is imported, so the reference puts the torch
    functions back for its run; no Triton kernel runs in it).

The packed run must hand the real kernel the batch's boundaries (``cu_seqlens`` for fla, ``seq_idx`` for mamba-ssm),
and the same comparison fails when the kernel is handed planted wrong boundaries.

The fla models run in float16 (Triton's interpreter miscomputes bfloat16, see test_real_fla.py), the mamba-ssm ones
in float32. Configs are the catalogue's tiny ones with dense MLPs (float16 and float64 would route some tokens to
other experts) and few mixer heads (the interpreter runs every kernel program in Python).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel
from triton.runtime import interpreter
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import packfree_plugin
from packfree_plugin.ops import backends
from packfree_plugin.gate.catalogue import CATALOGUE
from packfree_plugin.mixers.seam import routed_functions
from packfree_plugin.classes import CLASSES
from packfree_plugin.gate.admission import bypassed
from packfree_plugin.packing import PackedCollator, pack_best_fit_decreasing


@dataclasses.dataclass(frozen=True)
class Family:
    """A model type whose mixers packfree routes to a real Triton kernel, and the batches that exercise it."""

    kernel: tuple[str, str]  # (module, function) packfree's op loads
    boundary: str  # the kernel keyword carrying the boundaries
    dtype: torch.dtype  # of the kernel runs
    lengths: tuple[int, ...]  # samples of the main test: a one-token one and one crossing a kernel chunk
    rows: int  # B packed rows of ``row_tokens`` tokens (1: one row of exactly the samples)
    row_tokens: int | None
    overrides: dict[str, Any]  # on top of the catalogue entry
    tol: float  # error allowed, relative to each reference tensor's largest entry
    planted_lengths: tuple[int, ...]  # samples of the planted-wrong test (forward only, one row)


GDN = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
KDA = ("fla.ops.kda", "chunk_kda")
SSD = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
FAMILIES: dict[str, Family] = {
    # fla chunks each sample in 64 tokens: the 70-token one spans two chunks. Qwen3-Next: two value heads on one
    # key head (packfree repeats the key heads for fla); B = 2 rows of 71 tokens, [1, 70] and [5, padding 66],
    # which packfree hands fla as one row of four segments.
    "qwen3_next": Family(GDN, "cu_seqlens", torch.float16, (1, 70, 5), 2, 71,
                         dict(mlp_only_layers=[0, 1], linear_num_value_heads=2, linear_num_key_heads=1), 1e-2,
                         (3, 9, 4)),
    "kimi_linear": Family(KDA, "cu_seqlens", torch.float16, (1, 66, 3), 1, None,
                          dict(mlp_layer_types=["dense", "dense"], linear_num_heads=1), 1e-2, (3, 9, 4)),
    # SSD chunks of 16 tokens; B = 2 rows of 21 tokens, [1, 20] and [17, padding 4]: both long samples cross a chunk
    # start. Bamba: one Mamba2 layer, one attention layer. Eight heads: the in-projection's width (2 * 64 + 2 * 8
    # + heads) is then a multiple of 8, as in published checkpoints; stock hands causal-conv1d a channel-last view of
    # it, which the compiled code refuses otherwise (the samples alone run stock's layers).
    "mamba2": Family(SSD, "seq_idx", torch.float32, (1, 20, 17), 2, 21,
                     dict(num_hidden_layers=1, expand=1, num_heads=8, head_dim=8, state_size=8, chunk_size=16),
                     1e-4, (1, 17, 6)),
    "bamba": Family(SSD, "seq_idx", torch.float32, (1, 20, 17), 2, 21,
                    dict(mamba_expand=1, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16),
                    1e-4, (1, 17, 6)),
}
GRAD_FLOOR = 1e-3
MIXERS = {name for name, entry in CLASSES.items() if entry.mixer in ("gated_delta", "kimi_delta", "mamba2")}


# ------------------------------------------------------------------------------------------------ the runs
@dataclasses.dataclass
class Run:
    """Per sample, logits ``[n, V]``; the loss summed over the samples; each parameter's gradient (all float64)."""

    logits: list[torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def samples_of(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(3, 128, (n,), generator=generator) for n in lengths]


def sample_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (float64) of ``logits [n, V]`` predicting the sample's next token, its last token the
    sample's first (so that every token, a one-token sample's too, reaches the gradients)."""
    return F.cross_entropy(logits.double(), ids.roll(-1), reduction="sum")


def gradients(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in float64 (zeros where it got none), then clears them."""
    grads = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        grads[name] = torch.zeros(parameter.shape, dtype=torch.float64) if grad is None else grad.double()
        parameter.grad = None
    return grads


def packed_batch(samples: list[torch.Tensor], rows: int = 1, row_tokens: int | None = None
                 ) -> tuple[dict[str, Any], list[list[int]]]:
    """packfree's collator's batch (labels dropped) and, per row, the indices of the samples it holds."""
    if rows == 1:
        return PackedCollator()([{"input_ids": s.tolist()} for s in samples]) | {"labels": None}, \
            [list(range(len(samples)))]
    placed = [sorted(b) for b in pack_best_fit_decreasing([len(s) for s in samples], row_tokens)]
    assert len(placed) == rows, f"the samples fill {len(placed)} rows, not {rows}"
    batch = PackedCollator(rows_per_batch=rows, max_tokens=row_tokens)([{"input_ids": s.tolist()} for s in samples])
    return batch | {"labels": None}, placed


def run_packed(model: PreTrainedModel, samples: list[torch.Tensor], rows: int = 1, row_tokens: int | None = None,
               *, backward: bool = True) -> Run:
    """One call on the packed batch; logits cut back into the samples."""
    batch, placed = packed_batch(samples, rows, row_tokens)
    logits = model(**batch, use_cache=False).logits
    pieces: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for row, indices in enumerate(placed):
        start = 0
        for i in indices:
            pieces[i] = logits[row, start : start + len(samples[i])]
            start += len(samples[i])
    loss = sum(sample_loss(piece, ids) for piece, ids in zip(pieces, samples))
    if backward:
        loss.backward()
    return Run([p.detach().double() for p in pieces], loss.detach(), gradients(model) if backward else {})


def run_each_alone(model: PreTrainedModel, samples: list[torch.Tensor], *, backward: bool = True) -> Run:
    """Each sample in a plain call of its own (one sample, no boundary fields: the stock layers run it);
    gradients summed over the samples."""
    logits, loss = [], torch.zeros((), dtype=torch.float64)
    for ids in samples:
        out = model(input_ids=ids[None], use_cache=False).logits[0]
        loss_of_sample = sample_loss(out, ids)
        if backward:
            loss_of_sample.backward()  # accumulates into .grad: the sum over samples
        logits.append(out.detach().double())
        loss = loss + loss_of_sample.detach()
    return Run(logits, loss, gradients(model) if backward else {})


# --------------------------------------------------------------------------------------------- the models
def build(model_type: str, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None) -> PreTrainedModel:
    """A tiny transformers model loaded with packfree, with a config of its own (``from_config`` does not copy
    one). By class, not through the auto classes: importing fla registers fla's own Mamba2 under ``"mamba2"``."""
    packfree_plugin.register()
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    config = config_class(**{**CATALOGUE[model_type].sized, **FAMILIES[model_type].overrides})
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    # the load-time gate bypassed: on a release the sweep has not recorded it proves a tiny copy at load, whose runs
    # would count as this test's kernel launches (the gate's proof has tests of its own)
    with bypassed():
        model = model_class._from_config(config, attn_implementation="packfree", dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model


@cache
def weights(model_type: str) -> dict[str, torch.Tensor]:
    """Perturbed weights (zero-initialised biases and gates cannot hide a dropped term) with slow decays (``A_log``
    near log 0.1: the initialised ones forget a sample within a token or two, which would hide a leak into the next
    one), rounded to the kernel runs' dtype, so the float64 reference gets exactly the same values."""
    torch.manual_seed(0)
    model = build(model_type, torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.copy_(torch.empty(parameter.shape).uniform_(0.05, 0.2, generator=generator).log())
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return {name: t.to(FAMILIES[model_type].dtype) for name, t in model.state_dict().items()}


def kernel_model(model_type: str) -> PreTrainedModel:
    return build(model_type, FAMILIES[model_type].dtype, weights(model_type))


def torch_implementation(function: Callable) -> Callable:
    """transformers' own torch code of a kernel function: under a ``kernels`` layer (transformers' kernel seam, whose
    forward calls the function it was made from) and the fla / mamba-ssm binding, ``__wrapped__`` leads to it."""
    if isinstance(function, torch.nn.Module):
        function = inspect.getclosurevars(type(function).forward).nonlocals["func"]
    return inspect.unwrap(function)


@contextlib.contextmanager
def stock_torch_path(model: PreTrainedModel) -> Iterator[None]:
    """Kernel mode off, and the kernel functions of the model's modeling module back to transformers' own torch
    implementations (under the fla / mamba-ssm binding and packfree's router, ``__wrapped__`` leads to them)."""
    module = sys.modules[type(model).__module__]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backends, "on_cuda", lambda tensor: False)
        for function in routed_functions()[module.__name__.removeprefix("transformers.models.")]:
            if hasattr(module, function):  # fused kernels may be absent (transformers 5.25's FalconMamba and Jamba)
                patch.setattr(module, function, torch_implementation(getattr(module, function)))
        backends.load_kernel.cache_clear()
        try:
            yield
        finally:
            backends.load_kernel.cache_clear()


@cache
def reference(model_type: str, lengths: tuple[int, ...], backward: bool) -> Run:
    """Each sample alone through stock transformers' torch code, on a float64 copy of the weights."""
    model = build(model_type, torch.float64, {n: t.double() for n, t in weights(model_type).items()})
    with stock_torch_path(model):
        return run_each_alone(model.eval(), samples_of(lengths), backward=backward)


# ------------------------------------------------------------------------------------------ the comparison
def assert_matches(actual: Run, expected: Run, what: str, *, tol: float) -> dict[str, float]:
    """Logits, loss and (where both runs have them) gradients within ``tol`` of ``expected``, relative to each
    expected tensor's largest entry; for gradients at least :data:`GRAD_FLOOR` times the largest gradient entry of the
    model (a decay's gradient can be 1e-5 of the others, below float16's resolution of their sum). Returns the
    largest error per kind."""
    def relative(a: torch.Tensor, e: torch.Tensor, floor: float = 1e-6) -> float:
        if not torch.isfinite(a).all():
            return float("inf")
        return (a - e).abs().max().item() / max(e.abs().max().item(), floor)

    kinds = {"logits": [(f"sample {i}", a, e) for i, (a, e) in enumerate(zip(actual.logits, expected.logits))],
             "loss": [("summed", actual.loss, expected.loss)]}
    floor = 1e-6
    if actual.grads and expected.grads:
        kinds["grads"] = [(name, actual.grads[name], expected.grads[name]) for name in expected.grads]
        floor = GRAD_FLOOR * max(g.abs().max().item() for g in expected.grads.values())
    worst = {kind: max((relative(a, e, floor if kind == "grads" else 1e-6), where) for where, a, e in items)
             for kind, items in kinds.items()}
    bad = [f"{kind} off by {error:.2e} > {tol:.0e} ({where})" for kind, (error, where) in worst.items()
           if not error <= tol]
    assert not bad, f"{what}: " + ", ".join(bad)
    return {kind: error for kind, (error, _) in worst.items()}


@contextlib.contextmanager
def triton_launches() -> Iterator[list[str]]:
    """The names of the Triton kernels launched (under the interpreter) inside the block."""
    launched: list[str] = []
    launch = interpreter.GridExecutor.__call__

    def counted(self: interpreter.GridExecutor, *args: Any, **kwargs: Any) -> Any:
        launched.append(self.fn.__name__)
        return launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.GridExecutor, "__call__", counted)
        yield launched


def handed_boundaries(calls: list[tuple[tuple, dict]], family: Family) -> list[list[int] | None]:
    """The boundary argument of each recorded kernel call, flattened, after checking the form its kernel loads:
    int32 (both kernels read it as int32), contiguous, on the data's device."""
    handed = []
    for args, kwargs in calls:
        boundary = kwargs.get(family.boundary)
        if boundary is not None:
            assert boundary.dtype == torch.int32 and boundary.is_contiguous() and boundary.device == args[0].device, \
                f"{family.boundary}: {boundary.dtype}, contiguous {boundary.is_contiguous()}, on {boundary.device}"
            boundary = boundary.flatten().tolist()
        handed.append(boundary)
    return handed


def batch_boundaries(family: Family, batch: dict[str, Any]) -> list[int]:
    return batch["cu_seq_lens_q" if family.boundary == "cu_seqlens" else "seq_idx"].flatten().tolist()


# --------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("model_type", [pytest.param("qwen3_next", marks=pytest.mark.kernels_smoke),
                                        *list(FAMILIES)[1:]])
def test_packed_model_equals_each_sample_alone_and_float64(spy, model_type):
    """Forward and backward of the packed batch through the real kernel, against (a) and (b) of the module
    docstring; the kernel is called once per mixer layer with the batch's boundaries, and never in (a) or (b)."""
    family = FAMILIES[model_type]
    samples = samples_of(family.lengths)
    model = kernel_model(model_type)
    mixers = sum(type(module).__name__ in MIXERS for module in model.modules())
    calls = spy(*family.kernel)

    # train mode: Mamba2 layers first try the fused kernel there, which packfree declines under packing
    packed = run_packed(model.train(), samples, family.rows, family.row_tokens)
    batch, _ = packed_batch(samples, family.rows, family.row_tokens)
    assert mixers >= 1 and handed_boundaries(calls.calls, family) == [batch_boundaries(family, batch)] * mixers, \
        "the packed run did not hand the real kernel the batch's boundaries"

    calls.calls.clear()
    with triton_launches() as launched:
        alone = run_each_alone(model.eval(), samples)  # eval: stock's fused Mamba2 kernel needs CUDA's conv
    assert launched, "the samples alone ran no Triton kernel"
    with triton_launches() as launched:
        expected = reference(model_type, family.lengths, True)
    assert not launched, f"the float64 reference ran Triton kernels: {sorted(set(launched))}"
    assert not calls.calls, "a plain one-sample call or the float64 reference went through packfree's kernel route"
    errors_alone = assert_matches(packed, alone, f"{model_type}: packed vs each sample alone", tol=family.tol)
    errors_reference = assert_matches(packed, expected, f"{model_type}: packed vs float64", tol=family.tol)
    print(f"\n{model_type}: packed vs alone {errors_alone}, vs float64 {errors_reference}")


def _shift_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Every inner sample start one token later."""
    shifted = cu_seqlens.clone()
    shifted[1:-1] += 1
    return shifted


def _shift_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """Every sample start one token later (each row's first token keeps its sample)."""
    return torch.cat([seq_idx[:, :1], seq_idx[:, :-1]], dim=1).contiguous()


PLANTED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"cu_seqlens": _shift_cu_seqlens,
                                                              "seq_idx": _shift_seq_idx}
"""Kernel keyword -> its planted wrong value."""


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_planted_wrong_kernel_boundaries_fail(monkeypatch, model_type):
    """The comparison above fails when the kernel gets every sample start one token late (test_real_fla.py and
    test_real_ssd.py plant no boundaries at all too); the same batch with the right boundaries passes it."""
    family = FAMILIES[model_type]
    samples = samples_of(family.planted_lengths)
    model = kernel_model(model_type).eval()
    expected = reference(model_type, family.planted_lengths, False)
    with torch.no_grad():
        assert_matches(run_packed(model, samples, backward=False), expected, "right boundaries", tol=family.tol)

    module = importlib.import_module(family.kernel[0])
    real = getattr(module, family.kernel[1])
    handed = []

    def planted(*args: Any, **kwargs: Any) -> Any:
        kwargs[family.boundary] = PLANTED[family.boundary](kwargs[family.boundary])
        handed.append(kwargs[family.boundary])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, family.kernel[1], planted)
    backends.load_kernel.cache_clear()
    with torch.no_grad():
        wrong = run_packed(model, samples, backward=False)
    assert handed, "the packed run did not reach the kernel"
    with pytest.raises(AssertionError, match="logits off by") as failure:
        assert_matches(wrong, expected, f"{family.boundary} shifted", tol=family.tol)
    print(f"\n{model_type}: {failure.value.args[0].splitlines()[0]}")


def test_fla_s_own_mamba2_class_is_named_in_the_refusal(tmp_path):
    """Importing fla (as this mode does, and as transformers' Qwen3-Next modeling does where fla is installed)
    registers fla's own Mamba2ForCausalLM for ``mamba2`` with transformers' Auto classes. packfree cannot adapt
    fla's layers: the refusal says whose class it is and names transformers' class, which loads."""
    import fla  # noqa: F401
    from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

    packfree_plugin.register()
    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=8, head_dim=8, state_size=8,
                          n_groups=1, expand=2)  # transformers' (AutoConfig gives fla's config too)
    Mamba2ForCausalLM(config).save_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__module__.startswith("fla.")
    with pytest.raises(ValueError, match=r"fla's \(fla\.models.*transformers\.Mamba2ForCausalLM directly"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="packfree")
    assert type(Mamba2ForCausalLM.from_pretrained(tmp_path, attn_implementation="packfree")) is Mamba2ForCausalLM
