"""DeepSpeed Ulysses with packfree as its core attention: one packed row split over 2 CPU ranks (gloo) gives one
process's loss and every parameter's gradient, for attention models, hybrids, an MoE and an encoder. Needs
deepspeed (``nox -s distributed`` installs it; the default test extra does not, so without it this module is not
collected (tests/parallel/conftest.py) and the default suite runs tests/parallel/test_head_parallel.py).

Rows (2 ranks, shard edge in the middle):
- ODD, 5 + 9 + 3 = 17 tokens: not divisible by the ranks (padded to 18); the 9-token sample crosses the edge at 9;
- EVEN, 6 + 10 = 16: divisible; rank 1's shard holds the middle and end of the 10-token sample only, so it alone
  looks unpacked (the case that left rank 0 waiting in an exchange while rank 1 refused the model's cache);
- ONE, a single 16-token sample over both ranks: every shard looks unpacked.

Each planted case takes the shard edges as sample starts; its loss and gradients must move away from one
process's, which is what fails every exactness test here if the whole row's boundaries go wrong.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.cases import Case, one_process, relative_error, run_on_two_ranks, tolerance

ODD, EVEN, ONE = (5, 9, 3), (6, 10), (16,)
EXACT = [
    Case("llama", ODD, "ulysses"),
    Case("llama", ODD, "ulysses", checkpointing=True),
    Case("llama", EVEN, "ulysses"),
    Case("llama", ODD, "ulysses", dtype=torch.float32),
    Case("qwen3_next", ODD, "ulysses"),  # Gated DeltaNet (conv + delta rule, head-parallel) + attention
    Case("qwen3_next", EVEN, "ulysses"),
    Case("qwen3_next", EVEN, "ulysses", checkpointing=True),
    Case("qwen3_next", ONE, "ulysses"),
    Case("lfm2", ODD, "ulysses"),  # short conv (channel-parallel) + attention
    Case("lfm2", ODD, "ulysses", checkpointing=True),
    Case("mamba2", EVEN, "ulysses"),  # no attention: register_ulysses only sets up the group
    Case("qwen3_moe", ODD, "ulysses"),
    Case("bert", ODD, "ulysses"),  # bidirectional encoder, masked-LM targets
]
PLANTED = [Case(model_type, ODD, "ulysses", plant="shard_edges") for model_type in ("llama", "qwen3_next", "lfm2",
                                                                                     "bert")]
REFUSED = Case("kimi_linear", ODD, "ulysses")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    return run_on_two_ranks([*EXACT, *PLANTED, REFUSED], str(tmp_path_factory.mktemp("ulysses") / "results.pt"))


@pytest.mark.parametrize("case", EXACT, ids=lambda case: case.name)
def test_ulysses_equals_one_process(case: Case, results) -> None:
    result = results[case.name]
    assert not isinstance(result, Exception), result
    expected_loss, expected = one_process(case)
    assert result.loss == pytest.approx(expected_loss, rel=tolerance(case, result))
    error, name = relative_error(result.grads, expected)
    assert error <= tolerance(case, result), (name, error)


@pytest.mark.parametrize("case", PLANTED, ids=lambda case: case.name)
def test_shard_local_boundaries_are_caught(case: Case, results) -> None:
    result = results[case.name]
    assert not isinstance(result, Exception), result
    expected_loss, expected = one_process(Case(case.model_type, case.lengths, case.engine))
    error, _ = relative_error(result.grads, expected)
    assert error > 1e-3 and result.loss != pytest.approx(expected_loss, rel=tolerance(case, result))


def test_latent_attention_is_refused_at_set_up(results) -> None:
    error = results[REFUSED.name]
    assert isinstance(error, ValueError) and "data parallelism" in str(error)
