"""The load-time gate: verified classes load at no cost; any other class is proved on a tiny copy, and
refused at load when that copy is not exact, unless the user opts out explicitly."""

from __future__ import annotations

import logging

import pytest
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import packfree_plugin
from packfree_plugin.gate import TRUST_ENV, admit, is_verified
from packfree_plugin.gate import admission as admit_module
from packfree_plugin.gate.shrink import tiny_config_for
from tests.gate.conftest import RowPoolingBert


pytestmark = pytest.mark.usefixtures("fresh_verdicts")


@pytest.fixture
def proofs(monkeypatch) -> list[str]:
    """Names of the classes proved on a tiny copy during the test."""
    seen: list[str] = []
    original = admit_module.prove_tiny_copy

    def counting(model):
        seen.append(type(model).__name__)
        return original(model)

    monkeypatch.setattr(admit_module, "prove_tiny_copy", counting)
    return seen


class RemoteLlama(LlamaForCausalLM):
    """Stands for a ``trust_remote_code`` class: same layers, defined outside transformers."""


class LeakyRemoteLlama(LlamaForCausalLM):
    """A remote-code class whose MLP mixes tokens along the sequence."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.forward = lambda x, mlp=layer.mlp: modeling_llama.LlamaMLP.forward(mlp, x) + 0.1 * x.cumsum(1)


@pytest.mark.usefixtures("newest_record")
def test_a_verified_class_loads_without_a_proof(proofs) -> None:
    model = AutoModelForCausalLM.from_config(tiny_config_for("llama"), attn_implementation="packfree")
    assert is_verified(model) and proofs == []


def test_a_verified_class_with_an_unproved_switch_is_proved(proofs) -> None:
    """The sweep proved Qwen2 without its sliding window (``use_sliding_window=False`` by default); a config
    that turns it on is proved at load like an unverified class."""
    config = tiny_config_for("qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree")
    assert not is_verified(model) and proofs == ["Qwen2ForCausalLM"]


def test_a_type_the_sweep_found_wrong_is_refused_at_load(roberta_without_positions) -> None:
    """Wrong without crossing samples (positions shifted by the packed ids): refused, naming type and module."""
    with pytest.raises(ValueError, match="packfree refuses") as refused:
        AutoModelForMaskedLM.from_config(tiny_config_for("roberta"), attn_implementation="packfree")
    for name in ("'roberta'", "position_embeddings", TRUST_ENV):
        assert name in str(refused.value)


def test_a_head_pooling_once_per_row_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="not one per sample"):
        RowPoolingBert._from_config(tiny_config_for("bert"), attn_implementation="packfree")


def test_an_unverified_exact_class_is_proved_once_and_loads(proofs) -> None:
    """A class outside transformers (remote code) is proved on a tiny copy of its config; once per config."""
    config = tiny_config_for("llama")
    model = RemoteLlama._from_config(config, attn_implementation="packfree")
    assert not is_verified(model) and proofs == ["RemoteLlama"]  # the backbone inside is not proved apart
    RemoteLlama._from_config(tiny_config_for("llama"), attn_implementation="packfree")
    assert proofs == ["RemoteLlama"]


def test_an_unverified_leaking_class_is_refused_naming_the_module() -> None:
    with pytest.raises(ValueError, match="LeakyRemoteLlama") as refused:
        LeakyRemoteLlama._from_config(tiny_config_for("llama"), attn_implementation="packfree")
    assert "mlp" in str(refused.value)


def test_the_opt_out_loads_a_refused_type_with_a_warning(monkeypatch, caplog, proofs,
                                                         roberta_without_positions) -> None:
    monkeypatch.setenv(TRUST_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="packfree"):
        model = AutoModelForMaskedLM.from_config(tiny_config_for("roberta"), attn_implementation="packfree")
    assert proofs == [] and "RobertaForMaskedLM" in caplog.text and TRUST_ENV in caplog.text
    monkeypatch.delenv(TRUST_ENV)
    with caplog.at_level(logging.WARNING, logger="packfree"):
        admit(model, trust_unverified=True)
    with pytest.raises(ValueError):
        admit(model)


def test_apply_on_a_model_loaded_with_sdpa_goes_through_the_gate(roberta_without_positions) -> None:
    stock = AutoModelForMaskedLM.from_config(tiny_config_for("roberta"), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="packfree refuses"):
        packfree_plugin.apply(stock)


class WideOnlyLlama(LlamaForCausalLM):
    """A remote-code class that builds only at its own width or a power-of-two cut of it (384 / 4 = 96): no tiny
    copy (hidden 64) can be built, a copy cut in depth and width can."""

    def __init__(self, config) -> None:
        if config.hidden_size % 3:
            raise ValueError(f"hidden_size must be a multiple of 3, not {config.hidden_size}")
        super().__init__(config)


def test_a_config_without_a_tiny_copy_is_proved_on_a_cut_copy_of_its_own(proofs) -> None:
    """The gate proves on the user's config cut in depth and width when no tiny copy builds: the exact class
    loads, and a leaking one is refused naming its layer, never because a copy could not be built."""
    from packfree_plugin.gate.admission import prove_tiny_copy

    config = LlamaConfig(hidden_size=384, intermediate_size=768, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=1000)
    model = WideOnlyLlama._from_config(config, attn_implementation="packfree")
    assert proofs == ["WideOnlyLlama"]
    proof = prove_tiny_copy(model)
    assert proof.exact and proof.copy == "a copy cut in depth and in width by 4", proof.copy

    class LeakyWideOnlyLlama(WideOnlyLlama, LeakyRemoteLlama):
        pass

    with pytest.raises(ValueError, match="packfree refuses LeakyWideOnlyLlama") as refused:
        LeakyWideOnlyLlama._from_config(config, attn_implementation="packfree")
    assert "mlp" in str(refused.value) and "cut in depth" in str(refused.value)


def test_a_config_stock_runs_no_copy_of_is_refused_saying_so(monkeypatch) -> None:
    """Stock builds neither a copy nor the config itself: the refusal names stock's error, not packfree."""
    from packfree_plugin.gate import proof

    def broken(cls, config):
        raise RuntimeError("stock cannot build it")

    config = tiny_config_for("llama")
    monkeypatch.setattr(proof, "build_stock", broken)
    with pytest.raises(ValueError, match="stock transformers cannot build or run this config itself .*stock cannot "
                                         "build it, as on its tiny copy"):
        RemoteLlama._from_config(config, attn_implementation="packfree")


