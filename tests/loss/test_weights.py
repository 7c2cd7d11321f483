"""Loss weights survive flattening: every collator users use lays a feature's ``token_weights`` and ``sample_weight``
out on its tokens (``token_weights`` / ``sample_weights [B, T]``, 0 on padding), and a field of the wrong length is
refused naming the feature and both lengths. A collator that reorders features is refused, not misread."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from packfree_plugin.packing import PackedCollator, WithLossWeights
from packfree_plugin.parallel import shard_batch
from tests.loss.reference import Samples

LENGTHS = [5, 3, 7, 4]


def _expected(samples: Samples, tokens: torch.Tensor, name: str) -> torch.Tensor:
    """The weights at ``tokens``: ``[n]`` flat indices of the samples' tokens, in feature order."""
    values = sum(samples.token_weights, []) if name == "token_weights" else \
        [weight for weight, n in zip(samples.sample_weights, LENGTHS) for _ in range(n)]
    return torch.tensor(values, dtype=torch.float32)


def _trl_collator(padding_free: bool):
    trl = pytest.importorskip("trl")
    return trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free,
                                                                   pad_to_multiple_of=8)


COLLATORS = {
    "DataCollatorWithFlattening": lambda: WithLossWeights(DataCollatorWithFlattening(return_flash_attn_kwargs=True)),
    "TRL padding_free": lambda: WithLossWeights(_trl_collator(True)),
    "TRL padded": lambda: WithLossWeights(_trl_collator(False)),
    "PackedCollator": lambda: PackedCollator(rows_per_batch=2, max_tokens=10),
}


@pytest.mark.parametrize("collator", list(COLLATORS))
def test_weights_sit_on_their_samples_tokens(collator: str) -> None:
    samples = Samples.drawn(LENGTHS)
    batch = COLLATORS[collator]()(samples.features("both"))
    ids = batch["input_ids"].reshape(-1)
    wanted = torch.tensor(sum(samples.ids, []))
    if collator == "PackedCollator":  # best-fit rows: find each sample's tokens by its ids
        order = Samples.packed_order(LENGTHS, 10)
        starts = [0]
        for index in order:
            starts.append(starts[-1] + LENGTHS[index])
        flat = torch.cat([torch.arange(row * 10, row * 10 + 10) for row in range(2)])
        real = flat[batch["attention_mask"].reshape(-1).bool()] if "attention_mask" in batch else flat
        tokens = torch.cat([real[starts[order.index(i)]:starts[order.index(i)] + LENGTHS[i]]
                            for i in range(len(LENGTHS))])
    elif "attention_mask" in batch:
        tokens = batch["attention_mask"].reshape(-1).nonzero().squeeze(1)
    else:
        tokens = torch.arange(len(wanted))
    assert torch.equal(ids[tokens], wanted), "the test's token map is wrong"
    for name in ("token_weights", "sample_weights"):
        weights = batch[name].reshape(-1)
        assert batch[name].shape == batch["input_ids"].shape and batch[name].dtype == torch.float32
        assert torch.equal(weights[tokens], _expected(samples, tokens, name)), (collator, name)
        rest = torch.ones_like(weights, dtype=torch.bool)
        rest[tokens] = False
        assert not weights[rest].any(), f"{collator} {name}: weight on a padding token"


@pytest.mark.parametrize("collator", ["DataCollatorWithFlattening", "PackedCollator"])
def test_a_weight_field_of_the_wrong_length_names_the_feature_and_both_lengths(collator: str) -> None:
    features = Samples.drawn(LENGTHS).features("token")
    features[2]["token_weights"] = features[2]["token_weights"][:-1]
    with pytest.raises(ValueError, match=r"feature 2 has 7 input_ids but 6 token_weights"):
        COLLATORS[collator]()(features)


def test_weights_given_to_some_features_only_are_refused() -> None:
    features = Samples.drawn(LENGTHS).features("sample")
    del features[1]["sample_weight"]
    with pytest.raises(ValueError, match="feature 1 lacks sample_weight"):
        PackedCollator()(features)
    features[1]["sample_weight"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="feature 1 sample_weight must be one number"):
        WithLossWeights(DataCollatorWithFlattening())(features)


def test_a_collator_that_reorders_features_is_refused() -> None:
    features = Samples.drawn([3, 3, 3]).features("sample")  # equal lengths: only the ids tell them apart

    def reversed_flattening(batch_features: list[dict]) -> dict:
        return DataCollatorWithFlattening()(list(reversed(batch_features)))

    with pytest.raises(ValueError, match="reorders features"):
        WithLossWeights(reversed_flattening)(features)
    with pytest.raises(ValueError, match="whole samples in feature order"):
        WithLossWeights(PackedCollator(rows_per_batch=2, max_tokens=10))(Samples.drawn(LENGTHS).features("sample"))


def test_shard_batch_shifts_and_shards_the_weights_like_the_labels() -> None:
    batch = WithLossWeights(DataCollatorWithFlattening())(Samples.drawn([5, 9, 3]).features("both"))
    shards = [shard_batch(batch, rank, 2) for rank in range(2)]
    targets = torch.cat([targets for _, targets in shards], dim=1)
    for name in ("token_weights", "sample_weights"):
        whole = torch.cat([inputs[name] for inputs, _ in shards], dim=1)
        assert whole.shape == targets.shape == (1, 18)  # 17 tokens padded to a multiple of 2
        assert torch.equal(whole[0, :16], batch[name][0, 1:]) and not whole[0, 16:].any(), name
