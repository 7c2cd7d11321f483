"""Every hybrid / recurrent model type under packfree against stock transformers running each sample alone.

For each type with a ``sized`` entry in :data:`~.gate.catalogue.CATALOGUE` (float64 where the model allows):
packed logits equal each sample alone for (a) ``position_ids`` only (TRL padding-free), (b) everything
``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` returns, (c) B > 1 packed
rows with tail padding and an ``attention_mask`` under the model's default ``use_cache``; a loss on one
sample has exactly zero gradient on every other sample's input embeddings; an unpacked sample is
unchanged. Parameters are perturbed after init so that zero-initialised biases (relative positions,
gates) cannot hide a dropped term. The max packed-vs-alone difference per type is printed at the end.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModel, AutoModelForCausalLM, DataCollatorWithFlattening
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import packfree_plugin
from packfree_plugin.mixers.entry import check_coverage
from tests.conftest import assert_close, print_uncaptured
from packfree_plugin.gate.catalogue import catalogue_config, sized_types

LENGTHS = [7, 1, 12, 3]  # longer than the tiny block / chunk / window / compression sizes of the configs
ROWS = [[5, 2], [9], [1, 3, 4]]  # B = 3 packed rows, tail-padded to a common length

_F32 = 1e-5
FLOAT32_INSIDE: dict[str, float] = {
    # model type -> tolerance where stock computes part of the layer in float32 even for float64 inputs, so
    # the packed and alone runs differ by float32 rounding (~1e-7); everything else agrees to float64 rounding.
    "mamba2": _F32, "bamba": _F32, "falcon_h1": _F32, "nemotron_h": _F32,  # SSD torch path: dt/A/decays in fp32
    "kimi_linear": _F32, "bailing_hybrid": _F32, "glm5_next_text": _F32,  # KDA torch path in fp32
    "lara_mini": _F32,
    # GDN: stock's torch delta rule runs in fp32; packfree's native op keeps float64
    "qwen3_next": _F32, "qwen3_5_text": _F32, "qwen3_5_moe_text": _F32, "qwen4_exp_text": _F32, "olmo_hybrid": _F32,
    # Mamba2/Mamba1 mixers: stock's torch scans cast dt/A/B/C to fp32; packfree's native ops keep float64
    "granitemoehybrid": _F32, "zamba2": _F32, "mamba": _F32, "falcon_mamba": _F32, "jamba": _F32, "zamba": _F32,
    "xlstm": _F32,  # kernels run in autocast_kernel_dtype (float32 at most)
    "recurrent_gemma": _F32,  # stock accumulates the RG-LRU in fp32; packfree's native op keeps float64
    "deepseek_v4": _F32,  # eager-only attention: softmax in fp32
    "minimax_m3_vl_text": _F32,  # its block indexer scores in fp32
    "inkling2_text": _F32, "inkling2_loop_text": _F32,  # log scaling and relative bias computed in fp32
    # short convs in fp32: ``_keep_in_fp32_modules_strict`` holds every InklingShortConvolution and its forward
    # calls ``hidden_states.float()``; stock alone (with its cache's zero state prepended) and packfree (no cache)
    # convolve different lengths, which oneDNN may sum in another order: 1.1e-9 (4e-7 relative) on one Xeon,
    # bit-equal on an EPYC
    "inkling_text": _F32,
}
STOCK_CACHE_BROKEN = {"xlstm"}  # stock xLSTM with qk_dim_factor < 1 fails to build its cache: compare without one
MODEL_TYPES = [t for t in sized_types() if t in CONFIG_MAPPING_NAMES]  # an older supported release lacks the newest
FLOAT64_TOLERANCE = 1e-10
MAX_DIFF: dict[str, float] = {}


def tolerance(model_type: str) -> float:
    return FLOAT32_INSIDE.get(model_type, FLOAT64_TOLERANCE)


@cache
def pair(model_type: str):
    """``(packfree_model, stock_model)`` with identical (perturbed) weights, float64, eval mode."""
    packfree_plugin.register()
    auto = AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel
    kwargs = dict(dtype=torch.float64, experts_implementation="eager")
    torch.manual_seed(0)
    stock = auto.from_config(catalogue_config(model_type), **kwargs).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in stock.parameters():
            if parameter.is_floating_point():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    model = auto.from_config(catalogue_config(model_type), attn_implementation="packfree", **kwargs).eval()
    model.load_state_dict(stock.state_dict())
    return model, stock


def output(result) -> torch.Tensor:
    return result.logits if getattr(result, "logits", None) is not None else result.last_hidden_state


def samples_for(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed + 7 * len(lengths) + sum(lengths))
    return [torch.randint(3, 128, (n,), generator=generator) for n in lengths]


_ALONE: dict[tuple, torch.Tensor] = {}


def alone(stock, samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stock outputs of each sample run on its own (memoised: several tests share samples)."""
    results = []
    with torch.no_grad():
        for sample in samples:
            key = (id(stock), tuple(sample.tolist()))
            if key not in _ALONE:
                _ALONE[key] = output(stock(input_ids=sample[None], use_cache=False))[0]
            results.append(_ALONE[key])
    return results


