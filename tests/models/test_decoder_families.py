"""Decoder families with attention forms of their own (issue 9) under packfree against stock transformers.

Each family's attention layer runs per sample under stock attention (``mixers.families``): ALiBi (Bloom, MPT,
Falcon with ``alibi``), per-implementation attention tables (GPT-Neo, Falcon, GIT), attention code of its own
(GPT-NeoX-Japanese, Doge, OpenAI GPT, XLM/Flaubert), sparse-attention indexers (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4,
AXK2), Llama 4's chunked attention (the packfree attention function, chunks restarting at every sample), and
multimodal models whose audio conv front-end only ever runs on audio (Phi-4 multimodal, MOSS), text only.
For every type: a packed row equals each sample run alone on stock (float64, perturbed weights), for
``position_ids`` only and for ``DataCollatorWithFlattening``'s keyword arguments; an unpacked sample and a
right-padded batch equal stock on the same input; ``generate()`` from a left-padded batch equals stock. The
types packfree cannot make exact are refused at load, naming the layer and the cause.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from functools import cache

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening

import packfree_plugin
from packfree_plugin.gate.shrink import tiny_config_for
from tests.conftest import assert_close, print_uncaptured

FAMILIES: dict[str, tuple[str, dict]] = {
    # model type -> (class, config overrides): each row one attention form
    "bloom": ("BloomForCausalLM", {}),  # ALiBi built from the 2-D mask at model level
    "mpt": ("MptForCausalLM", {}),  # ALiBi position_bias relative to the last key, bool mask True = hidden
    "falcon": ("FalconForCausalLM", {}),  # RoPE, attention class from an implementation table
    "falcon-alibi": ("FalconForCausalLM", {"alibi": True}),  # ALiBi folded into the mask at model level
    "gpt_neo": ("GPTNeoForCausalLM", {}),  # global + local layers (window 4), eager-only class table
    "git": ("GitForCausalLM", {}),  # eager-only class table, text only
    "gpt_neox_japanese": ("GPTNeoXJapaneseForCausalLM", {}),  # mask added to scores, a bias returned as a parameter
    "doge": ("DogeForCausalLM", {}),  # dynamic mask from values, top keep_window_size keys
    "openai-gpt": ("OpenAIGPTLMHeadModel", {}),  # causal buffer of its own, no mask interface
    "xlm": ("XLMWithLMHeadModel", {}),  # bidirectional, [B, T] mask of its own
    "xlm-causal": ("XLMWithLMHeadModel", {"causal": True}),  # [B, T, T] mask of its own
    "flaubert": ("FlaubertWithLMHeadModel", {}),
    "deepseek_v32": ("DeepseekV32ForCausalLM", {"index_topk": 4}),  # DSA indexer, top-k below the sample lengths
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", {"index_topk": 4}),  # DSA, top-k shared with later layers
    "hy_v4": ("HYV4ForCausalLM", {"index_topk": 4}),  # DSA shared, sinks: eager
    "axk2": ("AXK2ForCausalLM", {"index_topk": 4}),
    "llama4_text": ("Llama4ForCausalLM", {}),  # chunked attention (chunk 4) on its chunked layers
    "dots3_note_text": ("Dots3NoteForCausalLM", {}),  # DSA indexer layers + MLA sliding layers with their own heads
    # types whose tiny config needed the shrinker's help (gate/shrink.py): plain attention, built since
    "dory": ("DoryForCausalLM", {}),  # input / looped / output layer sections, sliding and full layers in each
    "dbrx": ("DbrxForCausalLM", {}),
    "dots1": ("Dots1ForCausalLM", {}),
    "cohere_compass_text": ("CohereCompassForCausalLM", {}),  # sliding RoPE layers, full NoPE layers
    # multimodal models with an audio conv front-end, text only: the audio tower never sees the packed row
    "phi4_multimodal": ("Phi4MultimodalForCausalLM", {}),
    "moss_transcribe_diarize": ("MossTranscribeDiarizeForConditionalGeneration", {}),
}
NOT_GENERATING = {"xlm", "flaubert"}  # bidirectional masked LMs
FLOAT32_INSIDE = 1e-5  # most of these compute their softmax (or ALiBi, or the indexer) in float32
LENGTHS = [7, 1, 12, 3]  # longer than the tiny windows, chunks and top-k (4)
MAX_DIFF: dict[str, float] = {}


def _model_type(name: str) -> str:
    return name.split("-")[0] if name not in ("openai-gpt",) else name


def _cases(names: Iterable[str]) -> list:
    """``names`` as parameters, each marked with its model type (deselected on a transformers without it)."""
    return [pytest.param(name, marks=pytest.mark.model_types(_model_type(name))) for name in names]


def config_for(name: str):
    model_type = _model_type(name)
    class_name, overrides = FAMILIES[name]
    config = tiny_config_for(model_type)
    cls = getattr(transformers, class_name)
    if not isinstance(config, cls.config_class):
        config = config.get_text_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    return cls, config


@cache
def pair(name: str, dtype: torch.dtype = torch.float64):
    """``(packfree_model, stock_model)``: identical perturbed weights, eval; stock on sdpa where it has it."""
    packfree_plugin.register()
    cls, config = config_for(name)
    kwargs = dict(dtype=dtype, experts_implementation="eager")
    torch.manual_seed(0)
    try:  # each build gets its own config: loading sets the config's attention implementation
        stock = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa", **kwargs)
    except ValueError:  # no sdpa path
        stock = cls._from_config(copy.deepcopy(config), attn_implementation="eager", **kwargs)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in stock.parameters():
            if parameter.is_floating_point():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    model = cls._from_config(copy.deepcopy(config), attn_implementation="packfree", **kwargs)
    model.load_state_dict(stock.state_dict())
    return model.eval(), stock.eval()


def logits(result) -> torch.Tensor:
    return result.logits if getattr(result, "logits", None) is not None else result[0]


def samples_for(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=generator) for n in lengths]


def compare(name: str, ours: torch.Tensor, theirs: torch.Tensor, what: str, atol: float = FLOAT32_INSIDE) -> None:
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), (ours - theirs).abs().max().item())
    assert_close(ours, theirs, atol=atol, rtol=0, what=f"{name}/{what}")


@pytest.mark.parametrize("source", ["position_ids", "collator"])
@pytest.mark.parametrize("name", _cases(FAMILIES))
def test_packed_row_equals_each_sample_alone(name: str, source: str) -> None:
    model, stock = pair(name)
    samples = samples_for(LENGTHS)
    batch = dict(DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s.tolist()} for s in samples]))
    batch.pop("labels")
    if source == "position_ids":
        batch = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    with torch.no_grad():
        packed = logits(model(**batch))[0].split(LENGTHS)
        for index, sample in enumerate(samples):
            compare(name, packed[index], logits(stock(input_ids=sample[None], use_cache=False))[0],
                    f"{source} sample {index}")


@pytest.mark.parametrize("name", _cases(FAMILIES))
def test_unpacked_and_padded_batches_equal_stock(name: str) -> None:
    """One sample per row: a lone sample, and a right-padded batch with its mask under the default cache."""
    model, stock = pair(name)
    lone = samples_for([13], seed=1)[0][None]
    samples = samples_for([5, 9], seed=2)
    ids = torch.stack([torch.cat([s, s.new_zeros(9 - len(s))]) for s in samples])
    mask = (torch.arange(9) < torch.tensor([[5], [9]])).long()
    with torch.no_grad():
        compare(name, logits(model(input_ids=lone)), logits(stock(input_ids=lone)), "unpacked")
        ours, theirs = logits(model(input_ids=ids, attention_mask=mask)), logits(stock(input_ids=ids, attention_mask=mask))
    compare(name, ours[0, :5], theirs[0, :5], "right-padded row 0")
    compare(name, ours[1], theirs[1], "right-padded row 1")


@pytest.mark.parametrize("name", _cases(name for name in FAMILIES if name.split("-")[0] not in NOT_GENERATING))
def test_generate_equals_stock(name: str) -> None:
    """Greedy decoding with the cache from a single prompt and from a left-padded batch, in float32 (stock Bloom casts
    its float64 mask minimum to a float32 -inf and gives NaN on left padding)."""
    model, stock = pair(name, torch.float32)
    prompts = samples_for([4, 7], seed=4)
    ids = torch.stack([torch.cat([p.new_zeros(7 - len(p)), p]) for p in prompts])
    mask = (torch.arange(7) >= 7 - torch.tensor([[4], [7]])).long()
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    for inputs in ({"input_ids": prompts[1][None]}, {"input_ids": ids, "attention_mask": mask}):
        with torch.no_grad():
            ours, theirs = model.generate(**inputs, **kwargs), stock.generate(**inputs, **kwargs)
        assert torch.equal(ours.sequences, theirs.sequences), name
        for step, (a, b) in enumerate(zip(ours.scores, theirs.scores)):
            compare(name, a, b, f"generate step {step} ({len(inputs['input_ids'])} prompts)", atol=1e-4)


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi", "openai-gpt", "xlm", "glm_moe_dsa", "llama4_text"])
def test_gradient_of_one_sample_never_reaches_another(name: str) -> None:
    """Training through the per-sample path: a loss on one packed sample has exactly zero gradient on the input
    embeddings of every other sample."""
    model, _ = pair(name)
    samples = samples_for(LENGTHS)
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits(model(inputs_embeds=embeddings, position_ids=positions, use_cache=False))[0, 8:20].sum().backward()
    grad = embeddings.grad[0].abs().sum(-1)  # the loss reads sample 2 (tokens 8..19)
    assert grad[8:20].sum() > 0, name
    assert torch.count_nonzero(torch.cat([grad[:8], grad[20:]])) == 0, f"{name}: gradient leaks into other samples"


def test_compiled_chunked_attention_equals_each_sample_alone() -> None:
    """Under torch.compile the chunk reaches the opaque attention op as an option."""
    model, stock = pair("llama4_text")
    samples = samples_for(LENGTHS)
    batch = {"input_ids": torch.cat(samples)[None], "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}
    with torch.no_grad():
        packed = logits(torch.compile(model, backend="aot_eager")(**batch))[0].split(LENGTHS)
        for index, sample in enumerate(samples):
            compare("llama4_text", packed[index], logits(stock(input_ids=sample[None], use_cache=False))[0],
                    f"compiled sample {index}")


REFUSED = {
    "doge-moe": ("DogeForCausalLM", "DogeCDMoE", "B \\* T"),
    "cpmant": ("CpmAntForCausalLM", "CpmAntEncoder", "prompt"),
    "prophetnet": ("ProphetNetForCausalLM", "ProphetNetNgramSelfAttention", "predict streams"),
    "xlnet": ("XLNetLMHeadModel", "XLNetRelativeAttention", "two-stream"),
}
REFUSED_CONFIG = {"doge-moe": {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 2}}


@pytest.mark.parametrize("name", REFUSED)
def test_what_cannot_be_exact_is_refused_at_load(name: str) -> None:
    class_name, layer, cause = REFUSED[name]
    packfree_plugin.register()
    config = tiny_config_for(name.split("-")[0])
    for key, value in REFUSED_CONFIG.get(name, {}).items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=rf"{layer} \(.*{cause}"):
        getattr(transformers, class_name)._from_config(config, attn_implementation="packfree")


@pytest.fixture(scope="module", autouse=True)
def report_max_differences(request):
    yield
    print_uncaptured(request, ["max |packfree - stock| per family (float64; generate: float32):"] * bool(MAX_DIFF)
                     + [f"  {name:20s} {diff:.2e}" for name, diff in sorted(MAX_DIFF.items())])


# ------------------------------------------------------------------------------------- chunked attention, unit level
@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
def test_chunked_segments_equal_a_per_sample_reference(chunk: int) -> None:
    """Portable packed attention with ``chunk``: each sample's queries see the keys of their own chunk, counted from
    the sample's first token. Reference: dense softmax per sample with the chunked-causal pattern written out."""
    from packfree_plugin.attention import AttentionOptions
    from packfree_plugin.attention.segments import segment_attention
    from packfree_plugin.boundaries import Boundaries

    lengths = [7, 1, 12, 3, 70]  # 70: past the batched-short-segment limit
    generator = torch.Generator().manual_seed(5)
    query, key, value = (torch.randn(1, 4, sum(lengths), 8, generator=generator, dtype=torch.float64) for _ in range(3))
    boundaries = Boundaries.from_cu_seqlens(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
                                            batch_size=1, seq_len=sum(lengths))
    out = segment_attention(query, key, value, boundaries, AttentionOptions(scale=0.3, causal=True, chunk=chunk))
    start = 0
    for length in lengths:
        position = torch.arange(length)
        visible = (position[None, :] <= position[:, None]) & (position[None, :] // chunk == position[:, None] // chunk)
        span = slice(start, start + length)
        logits = (query[0, :, span] @ key[0, :, span].transpose(-1, -2) * 0.3).masked_fill(~visible, float("-inf"))
        expected = (logits.softmax(-1) @ value[0, :, span]).transpose(0, 1)
        assert_close(out[0, span], expected, what=f"chunk {chunk}, sample of {length}")
        start += length


def test_a_forced_varlen_backend_refuses_chunked_attention(monkeypatch) -> None:
    from packfree_plugin.attention import AttentionOptions, run_packed_attention
    from packfree_plugin.boundaries import Boundaries

    monkeypatch.setenv("PACKFREE_ATTENTION_BACKEND", "torch-varlen")
    query = torch.randn(1, 2, 6, 8)
    boundaries = Boundaries.from_cu_seqlens(torch.tensor([0, 2, 6]), batch_size=1, seq_len=6)
    with pytest.raises(ValueError, match="chunked"):
        run_packed_attention(query, query, query, boundaries, AttentionOptions(scale=1.0, causal=True, chunk=2))


def test_a_mask_pattern_packfree_does_not_compute_is_refused() -> None:
    """The mask function is replaced by the boundaries; one packfree cannot compute must raise, not vanish."""
    from transformers import masking_utils as masks

    from packfree_plugin.attention.masks import _check_pattern

    ids = torch.zeros(1, 4, dtype=torch.long)
    chunked = masks.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    remap = getattr(masks, "remap_positions_for_packed_sequence", None)  # transformers >= 5.24 wraps packed masks
    known = masks.and_masks(remap(chunked, ids) if remap is not None else chunked,
                            masks.packed_sequence_mask_function(ids))
    _check_pattern(known)  # packed samples, chunked causal: computed by packfree
    _check_pattern(masks.or_masks(masks.causal_mask_function, masks.blockwise_overlay(ids - 1)))  # no blocks: causal
    for unknown in (masks.or_masks(masks.causal_mask_function, masks.blockwise_overlay(ids)),  # one block of 4
                    lambda batch, head, q, kv: kv <= q + 1):
        with pytest.raises(ValueError, match="does not compute"):
            _check_pattern(masks.and_masks(masks.causal_mask_function, unknown))


@pytest.mark.parametrize(("model_type", "class_name", "sub_config"), [
    ("bark", "BarkSemanticModel", "semantic_config"),  # its attention picked from a table, run per sample
    ("bark", "BarkCoarseModel", "coarse_acoustics_config"),
    ("deepseek_vl_hybrid", "DeepseekVLHybridForConditionalGeneration", None),  # a SAM tower picked from a table
])
def test_models_that_pick_attention_from_a_table_build_and_are_exact(model_type: str, class_name: str,
                                                                      sub_config: str | None) -> None:
    """They failed with KeyError: 'packfree' while building (bark; deepseek_vl_hybrid's SAM vision tower)."""
    import transformers

    from packfree_plugin.gate.admission import bypassed
    from packfree_plugin.gate.proof import build_pair, prove
    from packfree_plugin.gate.shrink import tiny_config_for

    config = tiny_config_for(model_type)
    if sub_config is not None:
        config = getattr(config, sub_config)
    with bypassed():
        model, stock, implementation = build_pair(getattr(transformers, class_name), config)
        proof = prove(model, stock, stock_name=implementation, diagnose=False)
    assert proof.exact, proof.verdict()
