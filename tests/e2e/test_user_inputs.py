"""The inputs users build by hand (issue 36), on Llama, Qwen3-Next and Mamba2 in float64, each checked against an
independent reference: the stock model (sdpa, Mamba2 eager) run on every sample alone.

- ``shift_labels`` (transformers' pre-shifted targets): exact on packed rows whose targets stay inside their samples,
  stock on unpacked batches, refused where a target crosses into the next sample, through the model and through
  transformers' DeepSpeed sequence-parallel loss (``deepspeed_sp_compute_loss``, one rank);
- a per-token field of another length than the tokens (``pad_to_multiple_of`` applied to some fields only): a
  ``ValueError`` naming both shapes, with a 2-D mask and without;
- ids that jump forward inside a row start a sample, with an all-ones mask as without one;
- ids that are no packing signal for a model that ignores them (Mamba2, 1-D ids for B=2) run as stock runs them;
- refusals of ``cu_seq_lens`` name the values and the fix.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_close
from tests.helpers import gradients, max_grad_diff, samples_of, shared_pair

MODEL_TYPES = ["llama", "qwen3_next", "mamba2"]
TOLERANCE = {"llama": 1e-9}
"""Logits; others 1e-6: their stock scans run in float32 inside a float64 model."""
LOSS_TOLERANCE = 1e-6
"""transformers computes the loss in float32 whatever the model's dtype."""
LENGTHS = [5, 1, 7]


def _row(lengths: list[int]) -> dict[str, torch.Tensor]:
    """One packed row: ids, restarting ``position_ids``, labels -100 at every sample's first token, and the
    ``shift_labels`` those labels give (-100 at every sample's last token)."""
    ids = torch.cat([torch.tensor(sample) for sample in samples_of(lengths)])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = -100
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "labels": labels,
            "shift_labels": F.pad(labels[:, 1:], (0, 1), value=-100)}