def test_a_config_whose_every_copy_is_over_the_size_limit_is_refused_and_never_built() -> None:
    """An intermediate size no power of two divides leaves one copy to prove on, the config cut in depth only: two
    layers of 28.7M parameters, over the proof's limit. It is weighed on the meta device and refused, saying why,
    before it is ever built (mutant: the size check never ran, and the 57M-parameter copy was built and proved)."""
    config = LlamaConfig(hidden_size=384, intermediate_size=24579, num_hidden_layers=3, num_attention_heads=6,
                         num_key_value_heads=2, vocab_size=1000)
    with pytest.raises(ValueError, match=r"a copy cut in depth and in width by 1: ValueError: 57,516,672 parameters, "
                                         r"over the proof's 20,000,000"):
        WideOnlyLlama._from_config(config, attn_implementation="packfree")


def _failing_at(monkeypatch: pytest.MonkeyPatch, step: str, copies: int | None = None) -> None:
    """Make the proof's ``step`` (``build_pair``: building the packfree copy; ``alone_outputs``: stock running its
    samples) raise a ``RuntimeError`` for the first ``copies`` copies (None: every copy)."""
    from packfree_plugin.gate import proof

    original, calls = getattr(proof, step), []

    def failing(*args, **kwargs):
        calls.append(1)
        if copies is None or len(calls) <= copies:
            raise RuntimeError(f"{step} failed on copy {len(calls)}")
        return original(*args, **kwargs)

    monkeypatch.setattr(proof, step, failing)


@pytest.mark.parametrize("step", ["build_pair", "alone_outputs"])
def test_copies_that_fail_on_stock_are_each_named_with_their_error(monkeypatch, step: str) -> None:
    """No copy runs (packfree's copy cannot be built, or stock cannot run the samples) while stock runs the config
    itself: the refusal names every copy tried with its own error (mutants: the error or the copy's description
    left out of the list)."""
    _failing_at(monkeypatch, step)
    with pytest.raises(ValueError, match=rf"packfree's limitation, not the model's \(a tiny copy: RuntimeError: "
                                         rf"{step} failed on copy 1; a tiny copy with each layer kind twice: "
                                         rf"RuntimeError: {step} failed on copy 2"):
        RemoteLlama._from_config(tiny_config_for("llama"), attn_implementation="packfree")


def test_a_copy_stock_cannot_run_gives_way_to_the_next(monkeypatch, proofs) -> None:
    """Stock fails on the tiny copy's samples only: the proof goes on to the next copy, which is exact, and the
    class loads (mutant: the first failure ended the search, and the class was refused)."""
    _failing_at(monkeypatch, "alone_outputs", copies=1)
    RemoteLlama._from_config(tiny_config_for("llama"), attn_implementation="packfree")
    assert proofs == ["RemoteLlama"]
