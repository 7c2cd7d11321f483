"""Encoder families with attention code of their own (issue 9) against stock transformers on each sample alone.

For each class, a tiny float32 model (the sweep's config, :func:`~packfree_plugin.gate.shrink.tiny_config_for`,
weights perturbed so that zero-initialised biases cannot hide a dropped term) under packfree is compared with the
same weights on stock (``sdpa``, else ``eager``): a packed row (boundaries from ``position_ids``, and from
``DataCollatorWithFlattening``'s ``cu_seq_lens``) equals each sample run alone; an unpacked padded batch with an
``attention_mask`` equals stock on the same batch at its real tokens; gradients of a packed row equal the sum of
the samples' own. The ``ForCausalLM`` variants run with ``is_decoder=True`` (causal) and generate as stock does.
Bidirectional sliding windows (tiny window 4, crossed by every sample) come in both of transformers' conventions:
ModernBERT passes ``config.sliding_window + 1`` to its attention, T5Gemma's encoder ``config.sliding_window``.
What cannot be exact is refused at load or on the packed row with a ``ValueError`` naming the class and cause.
"""

from __future__ import annotations

import inspect
import re
from functools import cache
from pathlib import Path

import pytest
import torch
import transformers
from transformers import CONFIG_MAPPING, DataCollatorWithFlattening

from packfree_plugin.gate.admission import bypassed
from tests import stock_facts
from packfree_plugin.gate.shrink import tiny_config_for
from packfree_plugin.loading.register import register
from tests.conftest import assert_close

LENGTHS = [6, 9, 5, 9]  # two of one length: a group of two samples; all longer than the tiny window (4)
ATOL = 2e-5

EXACT: dict[str, tuple[str, dict]] = {
    # class: (model type, config overrides)
    "RemBertForMaskedLM": ("rembert", {}),
    "RemBertForCausalLM": ("rembert", {"is_decoder": True}),
    "MegatronBertForMaskedLM": ("megatron-bert", {}),
    "MegatronBertForCausalLM": ("megatron-bert", {"is_decoder": True}),
    "RoFormerForMaskedLM": ("roformer", {}),
    "RoFormerForCausalLM": ("roformer", {"is_decoder": True}),
    "BigBirdForMaskedLM": ("big_bird", {"attention_type": "original_full"}),
    "BigBirdForCausalLM": ("big_bird", {"attention_type": "original_full", "is_decoder": True}),
    "TapasForMaskedLM": ("tapas", {}),
    "LayoutLMForMaskedLM": ("layoutlm", {}),
    "DebertaForMaskedLM": ("deberta", {}),
    "DebertaV2ForMaskedLM": ("deberta-v2", {}),
    "DebertaV2ForTokenClassification": ("deberta-v2", {}),
    "ConvBertForMaskedLM": ("convbert", {}),
    "SqueezeBertForMaskedLM": ("squeezebert", {}),
    "FNetForMaskedLM": ("fnet", {}),
    "ModernBertForMaskedLM": ("modernbert", {}),
    "ModernBertForTokenClassification": ("modernbert", {}),
    "UltrabertForMaskedLM": ("ultrabert", {}),
    "T5GemmaEncoderModel": ("t5gemma", {"is_encoder_decoder": False}),  # the other window convention
    "IBertForMaskedLM": ("ibert", {}),
    "LukeForMaskedLM": ("luke", {}),
    "MPNetForMaskedLM": ("mpnet", {}),
    "MPNetForTokenClassification": ("mpnet", {}),
    "MraForMaskedLM": ("mra", {}),
    "NystromformerForMaskedLM": ("nystromformer", {}),
    "YosoForMaskedLM": ("yoso", {}),
}
OWN_POSITION_NUMBERING = {"ibert", "luke", "mpnet", "mra", "nystromformer", "yoso"}
"""Types whose embeddings number positions from ``padding_idx + 1`` (or 2), fixed on another branch: their packed
rows here carry each sample's stock numbering as ``position_ids``, so that these tests check the encoder alone."""
CAUSAL = [name for name, (_, overrides) in EXACT.items() if overrides.get("is_decoder")]


