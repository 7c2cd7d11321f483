"""Liger-Kernel with packfree, its real Triton kernels run under Triton's interpreter on CPU tensors
(:mod:`tests.kernels.liger_interpreter` fills the interpreter's two gaps). For Llama, Qwen3, Qwen3-Next and Qwen3.5,
each of Liger's patch options alone and all together (rope, RMSNorm, SwiGLU, cross-entropy, fused linear
cross-entropy), applied as a user applies them (``apply_liger_kernel_to_<model>()`` before the model is built): a
packed row's loss and every gradient equal each sample run alone through the same patched model, float32, and the
kernels the option names did run. TRL's Liger path (``SFTConfig(use_liger_kernel=True)`` on a model loaded with
packfree) too. Collected where liger-kernel and triton are installed (``nox -s kernels``); docs/integrations.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")
if importlib.util.find_spec("liger_kernel") is None:
    pytest.skip("liger-kernel is not installed (nox -s kernels installs it)", allow_module_level=True)

from tests.kernels import liger_interpreter  # noqa: E402

liger_interpreter.install()
from liger_kernel.transformers import monkey_patch  # noqa: E402

LENGTHS = (5, 9, 3, 7)
OPTIONS = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")
TOGETHER = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")  # cross-entropy and its fused form exclude
KERNELS = {"rope": ("_triton_rope",), "rms_norm": ("_rms_norm_forward_kernel", "_block_rms_norm_forward_kernel"),
           "swiglu": ("_swiglu_forward_kernel", "_swiglu_forward_kernel_tiled", "_swiglu_fused_gate_up_forward_kernel",
                      "_fused_up_proj_swiglu_kernel"),  # Qwen3-Next: LigerExperts, fused with the MoE up-projection
           "cross_entropy": ("liger_cross_entropy_kernel",),
           "fused_linear_cross_entropy": ("liger_cross_entropy_kernel",)}
"""The forward kernels each option runs (any one of them)."""
MODELS = {"llama": ("llama", "apply_liger_kernel_to_llama"), "qwen3": ("qwen3", "apply_liger_kernel_to_qwen3"),
          "qwen3_next": ("qwen3_next", "apply_liger_kernel_to_qwen3_next"),
          "qwen3_5": ("qwen3_5_text", "apply_liger_kernel_to_qwen3_5")}
NO_ROPE = {"qwen3_5"}
"""Liger refuses its rope patch there (NotImplementedError: hybrid attention)."""
TOLERANCE = 2e-5
"""float32, relative to the largest: a packed row sums in another order than each sample alone."""


@pytest.fixture
def liger_restored() -> Iterator[None]:
    """Undo every patch Liger applies at module level (the modeling modules, the causal LMs' forwards, torch's
    ``cross_entropy``) after the test."""
    modules = [importlib.import_module(f"transformers.models.{name}.modeling_{name}")
               for name in ("llama", "qwen3", "qwen3_next", "qwen3_5")]
    saved = [(module, dict(vars(module))) for module in modules]
    classes = {cls: dict(vars(cls)) for module in modules for cls in vars(module).values()
               if isinstance(cls, type) and cls.__module__ == module.__name__}
    cross_entropy = torch.nn.functional.cross_entropy
    yield
    torch.nn.functional.cross_entropy = cross_entropy
    for module, names in saved:
        vars(module).update(names)
    for cls, names in classes.items():
        for name in set(vars(cls)) - set(names):
            delattr(cls, name)
        for name, value in names.items():
            if vars(cls).get(name) is not value and name not in ("__dict__", "__weakref__"):
                setattr(cls, name, value)


def build(model_type: str):
    """A float32 packfree causal LM of ``model_type`` (Qwen3-Next with experts: Liger's SwiGLU patches its experts)."""
    from transformers import AutoModelForCausalLM

    import packfree_plugin
    from packfree_plugin.cli.tiny import tiny_config
    from packfree_plugin.gate.catalogue import catalogue_config

    packfree_plugin.register()
    config = catalogue_config("qwen3_next") if model_type == "qwen3_next" else tiny_config(model_type)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.float32,
                                            experts_implementation="eager").train()


def samples(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=generator) for length in LENGTHS]


def packed_and_alone(model, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, dict, torch.Tensor, dict]:
    """(loss, gradients) of one packed row (``position_ids`` restarting, -100 at every sample's start) and of the
    samples alone, their token-mean losses combined over all targets."""
    row = torch.cat(pieces)[None]
    positions = torch.cat([torch.arange(len(p)) for p in pieces])[None]
    labels = row.clone()
    labels[positions == 0] = -100
    model.zero_grad()
    packed = model(input_ids=row, position_ids=positions, labels=labels).loss
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    targets = sum(len(p) - 1 for p in pieces)
    alone = sum(model(input_ids=p[None], labels=p[None]).loss * (len(p) - 1) for p in pieces) / targets
    alone.backward()
    return packed.detach(), packed_grads, alone.detach(), {n: p.grad for n, p in model.named_parameters()
                                                            if p.grad is not None}


