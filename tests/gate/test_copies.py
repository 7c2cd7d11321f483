"""The gate fails only for a model's own reason: it proves on a copy of the user's config that stock can build
and run (published configs, transformers' own tiny test configs), and those models load and are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from packfree_plugin.gate import is_verified
from packfree_plugin.gate import admission as admit_module
from packfree_plugin.gate.shrink import shrink_config

PUBLISHED = Path(__file__).with_name("published")
"""config.json of published checkpoints (test data: read here, never fetched)."""


pytestmark = pytest.mark.usefixtures("fresh_verdicts")


@pytest.fixture
def proofs(monkeypatch) -> list[str]:
    """Which copy each proof at load ran on, during the test."""
    seen: list[str] = []
    original = admit_module.prove_tiny_copy

    def recording(model):
        proof = original(model)
        seen.append(proof.copy)
        return proof

    monkeypatch.setattr(admit_module, "prove_tiny_copy", recording)
    return seen


def _published(name: str):
    values = json.loads((PUBLISHED / f"{name}.json").read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)


@pytest.mark.parametrize(("name", "hidden_size"), [("Zamba-7B-v1", 3712), ("Zamba2-1.2B", 2048)])
def test_a_published_config_loads_with_packfree_on_meta(name: str, hidden_size: int, proofs) -> None:
    """As a user loads it: ``from_config`` on the meta device. Their switches (``use_mamba_kernels``) are not the
    ones the sweep proved, so the gate proves on a copy of the config; that copy must build (Zamba ties each
    shared block to the first, so it needs two hybrid layers; Zamba2 derives its attention width from the hidden
    size) and be exact."""
    config = _published(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree")
    assert not is_verified(model) and len(proofs) == 1, proofs
    assert model.config.hidden_size == hidden_size and model.config.model_type == config.model_type
    assert config.hidden_size == hidden_size  # the user's config is left as it was


@pytest.mark.parametrize("name", sorted(path.stem for path in PUBLISHED.glob("*.json")))
def test_every_published_config_loads_with_packfree_on_meta_and_its_copy_is_exact(name: str) -> None:
    """Every published config of ``tests/gate/published`` loads as a user loads it (``from_config`` on the meta
    device, verified or proved at load), and the gate's proof on a copy of it, run whether or not the class is
    verified, builds on stock and is exact."""
    from packfree_plugin.gate.admission import prove_copy

    config = _published(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree")
    assert model.config.model_type == config.model_type
    proof = prove_copy(type(model), config)
    assert proof.exact, proof.summary()


_TESTER = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=37, vocab_size=99)
TESTER_CONFIGS = {
    # as transformers' own test suites size them: 2 heads and 2 key/value heads, hidden 32
    "zamba": ("ZambaForCausalLM", lambda: transformers.ZambaConfig(
        **_TESTER, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        attention_hidden_size=64, attention_head_dim=32, n_mamba_heads=2, mamba_dt_rank=8, mamba_d_state=8)),
    "zamba2": ("Zamba2ForCausalLM", lambda: transformers.Zamba2Config(
        **_TESTER, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4,
        mamba_d_state=8, chunk_size=4)),
    "gemma4_text": ("Gemma4ForCausalLM", lambda: transformers.Gemma4TextConfig(
        **_TESTER, num_hidden_layers=2, head_dim=16, global_head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0)),
    "llava_next": ("LlavaNextForConditionalGeneration", lambda: transformers.LlavaNextConfig(
        text_config=dict(model_type="llama", num_hidden_layers=2, **_TESTER),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, num_attention_heads=2,
                           intermediate_size=37, num_hidden_layers=2, image_size=32, patch_size=4, projection_dim=32),
        image_token_index=98, image_grid_pinpoints=[[32, 32]])),
}


@pytest.mark.parametrize("model_type", sorted(TESTER_CONFIGS))
def test_a_tester_config_with_two_heads_is_admitted_and_exact(model_type: str) -> None:
    """A ModelTester-style config (2 query heads, 2 key/value heads): the gate's copy keeps the key/value heads at
    most the query heads (it gave 4 for 2, which stock cannot run), the model loads, and a packed row equals each
    sample run alone on stock sdpa with the same weights."""
    class_name, make_config = TESTER_CONFIGS[model_type]
    cls = getattr(transformers, class_name)
    tiny = shrink_config(make_config()).get_text_config()
    assert tiny.num_key_value_heads <= tiny.num_attention_heads
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    torch.manual_seed(0)
    model = cls._from_config(make_config(), attn_implementation="packfree", dtype=torch.float32).eval()
    stock = cls._from_config(make_config(), attn_implementation="sdpa", dtype=torch.float32).eval()
    stock.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 90, (n,), generator=generator) for n in (7, 10, 5)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s.tolist()} for s in samples])
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits[0].double()
        alone = torch.cat([stock(input_ids=s[None]).logits[0] for s in samples]).double()
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (2, 1), (4, 2), (32, 8), (6, 3), (48, 48), (12, 4)])
def test_the_tiny_copy_keeps_kv_heads_at_most_the_heads_and_dividing_them(heads: int, kv_heads: int) -> None:
    user = LlamaConfig(hidden_size=heads * 32, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=heads * 64, num_hidden_layers=2)
    tiny = shrink_config(user)
    assert tiny.num_key_value_heads <= tiny.num_attention_heads
    assert tiny.num_attention_heads % tiny.num_key_value_heads == 0
    assert (tiny.num_key_value_heads == tiny.num_attention_heads) == (kv_heads == heads)


def test_a_width_that_is_a_multiple_of_the_hidden_size_stays_that_multiple() -> None:
    """Zamba's attention takes the hidden states and the embeddings side by side (twice the hidden size)."""
    tiny = shrink_config(_published("Zamba-7B-v1"))
    assert tiny.attention_hidden_size == 2 * tiny.hidden_size
    tiny2 = shrink_config(_published("Zamba2-1.2B"))  # derived by its config class: derived again from the tiny size
    assert tiny2.attention_hidden_size == 2 * tiny2.hidden_size
    assert tiny2.attention_head_dim * tiny2.num_attention_heads == tiny2.attention_hidden_size
    assert tiny2.hybrid_layer_ids == [i for i, kind in enumerate(tiny2.layers_block_type) if kind == "hybrid"]


