"""Generation with a cache holding stateless placeholder layers (transformers' ``DummyLayer``: the MLP / MoE-only
layers of hybrids such as NemotronH). packfree reads the cache to tell a fresh packed batch from a decoding step;
a placeholder layer has no ``get_seq_length`` and made every packfree NemotronH generate raise AttributeError
(found by TRL's own GRPO test). Reference: stock sdpa, same weights, greedy."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from packfree_plugin.cli.tiny import tiny_config


def test_nemotron_h_left_padded_generate_matches_stock() -> None:
    import packfree_plugin

    packfree_plugin.register()
    models = {}
    for implementation in ("packfree", "sdpa"):
        torch.manual_seed(0)
        models[implementation] = AutoModelForCausalLM.from_config(tiny_config("nemotron_h"),
                                                                  attn_implementation=implementation).eval()
    assert "mlp" in models["sdpa"].config.layers_block_type or "moe" in models["sdpa"].config.layers_block_type
    input_ids = torch.tensor([[0, 0, 0, 5, 6, 7], [4, 9, 11, 5, 6, 8]])
    attention_mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    generated = {name: model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5,
                                      do_sample=False, pad_token_id=0) for name, model in models.items()}
    assert torch.equal(generated["packfree"], generated["sdpa"])
