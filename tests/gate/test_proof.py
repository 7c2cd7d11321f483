"""The isolation proof: packed samples against each sample alone on stock; it must catch what is wrong,
whether or not the error crosses samples."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening

from packfree_plugin.gate import bypassed
from packfree_plugin.gate.proof import MODES, build_pair, main_output, packed_batch, prove, sample_tokens
from packfree_plugin.gate.shrink import tiny_config_for
from packfree_plugin.forward.context import boundaries_here
from packfree_plugin.gate.audit import audit
from tests.gate.conftest import RowPoolingBert


def _pair(cls_name: str, model_type: str):
    with bypassed():
        return build_pair(getattr(transformers, cls_name), tiny_config_for(model_type))


def test_collator_mode_sends_what_the_flattening_collator_sends() -> None:
    samples = sample_tokens((3, 2), 128)
    batch = packed_batch(samples, "collator")
    expected = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s.tolist()} for s in samples])
    assert set(batch) == set(expected) - {"labels"}
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and batch["cu_seq_lens_q"].tolist() == [0, 3, 5]
    assert set(packed_batch(samples, "position_ids")) == {"input_ids", "position_ids"}


def test_an_exact_model_is_proved_exact_and_matches_a_hand_comparison() -> None:
    """Llama: the proof says exact, and so does comparing its packed logits with each sample alone by hand."""
    model, stock, implementation = _pair("LlamaForCausalLM", "llama")
    proof = prove(model, stock, stock_name=implementation)
    assert proof.exact and proof.kind == "exact" and proof.max_diff < 1e-4
    samples = sample_tokens((6, 9, 5), 128, seed=3)
    with torch.no_grad():
        packed = model(**packed_batch(samples, "collator")).logits[0]
        alone = torch.cat([stock(input_ids=s[None]).logits[0] for s in samples])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)


def test_wrong_positions_are_caught_although_no_sample_leaks(roberta_without_positions) -> None:
    """RoBERTa numbers positions from padding_idx + 1: packed 0-based position_ids shift them. The perturbation
    audit sees no leak (nothing crosses samples); the alone comparison fails and names the position embedding."""
    model, stock, implementation = _pair("RobertaForMaskedLM", "roberta")
    assert not audit(model, lengths=[6, 9, 5]).leaks
    proof = prove(model, stock, stock_name=implementation)
    assert proof.kind == "wrong" and proof.max_diff > 1e-2
    assert "position_embeddings" in proof.wrong_modules[0]


def test_a_leaking_model_is_caught_and_the_leaking_module_named(monkeypatch) -> None:
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: original(self, x) + 0.1 * x.cumsum(1))
    model, stock, implementation = _pair("LlamaForCausalLM", "llama")
    proof = prove(model, stock, stock_name=implementation)
    assert proof.kind == "wrong"
    assert any(".mlp " in name for name in proof.leaking_modules), proof.leaking_modules


def test_one_pooled_output_per_row_is_wrong() -> None:
    """A head that pools once per row: a packed row must give one output per sample."""
    with bypassed():
        model, stock, implementation = build_pair(RowPoolingBert, tiny_config_for("bert"))
    proof = prove(model, stock, stock_name=implementation)
    assert proof.kind == "wrong" and "not one per sample" in proof.reason


def test_an_exception_on_the_packed_row_is_the_verdict(monkeypatch) -> None:
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward

    def planted(self, x):
        boundaries = boundaries_here()
        if boundaries is not None and boundaries.is_packed:
            raise RuntimeError("planted failure on a packed row")
        return original(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", planted)
    model, stock, implementation = _pair("LlamaForCausalLM", "llama")
    proof = prove(model, stock, stock_name=implementation)
    assert proof.kind == "error" and proof.mode == MODES[0] and "planted failure" in proof.error


def test_main_output_prefers_logits_then_hidden_states() -> None:
    out = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(1, 2, 3))
    assert main_output(out).shape == (1, 2, 3)
    with pytest.raises(TypeError):
        main_output((None,))
