"""The generic tier (unpack, run, repack) and the mixer registry on three hybrid families."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

import packfree_plugin
from packfree_plugin.mixers.generic import length_buckets, run_unpacked
from packfree_plugin.boundaries import Boundaries
from tests.conftest import assert_close


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.sampled_from([0.0, 0.25, 1.0]))
def test_buckets_cover_every_sample_once_within_the_waste_bound(lengths: list[int], waste: float) -> None:
    buckets = length_buckets(lengths, max_waste=waste)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(lengths)))
    for bucket in buckets:
        longest = max(lengths[i] for i in bucket)
        assert lengths[bucket[0]] == longest
        assert len(bucket) * longest <= (1 + waste) * sum(lengths[i] for i in bucket) + 1e-9 or len(bucket) == 1


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_run_unpacked_applies_a_causal_function_per_sample(lengths: list[int]) -> None:
    hidden = torch.randn(1, sum(lengths), 3, dtype=torch.float64)
    boundaries = Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in lengths])[None])
    seen_shapes = []

    def running_sum(x: torch.Tensor) -> torch.Tensor:  # causal along the sequence
        seen_shapes.append(tuple(x.shape))
        return x.cumsum(dim=1)

    out = run_unpacked(running_sum, hidden, boundaries)
    expected = torch.cat([piece.cumsum(dim=1) for piece in hidden.split(lengths, dim=1)], dim=1)
    assert_close(out, expected)
    assert sum(n * length for n, length, _ in seen_shapes) <= 1.25 * sum(lengths) + max(lengths) * len(seen_shapes)


TINY_HYBRIDS = {
    "qwen3_next": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, vocab_size=128, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       layer_types=["linear_attention", "full_attention"]),
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                   vocab_size=128, chunk_size=8, expand=2),
    "lfm2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=128, layer_types=["conv", "full_attention"]),
}


@pytest.mark.parametrize("model_type", list(TINY_HYBRIDS))
def test_hybrid_packed_row_equals_each_sample_alone(model_type: str) -> None:
    packfree_plugin.register()
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY_HYBRIDS[model_type])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.float64,
                                             experts_implementation="eager").eval()
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY_HYBRIDS[model_type]),
                                             dtype=torch.float64, experts_implementation="eager").eval()
    stock.load_state_dict(model.state_dict())
    lengths = [5, 1, 9, 4]
    ids = torch.randint(3, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
        for piece, sample in zip(packed.split(lengths), ids.split(lengths, dim=1)):
            assert_close(piece, stock(input_ids=sample, use_cache=False).logits[0], atol=1e-5, rtol=0, what=model_type)


def test_unknown_sequence_mixer_is_refused_at_load() -> None:
    from packfree_plugin.mixers.entry import check_coverage

    class MysteryMixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4, padding=2)

    with pytest.raises(ValueError, match="MysteryMixer"):
        check_coverage(torch.nn.Sequential(MysteryMixer()))


def test_a_transformers_type_built_by_another_library_is_named_in_the_refusal() -> None:
    """Importing fla registers fla's own Mamba2ForCausalLM for ``mamba2`` with transformers' Auto classes (seen in
    the kernel test mode); packfree refuses its layers and says whose class it is and which one to load instead."""
    from packfree_plugin.mixers.entry import check_coverage

    class Mamba2(torch.nn.Module):  # fla's layer name
        def __init__(self) -> None:
            super().__init__()
            self.conv1d = torch.nn.Conv1d(4, 4, 3, groups=4, padding=2)

    class Mamba2ForCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mixer = Mamba2()

    Mamba2ForCausalLM.__module__ = "otherlib.models.mamba2.modeling_mamba2"
    with pytest.raises(ValueError, match=r"otherlib's .*Build the model with transformers\.Mamba2ForCausalLM directly"):
        check_coverage(Mamba2ForCausalLM())
    with pytest.raises(ValueError) as plain:
        check_coverage(torch.nn.Sequential(Mamba2()))
    assert "Build the model with" not in str(plain.value)
