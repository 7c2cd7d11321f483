"""Unpacked means stock: a batch with no packing signal (no ``cu_seq_lens``, no ``seq_idx``, position ids that never
restart) runs exactly as stock sdpa/eager runs it, whatever its 2-D ``attention_mask`` holds, zeros inside a row
included (transformers' own tests build such padded references). Each model is compared, in float64, with the same
weights loaded under stock attention on the same batch: every token, padding included, and the gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

import packfree_plugin
from packfree_plugin.cli.tiny import tiny_config
from tests.conftest import assert_close

HOLEY_MASK = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0]])
"""Zeros inside rows 0 and 1 (row 1 also left-padded), row 2 right-padded."""

FAMILIES = {
    # model type: stock attention it is compared with
    "llama": "sdpa",
    "gpt_neox": "sdpa",
    "bert": "sdpa",
    "electra": "sdpa",
    "qwen3_next": "sdpa",  # Gated DeltaNet hybrid: stock masks its padded states, and packfree must not mask otherwise
    "lfm2": "sdpa",  # short-conv hybrid
    "mamba2": "eager",
}
POSITION_IDS = {
    "none": None,
    "arange": torch.arange(8).expand(3, 8),
    "cumsum": (HOLEY_MASK.cumsum(-1) - 1) * HOLEY_MASK,  # transformers' padding-free tests' ids
    "float": torch.arange(8, dtype=torch.float64).expand(3, 8),
}


def _pair(model_type: str, reference: str):
    packfree_plugin.register()
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config(model_type), attn_implementation="packfree", dtype=torch.float64)
    stock = AutoModel.from_config(tiny_config(model_type), attn_implementation=reference, dtype=torch.float64)
    stock.load_state_dict(model.state_dict())
    return model.eval(), stock.eval()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_holey_padded_batch_equals_stock(model_type: str) -> None:
    model, stock = _pair(model_type, FAMILIES[model_type])
    tokens = torch.randint(3, 100, HOLEY_MASK.shape, generator=torch.Generator().manual_seed(1))
    for name, positions in POSITION_IDS.items():
        if positions is not None and (name == "float" and model_type in ("bert", "electra") or model_type == "mamba2"):
            continue  # stock's learned position table takes integer ids only; Mamba2 takes no position ids
        extra = {} if positions is None else {"position_ids": positions}
        outputs = []
        for each in (model, stock):
            each.zero_grad()
            hidden = each(input_ids=tokens, attention_mask=HOLEY_MASK, **extra).last_hidden_state
            (hidden * HOLEY_MASK[..., None]).pow(2).sum().backward()
            outputs.append((hidden.detach(), [p.grad.clone() for p in each.parameters() if p.grad is not None]))
        (mine, my_grads), (theirs, their_grads) = outputs
        assert_close(mine, theirs, atol=1e-12, rtol=0, what=f"{model_type} ids={name} hidden states")
        assert len(my_grads) == len(their_grads)
        for index, (a, b) in enumerate(zip(my_grads, their_grads)):
            assert_close(a, b, atol=1e-10, rtol=0, what=f"{model_type} ids={name} gradient {index}")


def test_a_packed_row_still_may_not_hold_a_hole() -> None:
    """The packed-row rules stay for packed rows: ids that restart (a packing signal) and run on across padding
    inside a sample are refused, never split or filled."""
    model, _ = _pair("llama", "sdpa")
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1]])
    positions = torch.tensor([[0, 1, 0, 1, 0, 2, 3]])  # the second sample (from token 2) has a hole at token 4
    with torch.no_grad(), pytest.raises(ValueError, match="padding inside a sample"):
        model(input_ids=torch.randint(3, 100, (1, 7)), attention_mask=mask, position_ids=positions)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_ids_that_jump_forward_beside_a_mask_start_a_sample(model_type: str) -> None:
    """One rule for a sample's start, mask or no mask (docs/input-contract.md): ids that jump forward start a sample,
    so each run of kept tokens between jumps equals stock running it alone (before, beside a 2-D mask, the row ran as
    one sample: silently mixed, 0.62 off on Llama)."""
    model, stock = _pair(model_type, "sdpa")
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 5, 6, 7, 0, 0], [0, 0, 0, 1, 4, 5, 6, 7]])
    samples = {0: [(0, 3), (3, 6)], 1: [(2, 4), (4, 8)]}  # (start, end) of each sample's kept tokens, per row
    tokens = torch.randint(3, 100, mask.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = model(input_ids=tokens, attention_mask=mask, position_ids=positions).last_hidden_state
        for row, spans in samples.items():
            for start, end in spans:
                alone = stock(input_ids=tokens[row, start:end][None]).last_hidden_state[0]
                # to float32 rounding: stock's rotary angles (ids 5.. vs 0.. alone) and Gated DeltaNet run in float32
                assert_close(mine[row, start:end], alone, atol=1e-6, rtol=0,
                             what=f"{model_type} row {row} tokens {start}:{end}")


def test_float_ids_that_restart_pack_like_integer_ids() -> None:
    """Float position ids that restart are a packing signal like integer ones: each sample equals stock running it
    alone (to float32 rounding: transformers' and packfree's Gated DeltaNet run their recurrence in float32; a leak
    between samples moves the outputs by 1e-2 or more)."""
    model, stock = _pair("qwen3_next", "sdpa")
    lengths = [3, 5, 2]
    tokens = torch.randint(3, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n, dtype=torch.float32) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=tokens, position_ids=positions).last_hidden_state[0]
        for index, (piece, sample) in enumerate(zip(packed.split(lengths), tokens[0].split(lengths))):
            alone = stock(input_ids=sample[None]).last_hidden_state[0]
            assert_close(piece, alone, atol=1e-5, rtol=0, what=f"sample {index}")