def compare(model_type: str, pieces, expected, what: str) -> None:
    for index, (piece, reference) in enumerate(zip(pieces, expected)):
        MAX_DIFF[model_type] = max(MAX_DIFF.get(model_type, 0.0), (piece - reference).abs().max().item())
        assert_close(piece, reference, atol=tolerance(model_type), rtol=0, what=f"{model_type}/{what} sample {index}")


def flattened(samples: list[torch.Tensor], source: str) -> dict:
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s.tolist()} for s in samples])
    batch.pop("labels")
    if source == "position_ids":
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    return dict(batch)


def padded_rows(rows: list[list[int]], tail: int = 2) -> tuple[dict, list[list[torch.Tensor]]]:
    seq_len = max(sum(r) for r in rows) + tail
    ids, positions, mask, samples = [], [], [], []
    for row_index, lengths in enumerate(rows):
        row = samples_for(lengths, seed=row_index)
        samples.append(row)
        pad = seq_len - sum(lengths)
        ids.append(torch.cat([*row, torch.zeros(pad, dtype=torch.long)]))
        positions.append(torch.cat([*(torch.arange(n) for n in lengths), torch.arange(pad)]))
        mask.append(torch.cat([torch.ones(sum(lengths)), torch.zeros(pad)]).long())
    batch = {"input_ids": torch.stack(ids), "position_ids": torch.stack(positions), "attention_mask": torch.stack(mask)}
    return batch, samples


