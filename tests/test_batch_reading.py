"""Reading a batch: pure functions of a call's arguments, no model. Segments are checked against sample lengths
written out by hand; refusals against the contract each one states."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from packfree_plugin.forward.reading import boundaries_for_call, cache_holds_tokens, packing_signs

LENGTHS = [3, 2, 4]


def _packed_row() -> dict[str, torch.Tensor]:
    """One row of three samples, numbered 0.. in each, labels -100 at every sample's first token."""
    ids = torch.arange(1, sum(LENGTHS) + 1)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    labels[0, [0, 3, 5]] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _filled_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), layer_idx=0)
    return cache


def test_restarting_ids_and_cu_seq_lens_give_the_samples_lengths() -> None:
    by_ids = boundaries_for_call(_packed_row())
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    by_cu = boundaries_for_call({"input_ids": _packed_row()["input_ids"], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    for boundaries in (by_ids, by_cu):
        assert boundaries.lengths == tuple(LENGTHS)
        assert boundaries.is_packed
        assert boundaries.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]


def test_ids_that_never_restart_pack_nothing() -> None:
    row = _packed_row()
    row["position_ids"] = torch.arange(sum(LENGTHS))[None]
    boundaries = boundaries_for_call(row)
    assert boundaries is not None and not boundaries.is_packed and boundaries.lengths == (sum(LENGTHS),)


def test_a_label_that_crosses_into_the_next_sample_is_refused() -> None:
    row = _packed_row()
    row["labels"][0, 3] = 7  # the second sample's first token would learn from the first sample's last
    with pytest.raises(ValueError, match=r"row 0, token 3"):
        boundaries_for_call(row)
    assert boundaries_for_call(row, causal_labels=False).is_packed  # seq2seq labels are the decoder's targets


def test_packed_rows_with_a_cache_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot continue a cached sequence"):
        boundaries_for_call({**_packed_row(), "past_key_values": _filled_cache()})
    with pytest.raises(ValueError, match="a cache object was passed"):
        boundaries_for_call({**_packed_row(), "past_key_values": DynamicCache()})
    decoding = {"input_ids": torch.tensor([[5]]), "past_key_values": _filled_cache()}
    assert boundaries_for_call(decoding) is None


def test_cache_holds_tokens_reads_the_cache_state() -> None:
    assert not cache_holds_tokens(None)
    assert not cache_holds_tokens(DynamicCache())
    assert cache_holds_tokens(_filled_cache())
    assert cache_holds_tokens([torch.zeros(1, 2)]) and not cache_holds_tokens([torch.zeros(0)])


def test_a_4d_mask_with_a_packed_batch_is_refused_and_alone_is_stock() -> None:
    mask = torch.ones(1, 1, sum(LENGTHS), sum(LENGTHS))
    with pytest.raises(ValueError, match="4-D attention_mask"):
        boundaries_for_call({**_packed_row(), "attention_mask": mask})
    assert boundaries_for_call({"input_ids": _packed_row()["input_ids"], "attention_mask": mask}) is None


def test_rows_with_holes_and_empty_batches_run_as_stock() -> None:
    ids = torch.ones(2, 4, dtype=torch.long)
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    assert boundaries_for_call({"input_ids": ids, "attention_mask": holes}) is None
    right_padded = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    padded = boundaries_for_call({"input_ids": ids, "attention_mask": right_padded})
    assert padded.has_padding and not padded.is_packed
    assert boundaries_for_call({"input_ids": torch.ones(0, 4, dtype=torch.long)}) is None


def test_packing_signs_name_what_says_packed() -> None:
    cu = torch.tensor([0, 9], dtype=torch.int32)
    assert packing_signs(_packed_row()) == ["position_ids restarting at 0"]
    assert packing_signs({"seq_idx": torch.zeros(1, 9), "cu_seq_lens_q": cu, "max_length_q": 9}) == [
        "cu_seq_lens_q", "seq_idx"]
    assert packing_signs({"position_ids": torch.arange(9)[None]}) == []


@pytest.mark.parametrize("mask", [None, torch.ones(1, 11, dtype=torch.long)], ids=["no mask", "all-ones mask"])
def test_one_rule_starts_a_sample_with_a_mask_as_without(mask: torch.Tensor | None) -> None:
    """Ids that jump forward start a sample; ids that run on across padding (arange, cumsum) start none."""
    jumping = {"input_ids": torch.ones(1, 11, dtype=torch.long),
               "position_ids": torch.cat([torch.arange(5), torch.arange(20, 26)])[None], "attention_mask": mask}
    assert boundaries_for_call(jumping).lengths == (5, 6)
    holey = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    for ids in (torch.arange(11)[None], ((holey.cumsum(1) - 1) * holey)):  # one padded sample with a hole: stock
        assert boundaries_for_call({"input_ids": jumping["input_ids"], "position_ids": ids, "attention_mask": holey}) \
            is None


def test_a_shard_s_targets_are_checked_against_the_whole_row() -> None:
    """A sequence-parallel shard holds tokens 4..7 of the row ``[3, 2, 4]``: its shift_labels at token 4 (the last
    token before the sample at 5) must be -100; ``labels`` are checked at the sample's first token instead."""
    from packfree_plugin.forward.reading import crossing_target

    whole = boundaries_for_call(_packed_row())
    shard = torch.tensor([[-100, 7, 7, 7]])  # the row's tokens 4..7
    assert crossing_target(shard, whole, shifted=True, first_token=4) is None
    assert crossing_target(torch.tensor([[7, 7, 7, 7]]), whole, shifted=True, first_token=4) == (0, 4, 7)
    assert crossing_target(torch.tensor([[7, 7, 7, 7]]), whole, shifted=False, first_token=4) == (0, 5, 7)


def test_shard_batch_refuses_targets_that_cross_a_sample() -> None:
    from packfree_plugin.parallel import shard_batch

    row = _packed_row()
    shift_labels = torch.nn.functional.pad(row["labels"][:, 1:], (0, 1), value=-100)
    inputs, targets = shard_batch({**row, "shift_labels": shift_labels}, 1, 2)
    assert torch.equal(targets, torch.nn.functional.pad(shift_labels, (0, 1), value=-100)[:, 5:])
    with pytest.raises(ValueError, match=r"shift_labels at the last token before a packed sample \(row 0, token 2"):
        shard_batch({**row, "shift_labels": torch.roll(row["input_ids"], -1, 1)}, 0, 2)
    row["labels"][0, 3] = 7
    with pytest.raises(ValueError, match=r"labels at the first token of a packed sample \(row 0, token 3\)"):
        shard_batch(row, 0, 2)


def test_fields_of_another_length_are_refused_before_use() -> None:
    row = _packed_row()
    for name, value in [("attention_mask", torch.ones(1, 8)), ("seq_idx", torch.zeros(1, 8, dtype=torch.int32)),
                        ("shift_labels", row["labels"][:, :8]), ("position_ids", row["position_ids"][:, :8])]:
        with pytest.raises(ValueError, match=rf"{name} has shape \[1, 8\] but the tokens .* \[B=1, T=9\]"):
            boundaries_for_call({**row, name: value})
    with pytest.raises(ValueError, match=r"cu_seq_lens_q has shape \[1, 4\]; it must be 1-D"):
        cu = torch.tensor([[0, 3, 5, 9]], dtype=torch.int32)
        boundaries_for_call({"input_ids": row["input_ids"], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    arange_1d = {"input_ids": torch.ones(2, 9, dtype=torch.long), "position_ids": torch.arange(9)}
    assert boundaries_for_call(arange_1d, reads_position_ids=False).lengths == (9, 9)  # ignored, as stock does
    with pytest.raises(ValueError, match=r"position_ids has shape \[9\]"):
        boundaries_for_call(arange_1d)
    with pytest.raises(ValueError, match=r"position_ids has shape \[9\]"):  # ids that pack cannot be dropped
        boundaries_for_call({**arange_1d, "position_ids": row["position_ids"][0]}, reads_position_ids=False)


def test_a_float_padding_mask_reads_as_the_integer_one() -> None:
    """A 0./1. ``attention_mask`` (as some collators send it) beside packed ids gives the segments and padding spans
    of the same mask in integers; it is read to the host on its own, apart from the integer inputs (mutant: its host
    copy was None, and reading the batch raised)."""
    row = _packed_row()
    ids = torch.cat([row["input_ids"], torch.zeros(1, 3, dtype=torch.long)], dim=1)
    positions = torch.cat([row["position_ids"], torch.arange(3)[None]], dim=1)
    mask = torch.cat([torch.ones(1, sum(LENGTHS)), torch.zeros(1, 3)], dim=1)
    as_float, as_long = (boundaries_for_call({"input_ids": ids, "position_ids": positions, "attention_mask": m})
                         for m in (mask, mask.long()))
    assert as_float.offsets == as_long.offsets == (0, 3, 5, 9, 12)
    assert as_float.padding == as_long.padding == (False, False, False, True)


def test_a_cache_holds_tokens_past_a_stateless_layer_and_unknown_caches_count_as_filled() -> None:
    """A cache whose first layer stores nothing (transformers' ``DummyLayer``, a hybrid's MLP-only layer) and whose
    next one holds tokens is filled; a cache object packfree does not know is filled unless its ``get_seq_length``
    says 0, and then it is empty (mutants: the stateless layer ended the walk, an unknown cache without that method
    raised, a length of 0 counted as tokens)."""
    from transformers.cache_utils import Cache, DummyLayer, DynamicLayer

    layer = DynamicLayer()
    layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    assert cache_holds_tokens(Cache(layers=[DummyLayer(), layer]))
    assert not cache_holds_tokens(Cache(layers=[DummyLayer(), DynamicLayer()]))

    class Counted:
        def __init__(self, length: int) -> None:
            self.length = length

        def get_seq_length(self) -> int:
            return self.length

    assert cache_holds_tokens(object())
    assert cache_holds_tokens(Counted(3)) and not cache_holds_tokens(Counted(0))


@pytest.mark.parametrize("ids", [torch.arange(10).view(2, 5), torch.tensor(0)], ids=["rows of another shape", "0-d"])
def test_ids_a_model_ignores_are_dropped_when_they_start_no_sample(ids: torch.Tensor) -> None:
    """A model that takes no ``position_ids`` (Mamba, RWKV) is called with ids of another shape that restart
    nowhere: they are ignored, as stock ignores them, and the row is one sample (mutants: the ids were regrouped
    into one row, or a 0-d id into pairs, and reading them raised)."""
    call = {"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": ids}
    assert boundaries_for_call(call, reads_position_ids=False).lengths == (4,)