@cache
def pair(cls_name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree_model, stock_model)`` of ``cls_name``, same perturbed weights, float32, eval mode."""
    register()
    model_type, overrides = EXACT[cls_name]
    cls = getattr(transformers, cls_name)

    def build(implementation: str) -> torch.nn.Module:
        config = tiny_config_for(model_type)
        for key, value in overrides.items():
            setattr(config, key, value)
        return cls._from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()

    torch.manual_seed(0)
    try:
        stock = build("sdpa")
    except (ValueError, ImportError):  # no sdpa path: eager is stock
        stock = build("eager")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in stock.parameters():
            if parameter.is_floating_point():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    with bypassed():  # these tests check the layers; the gate's own proof would run on every load
        model = build("packfree")
    model.load_state_dict(stock.state_dict())
    return model, stock


def samples(model: torch.nn.Module, lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(5, min(model.config.vocab_size, 100), (n,), generator=generator) for n in lengths]


def output(result) -> torch.Tensor:
    return result.logits if getattr(result, "logits", None) is not None else result.last_hidden_state


def stock_positions(stock: torch.nn.Module, sample: torch.Tensor) -> torch.Tensor:
    """The position ids stock's embeddings use for ``sample`` alone: ``[n]``."""
    embedding = next(module for name, module in stock.named_modules()
                     if name.endswith("embeddings.position_embeddings"))
    seen = []
    handle = embedding.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            stock(input_ids=sample[None])
    finally:
        handle.remove()
    return seen[0].reshape(-1)


def packed_inputs(cls_name: str, stock: torch.nn.Module, pieces: list[torch.Tensor], mode: str) -> dict:
    """One packed row of ``pieces``: ``position_ids`` (``mode="position_ids"``) or everything
    ``DataCollatorWithFlattening`` returns (``mode="collator"``)."""
    flash = mode == "collator"
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash, return_seq_idx=flash)
    batch = dict(collator([{"input_ids": piece.tolist()} for piece in pieces]))
    batch.pop("labels")
    if EXACT[cls_name][0] in OWN_POSITION_NUMBERING:
        batch["position_ids"] = torch.cat([stock_positions(stock, piece) for piece in pieces])[None]
    return batch


@pytest.mark.parametrize("mode", ["position_ids", "collator"])
@pytest.mark.parametrize("cls_name", list(EXACT))
def test_packed_row_equals_each_sample_alone(cls_name: str, mode: str) -> None:
    model, stock = pair(cls_name)
    pieces = samples(model)
    with torch.no_grad():
        packed = output(model(**packed_inputs(cls_name, stock, pieces, mode)))[0]
        for index, (piece, sample) in enumerate(zip(packed.split(LENGTHS), pieces)):
            alone = output(stock(input_ids=sample[None]))[0]
            assert_close(piece, alone, atol=ATOL, rtol=1e-4, what=f"{cls_name} sample {index}")


def test_packfree_is_exact_on_the_row_stock_is_measured_on(record_property) -> None:
    """The leak these adapters close, measured on stock with the same inputs and recorded per release
    (``tests/stock_facts.py``: DeBERTa-v2 mixes them on transformers 5.25), with packfree exact on that very row."""
    model, stock = pair("DebertaV2ForMaskedLM")
    pieces = samples(stock)
    inputs = packed_inputs("DebertaV2ForMaskedLM", stock, pieces, "position_ids")
    with torch.no_grad():
        alone = [output(stock(input_ids=piece[None]))[0] for piece in pieces]
        theirs = output(stock(**inputs))[0].split(LENGTHS)
        mine = output(model(**inputs))[0].split(LENGTHS)
    fact = stock_facts.record(record_property, "stock sdpa, DeBERTa-v2 packed by position_ids", theirs, alone,
                              tolerance=ATOL)
    for index, (piece, reference) in enumerate(zip(mine, alone)):
        assert_close(piece, reference, atol=ATOL, rtol=1e-4, what=f"packfree, sample {index}; {fact}")


