"""A property battery over the input contract (docs/input-contract.md): random mixes of boundary sources,
mask forms, cache states, labels, dtypes (float64, float32) and non-finite values (NaN or inf in one sample's input
embeddings) on one attention model and one hybrid per mixer family. The oracle: every clean sample's logits equal stock on that
sample alone (a poisoned sample is not finite), or the call is refused with one of the documented errors.
Anything else (a wrong result, an internal error, a non-finite value in another sample) fails."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening, DynamicCache

from tests.conftest import assert_close
from tests.helpers import shared_pair

DOCUMENTED_REFUSALS = re.compile(
    "|".join([
        r"attention_mask was passed with a packed batch",  # a 1-D/3-D/4-D mask with packed inputs
        r"cache object was passed with a packed batch",
        r"labels at the first token of a packed sample",
        r"padding inside a sample",
        r"contradict",
    ])
)
MODEL_TYPES = ["llama", "qwen3_next", "kimi_linear", "mamba2", "falcon_mamba", "lfm2", "minimax", "recurrent_gemma"]
"""Attention only, then one hybrid per mixer family: GDN, KDA, SSD, selective scan, short conv, lightning, RG-LRU."""
FLOAT64_TOLERANCE = {"llama": 1e-9, "lfm2": 1e-9, "minimax": 1e-9}
"""Others: 1e-5, their stock scans run in float32 even in a float64 model."""
FLOAT32_TOLERANCE = 1e-4

inputs = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(1, 7), min_size=1, max_size=3),
    "source": st.sampled_from(["position_ids", "collator", "seq_idx", "cu_seq_lens only"]),
    "mask": st.sampled_from(["none", "ones", "tail padding", "4-D causal"]),
    "cache": st.sampled_from(["default", "off", "explicit empty"]),
    "labels": st.sampled_from(["none", "collator", "input_ids"]),
    "poison": st.sampled_from(["none", "nan", "inf"]),
    "dtype": st.sampled_from([torch.float64, torch.float32]),
})


def _call(model_type: str, case: dict) -> tuple[dict, list[torch.Tensor], int]:
    """The keyword arguments of one forward, the samples, and the number of real tokens in the row."""
    generator = torch.Generator().manual_seed(sum(case["lengths"]) * 7 + len(case["lengths"]))
    samples = [torch.randint(3, 128, (n,), generator=generator) for n in case["lengths"]]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s.tolist()} for s in samples])
    real = batch["input_ids"].shape[1]
    pad = 2 if case["mask"] == "tail padding" else 0
    if pad:  # the row's tail is a padding span of its own
        batch["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
        batch["position_ids"] = torch.cat([batch["position_ids"], torch.arange(pad)[None]], 1)
        batch["labels"] = torch.cat([batch["labels"], torch.full((1, pad), -100)], 1)
        batch["seq_idx"] = torch.cat([batch["seq_idx"], torch.full((1, pad), len(samples))], 1).int()
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.cat(
            [batch["cu_seq_lens_q"], torch.tensor([real + pad], dtype=batch["cu_seq_lens_q"].dtype)])
        batch["max_length_q"] = batch["max_length_k"] = max(batch["max_length_q"], pad)
    call = {"input_ids": batch["input_ids"]}
    if case["source"] != "cu_seq_lens only":
        call["position_ids"] = batch["position_ids"]
    if case["source"] in ("collator", "cu_seq_lens only"):
        call |= {name: batch[name] for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    if case["source"] == "seq_idx":
        call["seq_idx"] = batch["seq_idx"]
    length = real + pad
    if case["mask"] in ("ones", "tail padding"):
        call["attention_mask"] = (torch.arange(length) < real).long()[None]
    elif case["mask"] == "4-D causal":
        call["attention_mask"] = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if case["cache"] == "off":
        call["use_cache"] = False
    elif case["cache"] == "explicit empty":
        call["past_key_values"] = DynamicCache(config=shared_pair(model_type, case["dtype"])[0].config)
        call["use_cache"] = True
    if case["labels"] == "collator":
        call["labels"] = batch["labels"]
    elif case["labels"] == "input_ids":
        call["labels"] = batch["input_ids"]
    return call, samples, real


def _stock_error(stock: torch.nn.Module, call: dict) -> str | None:
    """The error stock transformers itself raises on the same call (e.g. MiniMax given a cache type not its own),
    None if it raises none."""
    try:
        with torch.no_grad():
            stock(**{k: v for k, v in call.items() if not k.startswith(("cu_seq_lens", "max_length", "seq_idx"))})
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@given(case=inputs)
def test_every_input_is_exact_or_a_documented_refusal(model_type: str, case: dict) -> None:
    model, stock = shared_pair(model_type, case["dtype"])
    call, samples, real = _call(model_type, case)
    poisoned = len(samples) // 2 if case["poison"] != "none" else None
    if poisoned is not None:  # one token of one sample: NaN or inf in its input embedding
        with torch.no_grad():
            embeds = model.get_input_embeddings()(call.pop("input_ids"))
        embeds[0, sum(case["lengths"][:poisoned]) + case["lengths"][poisoned] // 2, :3] = float(case["poison"])
        call["inputs_embeds"] = embeds
    try:
        with torch.no_grad():
            logits = model(**call).logits[0]
    except ValueError as error:
        assert DOCUMENTED_REFUSALS.search(str(error)) or str(error) == _stock_error(stock, call), \
            f"undocumented refusal: {error}"
        return
    with torch.no_grad():
        for index, (piece, sample) in enumerate(zip(logits[:real].split(case["lengths"]), samples)):
            if index == poisoned:
                assert not torch.isfinite(piece).all(), f"{model_type} {case}: the poisoned sample came out finite"
                continue
            alone = stock(input_ids=sample[None], use_cache=False).logits[0]
            tolerance = FLOAT64_TOLERANCE.get(model_type, 1e-5) if case["dtype"] == torch.float64 else FLOAT32_TOLERANCE
            assert_close(piece, alone, atol=tolerance, rtol=0, what=f"{model_type} {case} sample {index}")