def test_the_sweep_checks_the_gate_on_a_types_defaults_and_its_tester_config() -> None:
    """The sweep's own check: the gate, as for a class it has not verified, admits Llama's default config and a
    ModelTester-style one (2 heads, 2 key/value heads: the copy that had 4 key/value heads ran on no stock)."""
    from tooling.sweep.render import render_gate_checks
    from tooling.sweep.run import Result, Target, tester_config, user_config_checks

    tester = tester_config(LlamaConfig())
    assert (tester.hidden_size, tester.num_attention_heads, tester.num_key_value_heads) == (32, 2, 2)
    result = Result("causal", "llama", "LlamaForCausalLM", "wrong")  # not the tiny config's proof: both proved
    user_config_checks(Target("causal", "llama", "LlamaForCausalLM"), result)
    assert (result.default_config, result.tester_config) == ("exact", "exact")
    assert "| causal | tester | 1 | 0 | 0 | 0 |" in render_gate_checks("5.24.0", [result])



def test_the_proof_draws_no_media_placeholders() -> None:
    """transformers' own VLM test configs put the image/video placeholders among the low ids the proof draws from;
    a text-only proof that drew them was refused at load (2-D ids beside image tokens), a model stock runs."""
    from transformers import Qwen3VLConfig

    from packfree_plugin.gate.proof import placeholder_tokens, sample_tokens

    config = Qwen3VLConfig()
    for target in (config, config.get_text_config()):
        target.image_token_id, target.video_token_id = 5, 6
    avoid = placeholder_tokens(config)
    assert {5, 6} <= avoid
    samples = sample_tokens((40, 40, 40), 128, avoid=avoid)
    assert not any(bool(torch.isin(sample, torch.tensor(sorted(avoid))).any()) for sample in samples)
