"""The default suite's subset of the sequence-parallel checks (no DeepSpeed needed; ``nox -s distributed`` runs
the rest): one packed row split over 2 CPU ranks (gloo) must give the loss and gradients of the stock model run on
each sample alone (tests/parallel/cases.py).

- Mamba2, Mamba: no attention, so every token-mixing op runs head-parallel (:mod:`.parallel.head_parallel`);
  rows of odd length (padded to the group) with a sample crossing the shard edge; a Mamba2 of 4 B/C head groups
  (each rank's heads read 2 of them).
- the same with shard-local boundaries planted, and with every rank reading the first groups: the gradients must
  differ.
- LFM2 without Ulysses: its attention would see only the shard; refused in the first forward.
- torch's context_parallel with a packed row: refused in the first forward.
- Ulysses over one rank: refused at set-up (DeepSpeed sets up no group for it).
- Qwen3-Next in a group of one process: a shard that looks unpacked runs packed, with the model's cache off.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.cases import Case, float64_inside, relative_error, run_on_ranks, stock_alone, tolerance

LENGTHS = (5, 9, 3)  # 17 tokens (padded to 18): the 9-token sample spans tokens 5..13, across the edge at 9
CASES = {
    "mamba2": Case("mamba2", LENGTHS),
    "mamba2_ckpt": Case("mamba2", LENGTHS, checkpointing=True),
    "mamba": Case("mamba", LENGTHS),
    "one_sample": Case("mamba2", (16,)),  # one sample over both ranks: each shard alone looks unpacked
    "planted": Case("mamba2", LENGTHS, plant="shard_edges"),
    "groups": Case("mamba2", LENGTHS, overrides=(("n_groups", 4),)),
    "groups_planted": Case("mamba2", LENGTHS, overrides=(("n_groups", 4),), plant="groups"),
    "attention_without_ulysses": Case("lfm2", LENGTHS),
    "torch_cp": Case("llama", (5, 9, 6), engine="torch_cp"),  # torch's CP wants rows divisible by 2 x ranks
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    return run_on_ranks(list(CASES.values()), str(tmp_path_factory.mktemp("sp") / "results.pt"))


@pytest.mark.parametrize("key", ["mamba2", "mamba2_ckpt", "mamba", "one_sample", "groups"])
def test_mixers_split_over_ranks_equal_stock_on_each_sample(key: str, results) -> None:
    case = CASES[key]
    result = results[case.name]
    expected_loss, expected = stock_alone(case)
    assert result.loss == pytest.approx(expected_loss, rel=tolerance(case, result))
    error, name = relative_error(result.grads, expected)
    assert error <= tolerance(case, result), (name, error)


@pytest.mark.parametrize("key", ["planted", "groups_planted"])
def test_planted_bugs_are_caught(key: str, results) -> None:
    case = CASES[key]
    result = results[case.name]
    expected_loss, expected = stock_alone(case.unplanted())
    error, _ = relative_error(result.grads, expected)
    assert error > 1e-3 and result.loss != pytest.approx(expected_loss, rel=tolerance(case, result))


def test_attention_on_a_shard_is_refused_without_ulysses(results) -> None:
    error = results[CASES["attention_without_ulysses"].name]
    assert isinstance(error, ValueError) and "Ulysses" in str(error)


def test_packed_row_under_torch_context_parallel_is_refused(results) -> None:
    error = results[CASES["torch_cp"].name]
    assert isinstance(error, ValueError), error
    assert "context_parallel" in str(error) and "Ulysses" in str(error)



def test_ulysses_over_one_rank_is_refused_at_set_up() -> None:
    from packfree_plugin.parallel import register_ulysses

    with pytest.raises(ValueError, match="nothing to split"):
        register_ulysses(torch.nn.Linear(2, 2), 1)


@pytest.fixture
def group_of_one():
    """A gloo group of this process alone (no port: an in-memory store), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_shard_holding_one_samples_middle_runs_without_the_cache(group_of_one) -> None:
    """A shard that looks unpacked (one sample's middle) must still run packed, with the cache off: Qwen3-Next's
    packed Gated DeltaNet refused the cache its model made for such a shard, on that rank only (its peers then
    waited in the head exchange). A group of one, whose shard is the whole row, runs the same hook in-process."""
    from packfree_plugin.parallel import prepare_sequence_parallel
    from tests.parallel.cases import _batch, _grads, _model

    case = Case("qwen3_next", (16,))
    model = prepare_sequence_parallel(_model(case))
    batch = _batch(case)
    labels = batch.pop("labels")
    with float64_inside(model):
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss.backward()
    expected_loss, expected = stock_alone(case)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    error, name = relative_error(_grads(model), expected)
    assert error <= 1e-10, (name, error)


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_generic_tier_mixers_are_refused_at_set_up(model_type: str) -> None:
    """RWKV and xLSTM run their recurrence per sample on the tokens they get, not through a routed op: a sample that
    began on another rank is not on the shard, so they are refused, naming why."""
    from packfree_plugin.parallel.setup import check_splittable
    from packfree_plugin.loading.register import register
    from packfree_plugin.cli.tiny import auto_class, tiny_config

    register()
    config = tiny_config(model_type)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, attn_implementation="packfree")
    with pytest.raises(ValueError, match="not through packfree's routed ops.*data parallelism"):
        check_splittable(model)