@pytest.mark.parametrize("cls_name", list(EXACT))
def test_unpacked_padded_batch_equals_stock(cls_name: str) -> None:
    """Unpacked use: two right-padded rows with their ``attention_mask`` (where the model takes one), and one row."""
    model, stock = pair(cls_name)
    first, second = samples(model, [9, 6])
    input_ids = torch.stack([first, torch.cat([second, second.new_zeros(3)])])
    inputs = {"input_ids": input_ids}
    real = torch.ones_like(input_ids, dtype=torch.bool)
    if "attention_mask" in inspect.signature(model.forward).parameters:
        real[1, 6:] = False
        inputs["attention_mask"] = real.long()
    with torch.no_grad():
        assert_close(output(model(**inputs))[real], output(stock(**inputs))[real], atol=ATOL, rtol=1e-4,
                     what=f"{cls_name} padded batch")
        assert_close(output(model(input_ids=first[None])), output(stock(input_ids=first[None])), atol=ATOL,
                     rtol=1e-4, what=f"{cls_name} one sample")


@pytest.mark.parametrize("cls_name", ["RemBertForCausalLM", "DebertaV2ForMaskedLM", "FNetForMaskedLM",
                                      "ModernBertForMaskedLM", "LayoutLMForMaskedLM"])
def test_packed_gradients_equal_the_samples_own(cls_name: str) -> None:
    model, stock = pair(cls_name)
    pieces = samples(model)
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    (output(model(**packed_inputs(cls_name, stock, pieces, "position_ids")))[0] * weights).sum().backward()
    stock.zero_grad()
    for piece, piece_weights in zip(pieces, weights.split(LENGTHS)):
        (output(stock(input_ids=piece[None]))[0] * piece_weights).sum().backward()
    stock_grads = dict(stock.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert_close(parameter.grad, stock_grads[name].grad, atol=1e-4, rtol=1e-3, what=f"{cls_name} {name}")
    model.zero_grad()
    stock.zero_grad()


@pytest.mark.parametrize("cls_name", ["RemBertForCausalLM", "RoFormerForCausalLM"])
def test_causal_variants_generate_as_stock(cls_name: str) -> None:
    model, stock = pair(cls_name)
    prompt = samples(model, [5])[0][None]
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **settings), stock.generate(prompt, **settings))


def test_causal_variants_run_causally() -> None:
    """A causal variant's packed sample does not depend on its own later tokens (nor on the next sample)."""
    model, stock = pair("RemBertForCausalLM")
    pieces = samples(model)
    changed = [pieces[0].clone(), *pieces[1:]]
    changed[0][-1] = (changed[0][-1] + 1) % 100 + 5
    with torch.no_grad():
        before = output(model(**packed_inputs("RemBertForCausalLM", stock, pieces, "position_ids")))[0]
        after = output(model(**packed_inputs("RemBertForCausalLM", stock, changed, "position_ids")))[0]
    assert_close(after[: LENGTHS[0] - 1], before[: LENGTHS[0] - 1], atol=0.0, rtol=0.0, what="earlier tokens")
    assert (after[LENGTHS[0] - 1] - before[LENGTHS[0] - 1]).abs().max() > 0


REFUSED_AT_LOAD = {
    # class: (model type, config overrides, what the error names)
    "BigBirdForMaskedLM": ("big_bird", {"attention_type": "block_sparse"}, "BigBirdBlockSparseAttention"),
    "FunnelForMaskedLM": ("funnel", {}, "FunnelEncoder"),
    "LongformerForMaskedLM": ("longformer", {}, "LongformerSelfAttention"),
}


@pytest.mark.parametrize("cls_name", list(REFUSED_AT_LOAD))
def test_what_cannot_be_exact_is_refused_at_load(cls_name: str) -> None:
    register()
    model_type, overrides, named = REFUSED_AT_LOAD[cls_name]
    config = tiny_config_for(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=f"{named} \\(.+\\)"):
        getattr(transformers, cls_name)._from_config(config, attn_implementation="packfree")


def test_luke_entities_with_a_packed_row_are_refused() -> None:
    model, stock = pair("LukeForMaskedLM")
    batch = packed_inputs("LukeForMaskedLM", stock, samples(model), "position_ids")
    entities = dict(entity_ids=torch.tensor([[1, 2]]), entity_position_ids=torch.tensor([[[0, 1], [3, 4]]]))
    with torch.no_grad(), pytest.raises(ValueError, match="LukeEncoder got entity_hidden_states"):
        model(**batch, **entities)


@pytest.mark.parametrize("model_type", [model_type for model_type in ("inkling_text", "inkling2_text", "qwen4_exp_text",
                                                                      "deepseek_v4", "minimax_m3_vl_text")
                                        if model_type in CONFIG_MAPPING])  # newer types than the oldest release
