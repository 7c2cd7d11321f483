"""DeepSpeed Ulysses with packfree as its core attention: one packed row split over 2 and 4 CPU ranks (gloo) gives
the loss and every parameter's gradient (summed over the ranks) of the stock model run on each sample alone, in
float64 (tests/parallel/cases.py). The default suite runs :data:`DEFAULT` (two spawns: 2 ranks and 4 ranks);
``nox -s distributed`` runs :data:`FULL` too (PACKFREE_SP_FULL=1, tests/parallel/conftest.py).

Rows (the shard edges are every T/P tokens):
- ODD, 5 + 9 + 3 = 17 tokens: padded to 18 (a padding sample at the end, which a bidirectional model must not see);
  the 9-token sample crosses the edge at 9;
- EDGES2, 8 + 1 + 1 + 7 = 17 (padded to 18): one-token samples on both sides of the edge at 9;
- EVEN, 6 + 10 = 16: rank 1's shard holds the middle and end of the 10-token sample only (it alone looks unpacked);
- ONE, a single 16-token sample over both ranks: every shard looks unpacked;
- EDGES4, 4 + 1 + 4 + 1 + 1 + 8 + 1 = 20 over 4 ranks: one-token samples at the edges 5, 10 and 20;
- SPAN4, 2 + 17 + 1 = 20 over 4 ranks: the 17-token sample spans every rank.

Planted bugs (cases.PLANTS) must move the loss or the gradients away from the reference.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.cases import Case, relative_error, run_on_ranks, stock_alone, tolerance

ODD, EDGES2, EVEN, ONE = (5, 9, 3), (8, 1, 1, 7), (6, 10), (16,)
EDGES4, SPAN4 = (4, 1, 4, 1, 1, 8, 1), (2, 17, 1)
MLA_V_NARROW = (("v_head_dim", 8),)  # q/k heads 16 wide, v 8: v padded across the exchange
MLA_V_WIDE = (("v_head_dim", 24),)  # v 24 wide: q/k padded
MAMBA2_GROUPS = lambda groups: (("n_groups", groups),)  # noqa: E731


def _ulysses(model_type: str, lengths: tuple[int, ...], world: int = 2, **kwargs) -> Case:
    return Case(model_type, lengths, "ulysses", world=world, **kwargs)


DEFAULT = [
    _ulysses("llama", EDGES2),
    _ulysses("gpt_oss", EDGES2),  # sinks (one per query head), sliding window, MoE
    _ulysses("granitemoehybrid", ODD),  # Mamba2 + attention whose layers get no position_ids
    _ulysses("deepseek_v3", ODD, overrides=MLA_V_NARROW),  # multi-head latent attention
    _ulysses("kimi_linear", ODD, overrides=MLA_V_WIDE),  # KDA (head-parallel) + latent attention
    _ulysses("qwen3_next", EDGES2),  # Gated DeltaNet (conv + delta rule, head-parallel) + attention
    _ulysses("bert", ODD),  # bidirectional encoder, masked-LM targets; sees the padding sample if it leaks
    _ulysses("minimax", ODD),  # lightning attention (head-parallel decay linear attention) + attention
    _ulysses("recurrent_gemma", ODD),  # RG-LRU + its conv (channel-parallel) + local attention
    _ulysses("llama", EDGES4, world=4),
    _ulysses("granitemoehybrid", SPAN4, world=4),
    _ulysses("mamba2", EDGES4, world=4, overrides=MAMBA2_GROUPS(2)),  # 2 B/C groups over 4 ranks
]
DEFAULT_PLANTED = [
    _ulysses("bert", ODD, plant="filler"),
    _ulysses("gpt_oss", EDGES2, plant="sinks"),
    _ulysses("mamba2", EDGES4, world=4, overrides=MAMBA2_GROUPS(2), plant="groups"),
]
FULL = [
    _ulysses("llama", ODD),
    _ulysses("llama", ODD, checkpointing=True),
    _ulysses("llama", EVEN),
    _ulysses("llama", ODD, dtype=torch.float32),
    _ulysses("gpt_oss", ODD),
    _ulysses("deepseek_v3", EDGES2, overrides=MLA_V_NARROW),
    _ulysses("qwen3_next", ODD),
    _ulysses("qwen3_next", EVEN),
    _ulysses("qwen3_next", EVEN, checkpointing=True),
    _ulysses("qwen3_next", ONE),
    _ulysses("lfm2", ODD),  # short conv (channel-parallel) + attention
    _ulysses("lfm2", ODD, checkpointing=True),
    _ulysses("mamba2", EVEN),  # no attention: register_ulysses only sets up the group
    _ulysses("qwen3_moe", ODD),
    _ulysses("granitemoehybrid", EDGES2),
    _ulysses("gpt_oss", EDGES4, world=4),
    _ulysses("deepseek_v3", SPAN4, world=4, overrides=MLA_V_NARROW),
    _ulysses("kimi_linear", EDGES4, world=4, overrides=MLA_V_WIDE),
    _ulysses("qwen3_next", SPAN4, world=4, overrides=(("linear_num_key_heads", 4),)),
    _ulysses("bert", EDGES4, world=4),
    _ulysses("mamba2", SPAN4, world=4, overrides=MAMBA2_GROUPS(8)),  # 8 groups over 4 ranks
    _ulysses("minimax", EDGES4, world=4),
    _ulysses("recurrent_gemma", SPAN4, world=4),
]
FULL_PLANTED = [_ulysses(model_type, ODD, plant="shard_edges") for model_type in ("llama", "qwen3_next", "lfm2",
                                                                                  "bert")]
RUN_FULL = os.environ.get("PACKFREE_SP_FULL") == "1"
EXACT = DEFAULT + (FULL if RUN_FULL else [])
PLANTED = DEFAULT_PLANTED + (FULL_PLANTED if RUN_FULL else [])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    found: dict[str, object] = {}
    for world in sorted({case.world for case in EXACT + PLANTED}):
        cases = [case for case in EXACT + PLANTED if case.world == world]
        found.update(run_on_ranks(cases, str(tmp_path_factory.mktemp("ulysses") / f"results{world}.pt")))
    return found


@pytest.mark.parametrize("case", EXACT, ids=lambda case: case.name)
def test_ulysses_equals_stock_on_each_sample_alone(case: Case, results) -> None:
    result = results[case.name]
    assert not isinstance(result, Exception), result
    expected_loss, expected = stock_alone(case)
    assert result.loss == pytest.approx(expected_loss, rel=tolerance(case, result))
    error, name = relative_error(result.grads, expected)
    assert error <= tolerance(case, result), (name, error)


@pytest.mark.parametrize("case", PLANTED, ids=lambda case: case.name)
def test_planted_bugs_are_caught(case: Case, results) -> None:
    result = results[case.name]
    assert not isinstance(result, Exception), result
    expected_loss, expected = stock_alone(case.unplanted())
    error, _ = relative_error(result.grads, expected)
    assert error > 1e-3 and result.loss != pytest.approx(expected_loss, rel=tolerance(case, result))
