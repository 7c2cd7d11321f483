"""The gate's own guards, with nothing stubbed: an unverified transformers class is proved on a copy of the
user's config, a NaN in the packed output is never exact, and unpacked decoding with a cache packfree does not
know runs as stock does."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import packfree_plugin
from packfree_plugin.gate import TRUST_ENV, is_verified
from packfree_plugin.gate import admission as admit_module
from packfree_plugin.gate.shrink import tiny_config_for


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch):
    packfree_plugin.register()
    monkeypatch.setattr(admit_module, "_verdicts", {})
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.mark.usefixtures("newest_record")
def test_an_unverified_transformers_class_is_proved_on_the_users_own_config(monkeypatch) -> None:
    """Llama is verified with ``mlp_bias=False``; with ``mlp_bias=True`` it is not, and a leak planted in the MLP
    fires only with that bias. The gate must prove the class (not wave it through) and prove it on a copy of the
    user's config (a copy of the type's defaults has no bias and would not leak): refused."""
    original = modeling_llama.LlamaMLP.forward

    def leaking_with_bias(self, x):
        out = original(self, x)
        return out + 0.1 * x.cumsum(1) if self.up_proj.bias is not None else out

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", leaking_with_bias)
    assert is_verified(LlamaForCausalLM._from_config(tiny_config_for("llama"), attn_implementation="packfree"))
    config = tiny_config_for("llama")
    config.mlp_bias = True
    with pytest.raises(ValueError, match="packfree refuses LlamaForCausalLM") as refused:
        LlamaForCausalLM._from_config(config, attn_implementation="packfree")
    assert "mlp" in str(refused.value)


class NaNOnLongRowsLlama(LlamaForCausalLM):
    """A remote-code class whose MLP puts NaN on rows longer than 9 tokens: every sample alone (at most 9 tokens)
    is finite, the packed row (20 tokens) is NaN."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.forward = lambda x, mlp=layer.mlp: (modeling_llama.LlamaMLP.forward(mlp, x)
                                                         + (float("nan") if x.shape[1] > 9 else 0.0))


def test_a_nan_in_the_packed_output_is_refused() -> None:
    with pytest.raises(ValueError, match="packfree refuses NaNOnLongRowsLlama"):
        NaNOnLongRowsLlama._from_config(tiny_config_for("llama"), attn_implementation="packfree")


class OwnCache:
    """A model's own cache class, which packfree does not know: wraps transformers' cache, no ``get_seq_length``."""

    def __init__(self) -> None:
        self.inner = DynamicCache()


_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
"""What transformers' forward calls its cache (``cache`` in 5.24, ``past_key_values`` before)."""


class OwnCacheLlama(LlamaForCausalLM):
    """A remote-code class that takes its own cache object as ``cache``."""

    def forward(self, input_ids=None, attention_mask=None, cache: OwnCache | None = None, **kwargs):
        kwargs.pop("use_cache", None)
        inner = {_CACHE_ARGUMENT: None if cache is None else cache.inner}
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=cache is not None,
                               **inner, **kwargs)



def test_unpacked_decoding_with_an_unknown_cache_class_equals_stock() -> None:
    """A prefill of 5 tokens per row, then one decoding step (``input_ids [2, 1]``, ``attention_mask [2, 6]``) with
    the model's own cache: packfree must read an unknown cache as one that may hold tokens (a decoding step, not a
    batch whose mask disagrees with its tokens), and give stock's logits."""
    config = tiny_config_for("llama")
    torch.manual_seed(0)
    model = OwnCacheLlama._from_config(config, attn_implementation="packfree").eval()
    stock = OwnCacheLlama._from_config(tiny_config_for("llama"), attn_implementation="sdpa").eval()
    stock.load_state_dict(model.state_dict())
    prompt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    step = torch.tensor([[7], [11]])
    logits = []
    for each in (model, stock):
        cache = OwnCache()
        with torch.no_grad():
            each(input_ids=prompt, attention_mask=torch.ones(2, 5, dtype=torch.long), cache=cache)
            logits.append(each(input_ids=step, attention_mask=torch.ones(2, 6, dtype=torch.long), cache=cache).logits)
    assert logits[0].shape == (2, 1, config.vocab_size)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