def _alone(model_type: str, row: dict[str, torch.Tensor], lengths: list[int], targets: torch.Tensor,
           ids: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The reference: stock on every sample alone (with its own slice of ``ids`` where given): the samples' logits,
    and their summed token losses against ``targets [T]`` (the row's shifted targets) over the row's target count."""
    _, stock = shared_pair(model_type)
    pieces, total, start = [], torch.zeros((), dtype=torch.float64), 0
    for length in lengths:
        mine = slice(start, start + length)
        call = {"input_ids": row["input_ids"][:, mine], "use_cache": False}
        if ids is not None:
            call["position_ids"] = ids[:, mine]
        logits = stock(**call).logits[0]
        pieces.append(logits)
        total = total + F.cross_entropy(logits.double(), targets[mine], ignore_index=-100, reduction="sum")
        start += length
    return pieces, total / (targets != -100).sum()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shift_labels_inside_their_samples_train_each_sample_alone(model_type: str) -> None:
    model, stock = shared_pair(model_type)
    row = _row(LENGTHS)
    model.zero_grad()
    stock.zero_grad()
    output = model(input_ids=row["input_ids"], position_ids=row["position_ids"], shift_labels=row["shift_labels"],
                   labels=row["shift_labels"])  # what transformers' DeepSpeed sequence-parallel loss passes
    output.loss.backward()
    pieces, reference = _alone(model_type, row, LENGTHS, row["shift_labels"][0])
    reference.backward()
    for index, (piece, alone) in enumerate(zip(output.logits[0].split(LENGTHS), pieces)):
        assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-6), rtol=0, what=f"{model_type} sample {index}")
    assert_close(output.loss.double(), reference, atol=LOSS_TOLERANCE, rtol=0, what=f"{model_type} loss")
    assert max_grad_diff(gradients(model), gradients(stock)) < 1e-6
    model.zero_grad()
    stock.zero_grad()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shift_labels_on_an_unpacked_batch_run_as_stock(model_type: str) -> None:
    model, stock = shared_pair(model_type)
    ids = torch.tensor(samples_of([6, 6])) 
    shift_labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        mine = model(input_ids=ids, labels=ids, shift_labels=shift_labels).loss
        theirs = stock(input_ids=ids, labels=ids, shift_labels=shift_labels, use_cache=False).loss
    assert_close(mine, theirs, atol=0, rtol=0, what=f"{model_type} loss")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_shift_labels_that_cross_into_the_next_sample_are_refused(model_type: str) -> None:
    model, _ = shared_pair(model_type)
    row = _row(LENGTHS)
    rolled = torch.roll(row["input_ids"], -1, dims=1)  # every sample's last token targets the next sample's first
    with pytest.raises(ValueError, match=r"shift_labels at the last token before a packed sample \(row 0, token 4; "
                                         r"the sample starts at token 5\) are \d+, not -100.*To fix it"):
        model(input_ids=row["input_ids"], position_ids=row["position_ids"], labels=row["labels"], shift_labels=rolled)


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (transformers' sequence-parallel loss all-reduces over it)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_transformers_deepspeed_sequence_parallel_loss_reads_shift_labels(model_type: str, one_rank_group) -> None:
    """``transformers.integrations.deepspeed.deepspeed_sp_compute_loss`` on one rank: the inputs DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` builds (``shift_labels``, no ``labels``) give each sample alone's loss; rolled
    ``shift_labels`` are refused."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    model, _ = shared_pair(model_type)
    row = _row(LENGTHS)
    accelerator = SimpleNamespace(torch_device_mesh={"sp": SimpleNamespace(get_group=lambda: one_rank_group)})
    parallelism = SimpleNamespace(sp_backend="torch", sp_size=1)
    inputs = {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "shift_labels": row["shift_labels"]}
    with torch.no_grad():
        loss = deepspeed_sp_compute_loss(accelerator, model, dict(inputs), False, parallelism)
        _, reference = _alone(model_type, row, LENGTHS, row["shift_labels"][0])
        assert_close(loss.double(), reference, atol=LOSS_TOLERANCE, rtol=0, what=f"{model_type} loss")
        inputs["shift_labels"] = torch.roll(row["input_ids"], -1, dims=1)
        with pytest.raises(ValueError, match="shift_labels at the last token before a packed sample"):
            deepspeed_sp_compute_loss(accelerator, model, dict(inputs), False, parallelism)


def _padded_to_16(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pad_to_multiple_of=8`` applied to ids, labels and the mask of a 12-token row, not to ``position_ids``."""
    pad = 16 - row["input_ids"].shape[1]
    return {"input_ids": F.pad(row["input_ids"], (0, pad)), "labels": F.pad(row["labels"], (0, pad), value=-100),
            "attention_mask": F.pad(torch.ones_like(row["input_ids"]), (0, pad)), "position_ids": row["position_ids"]}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("field", ["position_ids", "attention_mask", "labels", "shift_labels", "seq_idx",
                                   "position_ids without a mask"])
def test_fields_padded_apart_from_the_tokens_are_refused_naming_both_shapes(model_type: str, field: str) -> None:
    model, _ = shared_pair(model_type)
    row = _row([5, 7])
    call = _padded_to_16(row)  # position_ids [1, 12], the rest [1, 16]
    if field == "position_ids without a mask":
        del call["attention_mask"]
    elif field != "position_ids":  # this field alone stays at 12
        call["position_ids"] = F.pad(row["position_ids"], (0, 4), value=0) + torch.cat(
            [torch.zeros(12, dtype=torch.long), torch.arange(4)])
        call[field] = {"attention_mask": torch.ones(1, 12, dtype=torch.long), "labels": row["labels"],
                       "shift_labels": row["shift_labels"],
                       "seq_idx": torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)}[field]
    name = field.split()[0]
    with pytest.raises(ValueError, match=rf"{name} has shape \[1, 12\] but the tokens .* are \[B=1, T=16\].*"
                                         r"pad_to_multiple_of"):
        model(**call)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("mask", [False, True], ids=["no mask", "all-ones mask"])
def test_ids_that_jump_forward_start_a_sample_with_a_mask_as_without(model_type: str, mask: bool) -> None:
    model, _ = shared_pair(model_type)
    lengths = [6, 9]
    row = _row(lengths)
    jumping = torch.cat([torch.arange(6), torch.arange(20, 29)])[None]
    call = {"input_ids": row["input_ids"], "position_ids": jumping}
    if mask:
        call["attention_mask"] = torch.ones_like(row["input_ids"])
    with torch.no_grad():
        logits = model(**call).logits[0]
        pieces, _ = _alone(model_type, row, lengths, row["shift_labels"][0], ids=jumping)
    for index, (piece, alone) in enumerate(zip(logits.split(lengths), pieces)):
        assert_close(piece, alone, atol=TOLERANCE.get(model_type, 1e-6), rtol=0, what=f"{model_type} sample {index}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ids_a_model_ignores_never_make_it_refuse_what_stock_runs(model_type: str) -> None:
    """1-D ``[T]`` ids for a B=2 batch: Mamba2 ignores them and runs, so packfree runs it as stock; attention
    models read them and stock fails, so packfree refuses them with a ValueError naming the shapes."""
    model, stock = shared_pair(model_type)
    ids = torch.tensor(samples_of([8, 8]))
    call = {"input_ids": ids, "position_ids": torch.arange(8), "use_cache": False}
    with torch.no_grad():
        try:
            expected = stock(**call).logits
        except Exception:  # stock cannot run it (RoPE indexes [B, T] ids): a clear refusal is owed
            with pytest.raises(ValueError, match=r"position_ids has shape \[8\] .* \[B=2, T=8\]"):
                model(**call)
            return
        assert_close(model(**call).logits, expected, atol=0, rtol=0, what=model_type)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize(("rows", "offsets", "message"), [
    (1, [0, 5, 12, 12], r"cu_seqlens \[0, 5, 12, 12\] hold a zero-length sample at index 2 .*Drop empty samples"
                        r".*\[0, 5, 12\]"),
    (2, [0, 5, 12, 17, 19], r"got 19 in \[0, 5, 12, 17, 19\].*pass cu_seq_lens_q = cu_seq_lens_k = "
                            r"\[0, 5, 12, 17, 19, 24\]"),
], ids=["zero-length segment", "one cumsum skipping padding"])
def test_cu_seq_lens_refusals_name_the_values_and_the_fix(model_type: str, rows: int, offsets: list[int],
                                                          message: str) -> None:
    model, _ = shared_pair(model_type)
    cu = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        model(input_ids=torch.ones(rows, 12, dtype=torch.long), cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_a_message_names_an_expected_layout_only_where_it_fits() -> None:
    from packfree_plugin.boundaries import Boundaries

    with pytest.raises(ValueError, match=re.escape("rows start at multiples of T=4")):
        Boundaries([0, 9, 10], batch_size=3, seq_len=4, device="cpu")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_floating_padding_mask_runs_as_stock(model_type: str, dtype: torch.dtype) -> None:
    """An ``attention_mask`` of 0. and 1. in a floating dtype (a collator that casts the whole batch to the model's
    dtype): on a right-padded batch packfree gives stock's logits for the same mask, and beside a packed row's ids
    each sample's logits alone."""
    model, stock = shared_pair(model_type)
    tolerance = TOLERANCE.get(model_type, 1e-6)
    short, long = samples_of([4, 9])
    ids = torch.tensor([short + [0] * 5, long])
    mask = torch.tensor([[1] * 4 + [0] * 5, [1] * 9]).to(dtype)
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask, use_cache=False).logits
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert_close(padded[0, :4], expected[0, :4], atol=tolerance, rtol=0, what="padded sample 0")
        assert_close(padded[1], expected[1], atol=tolerance, rtol=0, what="padded sample 1")
        row = _row(LENGTHS)
        call = {"input_ids": row["input_ids"], "position_ids": row["position_ids"],
                "attention_mask": torch.ones_like(row["input_ids"], dtype=dtype)}
        logits = model(**call).logits[0]
        pieces, _ = _alone(model_type, row, LENGTHS, row["shift_labels"][0])
    for index, (piece, alone) in enumerate(zip(logits.split(LENGTHS), pieces)):
        assert_close(piece, alone, atol=tolerance, rtol=0, what=f"{model_type} packed sample {index}")