def assert_equal(packed: torch.Tensor, packed_grads: dict, alone: torch.Tensor, alone_grads: dict) -> None:
    assert float(packed) == pytest.approx(float(alone), rel=TOLERANCE)
    assert packed_grads.keys() == alone_grads.keys()
    largest = max(float(g.abs().max()) for g in alone_grads.values())
    for name, gradient in packed_grads.items():
        assert float((gradient - alone_grads[name]).abs().max()) <= TOLERANCE * largest, name


CASES = [(model, (option,)) for model in MODELS for option in OPTIONS if not (option == "rope" and model in NO_ROPE)]
CASES += [(model, tuple(o for o in TOGETHER if not (o == "rope" and model in NO_ROPE))) for model in MODELS]


@pytest.mark.parametrize(("model", "options"), CASES, ids=[f"{m}-{'+'.join(o)}" for m, o in CASES])
def test_liger_packed_equals_each_sample_alone(model: str, options: tuple[str, ...], liger_restored) -> None:
    model_type, apply = MODELS[model]
    getattr(monkey_patch, apply)(**{option: option in options for option in OPTIONS})
    lm = build(model_type)
    liger_interpreter.launched.clear()
    result = packed_and_alone(lm, samples(lm.config.vocab_size))
    ran = set(liger_interpreter.launched)
    for option in options:
        assert ran & set(KERNELS[option]), f"{option}: none of {KERNELS[option]} ran (ran: {sorted(ran)})"
    assert_equal(*result)


def test_liger_swiglu_on_qwen3_next_leaves_its_dense_mlp_stock(liger_restored) -> None:
    """Applied before the model is built, Liger's Qwen3-Next SwiGLU patch replaces the experts only (transformers 5):
    a dense ``Qwen3NextMLP`` layer (``mlp_only_layers``) and the shared expert keep stock's MLP."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    monkey_patch.apply_liger_kernel_to_qwen3_next(rope=False, rms_norm=False, fused_linear_cross_entropy=False,
                                                  swiglu=True)
    assert modeling_qwen3_next.Qwen3NextMLP.__module__ == modeling_qwen3_next.__name__
    assert modeling_qwen3_next.Qwen3NextExperts.__module__.startswith("liger_kernel")


def test_trl_liger_path_on_a_packfree_model(liger_restored, tmp_path) -> None:
    """``SFTConfig(padding_free=True, use_liger_kernel=True)``: the Trainer patches the packfree model it is given
    with Liger's layer kernels when training starts (TRL 1.16 keeps its own fused LM head, not Liger's fused
    cross-entropy); after one step at learning rate 0, a collated padding-free batch's loss through TRL's own
    ``compute_loss`` and its gradients equal each sample alone."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from packfree_plugin.cli.tiny import tiny_tokenizer

    lm = build("llama")
    texts = ["Packed rows hold samples.", "Alone.", "Each one trains as if it ran alone.", "No padding."]
    args = trl.SFTConfig(output_dir=str(tmp_path), padding_free=True, use_liger_kernel=True, max_length=None,
                         per_device_train_batch_size=4, bf16=False, use_cpu=True, report_to="none", max_steps=1,
                         learning_rate=0.0, weight_decay=0.0, save_strategy="no")
    trainer = trl.SFTTrainer(model=lm, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tiny_tokenizer())
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == 1 and int((batch["position_ids"] == 0).sum()) == 4
    trainer.train()  # applies Liger (transformers' apply_liger_kernel) to the model
    model = trainer.model
    liger_interpreter.launched.clear()
    model.zero_grad()
    packed = trainer.compute_loss(model, dict(batch))
    packed.backward()
    assert {"_rms_norm_forward_kernel", "_triton_rope", "_swiglu_forward_kernel"} <= set(liger_interpreter.launched)
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pieces = [torch.tensor(trainer.train_dataset[i]["input_ids"]) for i in range(4)]
    model.zero_grad()
    targets = sum(len(p) - 1 for p in pieces)
    alone = sum(model(input_ids=p[None], labels=p[None]).loss * (len(p) - 1) for p in pieces) / targets
    alone.backward()
    assert_equal(packed.detach(), packed_grads, alone.detach(),
                 {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