@pytest.mark.parametrize("source", ["position_ids", "collator"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_row_equals_each_sample_alone(model_type: str, source: str) -> None:
    model, stock = pair(model_type)
    samples = samples_for(LENGTHS)
    with torch.no_grad():
        packed = output(model(**flattened(samples, source), use_cache=False))[0]
    compare(model_type, packed.split(LENGTHS), alone(stock, samples), source)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_padded_packed_rows_with_default_cache(model_type: str) -> None:
    model, stock = pair(model_type)
    batch, samples = padded_rows(ROWS)
    with torch.no_grad():
        out = output(model(**batch))
    for row, (lengths, row_samples) in enumerate(zip(ROWS, samples)):
        pieces = out[row, : sum(lengths)].split(lengths)
        compare(model_type, pieces, alone(stock, row_samples), f"rows[{row}]")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_gradient_of_one_sample_never_reaches_another(model_type: str) -> None:
    model, _ = pair(model_type)
    samples = samples_for(LENGTHS)
    captured = []

    def keep(module, args, result):
        result = result.detach().requires_grad_(True)
        captured.append(result)
        return result

    handle = model.get_input_embeddings().register_forward_hook(keep)
    try:
        logits = output(model(**flattened(samples, "collator")))
    finally:
        handle.remove()
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    target = 2  # the longest sample
    logits[0, starts[target]: starts[target + 1]].square().sum().backward()
    grad = captured[0].grad[0]
    assert grad[starts[target]: starts[target + 1]].abs().sum() > 0, f"{model_type}: no gradient at all"
    outside = torch.cat([grad[: starts[target]], grad[starts[target + 1]:]])
    assert torch.count_nonzero(outside) == 0, f"{model_type}: gradient leaks into other samples"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_unpacked_sample_is_unchanged(model_type: str) -> None:
    model, stock = pair(model_type)
    sample = samples_for([11])[0][None]
    extra = {"use_cache": False} if model_type in STOCK_CACHE_BROKEN else {}
    with torch.no_grad():
        ours, theirs = output(model(input_ids=sample, **extra))[0], output(stock(input_ids=sample, **extra))[0]
    compare(model_type, [ours], [theirs], "unpacked")


@pytest.mark.parametrize("model_type", [t for t in MODEL_TYPES if t not in STOCK_CACHE_BROKEN])  # no stock result
def test_padded_batch_with_default_cache_equals_stock(model_type: str) -> None:
    """An ordinary right-padded batch (no packing), default ``use_cache``: the real tokens of every row equal
    stock on the same batch. It used to be refused ("a cache was passed with a packed batch")."""
    model, stock = pair(model_type)
    samples = samples_for([5, 9])
    ids = torch.stack([torch.cat([s, s.new_zeros(9 - len(s))]) for s in samples])
    mask = (torch.arange(9) < torch.tensor([[5], [9]])).long()
    with torch.no_grad():
        ours, theirs = output(model(input_ids=ids, attention_mask=mask)), output(stock(input_ids=ids, attention_mask=mask))
    compare(model_type, [ours[0, :5], ours[1]], [theirs[0, :5], theirs[1]], "padded with cache")


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2", "falcon_h1", "kimi_linear"])
def test_left_padded_generate_equals_stock(model_type: str) -> None:
    model, stock = pair(model_type)
    prompts = samples_for([4, 7], seed=2)
    ids = torch.stack([torch.cat([p.new_zeros(7 - len(p)), p]) for p in prompts])
    mask = (torch.arange(7) >= 7 - torch.tensor([[4], [7]])).long()
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        ours, theirs = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    compare(model_type, ours.scores, theirs.scores, "left-padded generate")


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2", "falcon_mamba"])
def test_a_packed_row_with_a_cache_is_refused(model_type: str) -> None:
    """An explicit, still empty cache, or generate() from a packed prompt (it makes one): refused. On Mamba2 the
    empty cache used to count as holding tokens (``has_previous_state`` became a method), so the packing was
    dropped and the mixers ran unprotected."""
    from transformers import DynamicCache

    model, _ = pair(model_type)
    batch = flattened(samples_for([4, 6]), "position_ids")
    with torch.no_grad():
        with pytest.raises(ValueError, match="cache"):
            model(**batch, cache=DynamicCache(config=model.config), use_cache=True)
        with pytest.raises(ValueError, match="cache"):
            model.generate(batch["input_ids"], position_ids=batch["position_ids"], max_new_tokens=2, do_sample=False,
                           pad_token_id=0)


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "lfm2", "jamba", "rwkv"])
def test_generate_with_cache_is_unchanged(model_type: str) -> None:
    model, stock = pair(model_type)
    prompt = samples_for([6])[0][None]
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
    with torch.no_grad():
        ours, theirs = model.generate(prompt, **kwargs), stock.generate(prompt, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    compare(model_type, ours.scores, theirs.scores, "generate")


@pytest.mark.parametrize("model_type", ["qwen3_next", "mamba2", "jamba", "lfm2", "minimax", "rwkv"])
@given(lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5))
def test_packed_row_equals_alone_for_any_lengths(model_type: str, lengths: list[int]) -> None:
    model, stock = pair(model_type)
    samples = samples_for(lengths)
    with torch.no_grad():
        packed = output(model(**flattened(samples, "position_ids")))[0]
    compare(model_type, packed.split(lengths), alone(stock, samples), f"lengths={lengths}")


def test_a_refused_layer_class_raises_at_load_with_its_reason(monkeypatch) -> None:
    import dataclasses

    from packfree_plugin.classes import CLASSES, Refusal

    packfree_plugin.register()
    monkeypatch.setitem(CLASSES, "Lfm2ShortConv",
                        dataclasses.replace(CLASSES["Lfm2ShortConv"], refused=Refusal("no exact packed path (test)")))
    with pytest.raises(ValueError, match=r"Lfm2ShortConv \(no exact packed path \(test\)\)"):
        AutoModelForCausalLM.from_config(catalogue_config("lfm2"), attn_implementation="packfree")


def test_an_unknown_mixer_still_raises_at_load() -> None:
    class MysteryRecurrence(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(4))

    with pytest.raises(ValueError, match="MysteryRecurrence"):
        check_coverage(torch.nn.Sequential(MysteryRecurrence()))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 convs are pathologically slow with 2 OpenMP threads on a loaded machine; 1 is faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def report_max_differences(request):
    yield
    print_uncaptured(request, ["max |packed - alone| per model type (tolerance):"] * bool(MAX_DIFF)
                     + [f"  {model_type:22s} {diff:.2e}  ({tolerance(model_type):.0e})"
                        for model_type, diff in sorted(MAX_DIFF.items())])