def test_attention_tier_prefill_fills_the_cache(model_type: str) -> None:
    """The same tier's decoders (layers run under stock attention): an unpacked prefill of a left-padded batch runs
    the whole batch with the layer's cache and stock's padding mask, so generate() equals stock (it used to run per
    sample without the cache: later steps were wrong)."""
    from tests.models.test_hybrids import pair as hybrid_pair
    from tests.models.test_hybrids import samples_for

    model, stock = hybrid_pair(model_type)
    short, long = samples_for([4, 7], seed=2)
    input_ids = torch.stack([torch.cat([short.new_zeros(3), short]), long])
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0, attention_mask=attention_mask)
    with torch.no_grad():
        ours, theirs = model.generate(input_ids, **settings), stock.generate(input_ids, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (mine, reference) in enumerate(zip(ours.scores, theirs.scores)):
        assert_close(mine, reference, atol=1e-5, rtol=1e-5, what=f"{model_type} step {step}")


def test_left_padded_generate_equals_stock() -> None:
    """A causal variant's left-padded batch: the prefill fills the cache under stock's padding mask."""
    model, stock = pair("RemBertForCausalLM")
    short, long = samples(model, [3, 6])
    input_ids = torch.stack([torch.cat([short.new_zeros(3), short]), long])
    attention_mask = (input_ids != 0).long()
    attention_mask[1] = 1
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0, attention_mask=attention_mask)
    with torch.no_grad():
        ours, theirs = model.generate(input_ids, **settings), stock.generate(input_ids, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (mine, reference) in enumerate(zip(ours.scores, theirs.scores)):
        assert_close(mine, reference, atol=ATOL, rtol=1e-4, what=f"step {step}")


def test_the_tables_name_installed_classes() -> None:
    """Every class the encoder adapters and refusals name exists in the installed transformers; each layer in the
    half-width table exists where its model does, is bidirectional and passes ``config.sliding_window`` itself."""
    import importlib

    from packfree_plugin.classes import CLASSES, classes_with

    named = {name for name, entry in CLASSES.items() if entry.mixer in
             {"bert_era_encoder", "encoder", "luke_encoder", "layoutlm_attention", "padding_mask_encoder"}}
    pattern = re.compile(r"^class (\w+)\(", re.MULTILINE)
    defined = {name for path in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")
               for name in pattern.findall(path.read_text(encoding="utf-8"))}
    refused = {"BigBirdBlockSparseAttention", "FunnelEncoder", "PerceiverEncoder", "LongformerSelfAttention"}
    assert all(CLASSES[name].refused_at_load for name in refused)
    assert len(named) == 17 and not (named | refused) - defined
    folders = {"T5GemmaSelfAttention": "t5gemma", "MuseGlimmerAssistantAttention": "muse_glimmer_assistant"}
    assert set(folders) == classes_with("half_width_window")
    for name, folder in folders.items():
        try:
            module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
        except ModuleNotFoundError:  # a model newer than this transformers: nothing to check
            assert folder != "t5gemma", "T5Gemma is in every supported transformers"
            continue
        source = inspect.getsource(getattr(module, name))
        assert "self.is_causal = False" in source or "self.is_causal = config.is_decoder" in source
        assert "sliding_window=self.sliding_window" in source and "config.sliding_window + 1" not in source


@pytest.mark.parametrize("cls_name", ["LayoutLMForMaskedLM", "RemBertForCausalLM", "DebertaV2ForMaskedLM"])
def test_gradient_checkpointing_recomputes_what_the_forward_computed(cls_name: str) -> None:
    """Training mode (dropout on, same seed): with gradient checkpointing, backward's recomputation runs per sample
    as the forward did, so the gradients equal those without it."""
    model, stock = pair(cls_name)
    batch = packed_inputs(cls_name, stock, samples(model), "position_ids")
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(4))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(5)
        (output(model(**batch))[0] * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    model.train()
    try:
        expected = gradients()
        model.gradient_checkpointing_enable()
        got = gradients()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad()
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert_close(grad, expected[name], atol=1e-5, rtol=1e-4, what=f"{cls_name} {name}")
