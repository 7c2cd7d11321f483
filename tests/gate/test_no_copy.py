"""When the gate finds no copy to prove on, the reason it gives is measured, and it is the model's or stock's:
a layer packfree refuses at load is the verdict even where stock cannot run the proof's row of tokens; an error
stock raises on the user's config itself (built on the meta device) is named as stock's; only a config stock
runs but whose copies it does not is called packfree's limitation."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from packfree_plugin.gate.admission import NoCopyError, prove_copy
from packfree_plugin.gate.catalogue import published_values
from packfree_plugin.gate.copies import cut_config
from packfree_plugin.gate.shrink import shrink_config
from tooling.sweep.render import GATE_CHECKS_FILE
from tooling.sweep.run import Target, _gate_on, run_target

pytestmark = pytest.mark.usefixtures("fresh_verdicts")


@pytest.mark.parametrize(("class_name", "model_type", "layer"), [("WhisperModel", "whisper", "WhisperEncoder"),
                                                                 ("PerceiverModel", "perceiver", "PerceiverEncoder")])
def test_a_layer_refused_at_load_is_the_verdict_though_stock_cannot_run_a_row_of_tokens(
        class_name: str, model_type: str, layer: str) -> None:
    """Whisper's encoder wants audio features, Perceiver's model ``inputs``: stock runs neither on ``input_ids``,
    so the gate found "no copy"; but packfree refuses their layers at load whatever the row, and that is the
    verdict (the sweep's too: refused, not "not buildable")."""
    cls = getattr(transformers, class_name)
    with pytest.raises(ValueError, match=f"packfree cannot run these layers exactly on packed rows: {layer}"):
        prove_copy(cls, AutoConfig.for_model(model_type))
    assert _gate_on(cls, lambda: AutoConfig.for_model(model_type)).startswith(f"refused: ValueError: packfree "
                                                                              f"cannot run these layers")
    result = run_target(Target("masked" if model_type == "perceiver" else "causal", model_type, class_name),
                        user_configs=False)
    assert (result.status, result.gate_refuses) == ("refused", True), result.detail


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_gemma4s_assistant_is_refused_at_load_for_attending_to_its_target_models_keys(model_type: str) -> None:
    """The assistant runs on another model's hidden states and keys/values (stock raises on a row of tokens): packfree
    refuses it at load, saying so, instead of failing to run a copy."""
    config = shrink_config(AutoConfig.for_model(model_type, **published_values(model_type)))
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    stock = cls._from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="shared_kv_states cannot be None"):
        stock(input_ids=torch.tensor([[3, 4, 5]]))
    with pytest.raises(ValueError, match=f"exactly on packed rows: {cls.__name__} .*speculative-decoding assistant"):
        cls._from_config(config, attn_implementation="packfree")


class NoForwardLlama(LlamaForCausalLM):
    """A remote-code class stock cannot run at any size: its forward always raises."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this class has no forward of its own")


class WideVocabularyLlama(LlamaForCausalLM):
    """A remote-code class that runs only with its own vocabulary (every copy the gate makes has 128 tokens)."""

    def forward(self, *args, **kwargs):
        if self.config.vocab_size < 1000:
            raise RuntimeError(f"a vocabulary of {self.config.vocab_size} is too small")
        return super().forward(*args, **kwargs)


def _user_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=2000)


def test_an_error_stock_raises_on_the_config_itself_is_named_as_stocks() -> None:
    """Stock raises on every copy, and on the user's config itself (built on the meta device): the refusal says
    stock cannot run the config, and the sweep counts it under "config", not "no copy"."""
    with pytest.raises(NoCopyError) as no_copy:
        prove_copy(NoForwardLlama, _user_config())
    assert no_copy.value.stock_error == "RuntimeError: this class has no forward of its own"
    with pytest.raises(ValueError, match=r"stock transformers cannot build or run this config itself on a row of "
                                         r"token ids \(RuntimeError: this class has no forward of its own"):
        NoForwardLlama._from_config(_user_config(), attn_implementation="packfree")
    assert _gate_on(NoForwardLlama, _user_config).startswith("config: stock raises it on the config itself")


def test_a_config_stock_runs_but_none_of_whose_copies_it_runs_is_packfrees_limitation() -> None:
    """Stock runs the user's config but no copy of it: that is packfree's failure, and the refusal says so."""
    with pytest.raises(NoCopyError) as no_copy:
        prove_copy(WideVocabularyLlama, _user_config())
    assert no_copy.value.stock_error is None
    assert all("a vocabulary of 128 is too small" in failure for failure in no_copy.value.failures)
    with pytest.raises(ValueError, match="found no copy of this config that stock transformers runs .*packfree's "
                                         "limitation, not the model's"):
        WideVocabularyLlama._from_config(_user_config(), attn_implementation="packfree")
    assert _gate_on(WideVocabularyLlama, _user_config).startswith("no copy: ")


def test_published_types_stock_cannot_build_or_run_by_default_are_the_configs_reason() -> None:
    """LFM2-MoE's default config has no ``layer_types`` (stock cannot build it); Llama-4's multimodal class raises
    on every forward in transformers 5.24 (its output has no ``image_outputs``): measured on the config itself.
    Where stock's tiny Llama-4 runs (5.20), the gate proves it exact instead."""
    lfm2 = _gate_on(transformers.Lfm2MoeModel, lambda: AutoConfig.for_model("lfm2_moe"))
    assert lfm2 == ("config: stock raises it on the config itself, as on its tiny copy: TypeError: 'NoneType' object "
                    "is not subscriptable")
    llama4 = _gate_on(transformers.Llama4ForConditionalGeneration, lambda: AutoConfig.for_model("llama4"))
    stock = transformers.Llama4ForConditionalGeneration._from_config(shrink_config(AutoConfig.for_model("llama4")),
                                                                     attn_implementation="sdpa").eval()
    try:
        with torch.no_grad():
            stock(input_ids=torch.tensor([[3, 4, 5, 6]]))
    except AttributeError as error:
        assert "image_outputs" in str(error)
        assert llama4.startswith("config: stock raises it on the config itself") and "image_outputs" in llama4
    else:
        assert llama4 == "exact"


def test_an_xmod_config_without_a_default_language_is_proved_on_a_copy_that_has_one() -> None:
    """X-MOD with no default language needs ``lang_ids`` on every call; the copies take its first language, so the
    proof's rows of tokens run (the user's config is left as it was)."""
    config = AutoConfig.for_model("xmod")
    assert config.default_language is None
    assert shrink_config(config).default_language == cut_config(config, 1).default_language == config.languages[0]
    assert prove_copy(transformers.XmodModel, config).exact
    assert config.default_language is None


def test_the_recorded_gate_checks_have_no_no_copy_row() -> None:
    """``docs/gate-checks.md`` (the sweep's gate on every class's defaults and ModelTester-style config): no class is
    left unproved for want of a copy, in the counts or in the rows."""
    text = GATE_CHECKS_FILE.read_text()
    counts = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| \w+ \| (default|tester) \|", line)]
    assert counts and all(int(row[4]) == 0 for row in counts), [row for row in counts if int(row[4])]
    assert [line for line in text.splitlines() if "| no copy:" in line] == []
