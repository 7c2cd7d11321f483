"""An attention layer that forwards none of its ``**kwargs`` and attends with a causal mask it builds itself (the way
remote code often does), inside a model packfree prepared: a packed row through it is refused, never attended across
samples with that mask; an unpacked batch and ``generate()`` still equal stock.

Every transformers class passes its kwargs and transformers' mask to attention, so only such a layer reaches that
refusal in :func:`packfree_plugin.attention.interface.packfree_attention_forward`, and proves that the decode shortcut
before it keeps to decode steps (a shortcut taken while a packed forward runs would attend across samples with the
layer's mask, silently)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from packfree_plugin.forward.context import in_prepared_forward
from packfree_plugin.gate.audit import packed_row
from tests.conftest import assert_close, tiny_config
from tests.helpers import samples_of

REFUSAL = "attends with a mask of its own"


class OwnMaskAttention(modeling_llama.LlamaAttention):
    """Llama's attention as remote code writes it: ``attention_mask`` and ``**kwargs`` are ignored, the layer builds
    its own causal mask and hands it to the attention function of the config's implementation."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                **kwargs: object) -> tuple[torch.Tensor, None]:
        """``hidden_states [B, T, D]`` -> ``([B, T, D], None)``; keys ``[B, Hkv, S, Dh]`` with the cache's tokens."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        queries, keys = query.shape[2], key.shape[2]
        own_mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)[None, None]
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention(self, query, key, value, own_mask, scaling=self.scaling, dropout=0.0)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class RemoteLlamaForCausalLM(LlamaForCausalLM):
    """A model class of its own (as ``trust_remote_code`` loads one): the load-time gate proves it on a tiny copy."""


@pytest.fixture
def own_mask_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama decoder layers built during the test get :class:`OwnMaskAttention`."""
    monkeypatch.setattr(modeling_llama, "LlamaAttention", OwnMaskAttention)


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree, stock sdpa)`` tiny Llamas (float64, same weights) whose attention is :class:`OwnMaskAttention`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree", dtype=torch.float64)
    stock = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float64)
    stock.load_state_dict(model.state_dict())
    assert all(isinstance(layer.self_attn, OwnMaskAttention) for layer in model.model.layers)
    return model.eval(), stock.eval()


def test_a_packed_row_through_a_layer_with_its_own_mask_is_refused(own_mask_layers: None) -> None:
    """The packed row gets the refusal (the layer's causal mask would let every sample attend to the ones before it),
    with labels (training) and without, and the refusal leaves no forward in progress behind."""
    model, _ = _pair()
    batch = packed_row([torch.tensor(s) for s in samples_of([5, 3, 6])])
    labels = batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100)
    with torch.no_grad(), pytest.raises(ValueError, match=REFUSAL):
        model(**batch)
    with pytest.raises(ValueError, match=REFUSAL):
        model.train()(**batch, labels=labels)
    assert not in_prepared_forward()


def test_an_unpacked_batch_and_generate_through_that_layer_equal_stock(own_mask_layers: None) -> None:
    """One sample per row (no packing signal): the layer's own mask is the whole story, as in stock; ``generate()``'s
    prefill and decode steps give stock's tokens and per-step logits."""
    model, stock = _pair()
    rows = torch.tensor(samples_of([7, 7], seed=4))
    with torch.no_grad():
        assert_close(model(input_ids=rows).logits, stock(input_ids=rows).logits, atol=1e-10, rtol=0,
                     what="unpacked rows")
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    mine, theirs = model.generate(input_ids=rows, **options), stock.generate(input_ids=rows, **options)
    assert torch.equal(mine.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(mine.logits, theirs.logits, strict=True)):
        assert_close(a, b, atol=1e-10, rtol=0, what=f"generate step {step}")


def test_a_remote_class_with_that_layer_is_refused_at_load_saying_why(own_mask_layers: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A class the sweep never proved gets the gate's proof on a tiny copy at load, which meets the same refusal on
    its packed row and names it."""
    from packfree_plugin.gate import admission

    monkeypatch.setattr(admission, "_verdicts", {})  # the gate's verdict on this test's class is not kept
    with pytest.raises(ValueError, match=rf"RemoteLlamaForCausalLM.*{REFUSAL}"):
        RemoteLlamaForCausalLM._from_config(tiny_config("llama"), attn_implementation="packfree")
