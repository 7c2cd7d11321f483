"""Per-segment positions (``packfree_plugin/quirks/positions.py``): models that number positions themselves
(from ``padding_idx + 1``, from the input's shape, from a buffer) or mix neighbouring tokens in their embeddings
give each packed sample what the model computes for that sample alone, and ordinary unpacked use stays stock.

References are each sample run alone on stock ``sdpa`` (``eager`` where the model has no sdpa path), float64,
same weights; tiny configs come from the gate's :func:`~packfree_plugin.gate.shrink.tiny_config_for`."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import packfree_plugin
from packfree_plugin.quirks.install import apply_quirks
from packfree_plugin.classes import CLASSES, entry_of
from packfree_plugin.gate import bypassed
from packfree_plugin.gate.proof import main_output
from packfree_plugin.gate.shrink import tiny_config_for
from tests.conftest import assert_close

ROWS = ((6, 9), (5, 7, 3))
"""Sample lengths of the two packed rows (15 tokens each)."""

TARGETS = [
    # positions from padding_idx + 1
    ("roberta", "RobertaForMaskedLM"), ("roberta", "RobertaForCausalLM"), ("xlm-roberta", "XLMRobertaModel"),
    ("camembert", "CamembertForMaskedLM"), ("data2vec-text", "Data2VecTextForCausalLM"),
    ("roberta-prelayernorm", "RobertaPreLayerNormForMaskedLM"), ("xlm-roberta-xl", "XLMRobertaXLModel"),
    ("xmod", "XmodForMaskedLM"), ("roberta", "RobertaForTokenClassification"),
    # ... whose encoders run per sample under their own attention code (mixers/encoders.py)
    ("ibert", "IBertForMaskedLM"), ("luke", "LukeForMaskedLM"), ("mpnet", "MPNetForMaskedLM"),
    # positions from a buffer
    ("mra", "MraForMaskedLM"), ("nystromformer", "NystromformerForMaskedLM"), ("yoso", "YosoForMaskedLM"),
    # positions from the shape (learned with an offset, sinusoidal), decoders and encoder-decoders
    ("bart", "BartForConditionalGeneration"), ("bart", "BartForCausalLM"), ("mbart", "MBartModel"),
    ("plbart", "PLBartForCausalLM"), ("marian", "MarianForCausalLM"), ("pegasus", "PegasusForCausalLM"),
    ("blenderbot", "BlenderbotForCausalLM"), ("blenderbot-small", "BlenderbotSmallForCausalLM"),
    # ... with attention that adds a dense mask itself
    ("trocr", "TrOCRForCausalLM"), ("xglm", "XGLMForCausalLM"), ("mvp", "MvpForConditionalGeneration"),
    ("bigbird_pegasus", "BigBirdPegasusForConditionalGeneration"), ("bigbird_pegasus", "BigBirdPegasusForCausalLM"),
    # ... numbered from the [B, codebooks, T] ids (one codebook here) or the embeddings: MusicGen's decoders
    ("musicgen_decoder", "MusicgenForCausalLM"), ("musicgen_melody_decoder", "MusicgenMelodyForCausalLM"),
    # ... a table sliced from the cache length (Whisper's decoder, which takes no position_ids as a CausalLM)
    ("whisper", "WhisperForCausalLM"),
    # token shift
    ("mobilebert", "MobileBertForMaskedLM"),
]
MODES = ("position_ids", "cu_seq_lens", "running_ids")


FLOAT32_ONLY = {"mra", "xglm"}
"""Types whose stock code fails in float64 (MRA's kernels cast to float32; XGLM's attention clamps with a float32
``finfo(float64).min``): tested in float32."""


def _build(cls: type, config, implementation: str) -> torch.nn.Module:
    dtype = torch.float32 if config.model_type in FLOAT32_ONLY else torch.float64
    return cls._from_config(copy.deepcopy(config), attn_implementation=implementation, dtype=dtype).eval()


def _pair(model_type: str, class_name: str, config=None) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """``(packfree model, stock twin, stock implementation)``, float64, same weights. The gate is bypassed: what
    is tested here is the packed result against each sample alone (the gate's proof is tested in tests/gate)."""
    packfree_plugin.register()
    cls = getattr(transformers, class_name)
    config = config if config is not None else tiny_config_for(model_type)
    torch.manual_seed(0)
    with bypassed():
        model = _build(cls, config, "packfree")
    try:
        stock, implementation = _build(cls, config, "sdpa"), "sdpa"
    except (ValueError, ImportError):  # no sdpa path
        stock, implementation = _build(cls, config, "eager"), "eager"
    stock.load_state_dict(model.state_dict())
    return model, stock, implementation


def _samples(config, *, seed: int = 0) -> list[list[torch.Tensor]]:
    """Token ids per row and sample; one sample holds a padding token in its middle (numbered ``padding_idx``
    by RoBERTa-style models, skipped by mBART's shift when it looks for the last token)."""
    generator = torch.Generator().manual_seed(seed)
    rows = [[torch.randint(3, 100, (n,), generator=generator) for n in lengths] for lengths in ROWS]
    rows[0][1][4] = config.pad_token_id
    return rows


def _packed(rows: list[list[torch.Tensor]], mode: str, *,
            padding: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Packed rows: boundaries from restarting ``position_ids``, from ``cu_seq_lens`` alone, or from ``cu_seq_lens``
    next to ``position_ids`` that run on across the row (``running_ids``: the boundaries decide the samples, the ids
    their positions). ``padding``:
    ``(length, pad id)`` of a padding span ending every row, marked by an ``attention_mask``
    (``position_ids`` mode)."""
    if padding is not None:
        length, pad_id = padding
        batch = _packed([[*row, torch.full((length,), pad_id)] for row in rows], mode)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][:, -length:] = 0
        return batch
    batch = {"input_ids": torch.stack([torch.cat(row) for row in rows])}
    lengths = [len(sample) for row in rows for sample in row]
    if mode == "position_ids":
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in rows])
    else:
        if mode == "running_ids":
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
        cu_seq_lens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        batch.update(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max(lengths),
                     max_length_k=max(lengths))
    return batch


def _tolerance(model: torch.nn.Module, implementation: str) -> float:
    if model.dtype == torch.float32:
        return 2e-5
    return 1e-9 if implementation == "sdpa" else 1e-6  # stock eager softmaxes in float32


def _alone(batch: dict[str, torch.Tensor], row: int, start: int, sample: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inputs of ``sample`` (at ``start`` in ``row`` of the packed ``batch``) run alone: its ids and, where the
    packed row carried ``position_ids``, its own slice of them (what stock gives a sample called with those ids)."""
    inputs = {"input_ids": sample[None]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"][row, start:start + len(sample)][None]
    return inputs


def _max_diff_from_alone(model: torch.nn.Module, stock: torch.nn.Module, rows, mode: str, *,
                         padding: tuple[int, int] | None = None) -> float:
    batch = _packed(rows, mode, padding=padding)
    with torch.no_grad():
        packed = main_output(model(**batch))
        worst = 0.0
        for row, samples in enumerate(rows):
            start = 0
            for sample in samples:
                alone = main_output(stock(**_alone(batch, row, start, sample)))[0]
                piece = packed[row, start:start + len(sample)]
                assert torch.isfinite(piece).all()
                worst = max(worst, float((piece - alone).abs().max()))
                start += len(sample)
    return worst


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("model_type", "class_name"), TARGETS, ids=[name for _, name in TARGETS])
def test_packed_samples_equal_each_sample_alone(model_type: str, class_name: str, mode: str) -> None:
    model, stock, implementation = _pair(model_type, class_name)
    diff = _max_diff_from_alone(model, stock, _samples(model.config), mode)
    assert diff < _tolerance(model, implementation), f"{class_name} ({mode}): max |packed - alone| = {diff:.3g}"


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("roberta", "RobertaModel"), ("mra", "MraModel"), ("bart", "BartForCausalLM"),
    ("mobilebert", "MobileBertModel"), ("bart", "BartModel"), ("musicgen_decoder", "MusicgenForCausalLM"),
    ("whisper", "WhisperForCausalLM"),
])
def test_the_adapters_make_the_difference(model_type: str, class_name: str) -> None:
    """``cu_seq_lens`` without position ids: exact with the position adapters, and wrong once they (and BART's
    per-sample decoder inputs) are taken off again, so the comparison can fail."""
    model, stock, implementation = _pair(model_type, class_name)
    rows = _samples(model.config)
    assert _max_diff_from_alone(model, stock, rows, "cu_seq_lens") < _tolerance(model, implementation)
    assert apply_quirks(model)
    for module in model.modules():
        if entry_of(type(module)).numbering is not None:
            del module.__dict__["forward"]
        hook = module.__dict__.pop("_packfree_decoder_inputs_hook", None)
        if hook is not None:
            hook.remove()
    assert _max_diff_from_alone(model, stock, rows, "cu_seq_lens") > 1e-3


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("roberta", "RobertaForCausalLM"), ("xmod", "XmodForMaskedLM"), ("mra", "MraModel"),
    ("mobilebert", "MobileBertModel"), ("nystromformer", "NystromformerForMaskedLM"),
])
def test_the_callers_position_ids_are_honoured(model_type: str, class_name: str, monkeypatch) -> None:
    """Packed rows with the caller's ``position_ids`` (restarting at 0 in every sample, and running on across the row
    beside ``cu_seq_lens``): each sample equals stock run alone with its own slice of those ids (transformers'
    padding-free tests pass RoBERTa 0-based ids). Numbering the samples as if no ids had been passed (packfree's
    earlier rule, planted here) departs from that reference, so the comparison can fail."""
    from packfree_plugin.quirks import positions

    model, stock, implementation = _pair(model_type, class_name)
    rows = _samples(model.config)
    for mode in ("position_ids", "running_ids"):
        assert _max_diff_from_alone(model, stock, rows, mode) < _tolerance(model, implementation), mode
    monkeypatch.setattr(positions, "_callers_ids", lambda position_ids, boundaries: False)
    assert _max_diff_from_alone(model, stock, rows, "running_ids") > 1e-3


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("roberta", "RobertaForMaskedLM"), ("bart", "BartForConditionalGeneration"),
    ("mobilebert", "MobileBertForMaskedLM"), ("xglm", "XGLMForCausalLM"), ("mvp", "MvpForConditionalGeneration"),
])
def test_packed_rows_ending_in_padding(model_type: str, class_name: str) -> None:
    """Packed rows padded to a common length (pad tokens, attention_mask 0): every sample still equals itself
    alone."""
    model, stock, implementation = _pair(model_type, class_name)
    diff = _max_diff_from_alone(model, stock, _samples(model.config), "position_ids",
                                padding=(4, model.config.pad_token_id))
    assert diff < _tolerance(model, implementation)


UNPACKED = [("roberta", "RobertaForMaskedLM"), ("mra", "MraModel"), ("bart", "BartForCausalLM"),
            ("xglm", "XGLMForCausalLM"), ("trocr", "TrOCRForCausalLM"), ("mvp", "MvpForConditionalGeneration"),
            ("mobilebert", "MobileBertForMaskedLM"), ("marian", "MarianForCausalLM"),
            ("musicgen_decoder", "MusicgenForCausalLM"), ("musicgen_melody_decoder", "MusicgenMelodyForCausalLM")]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize(("model_type", "class_name"), UNPACKED, ids=[name for _, name in UNPACKED])
def test_unpacked_batches_equal_stock(model_type: str, class_name: str, side: str) -> None:
    """One sample per row: no position_ids; a padded batch with its attention_mask (padding tokens are the pad
    id, as tokenizers make them). The adapters stay out of the way, so outputs equal stock's."""
    model, stock, implementation = _pair(model_type, class_name)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 100, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate((10, 7, 4)):
        padding = slice(length, None) if side == "right" else slice(0, 10 - length)
        mask[row, padding] = 0
        ids[row, padding] = model.config.pad_token_id
    # an encoder-decoder gets its own decoder inputs, as in seq2seq training
    decoder = {"decoder_input_ids": ids[:, :6]} if model.config.is_encoder_decoder else {}
    with torch.no_grad():
        for inputs in ({"input_ids": ids[:1]}, {"input_ids": ids, "attention_mask": mask}):
            decoder_inputs = {name: value[:len(inputs["input_ids"])] for name, value in decoder.items()}
            ours = main_output(model(**inputs, **decoder_inputs))
            theirs = main_output(stock(**inputs, **decoder_inputs))
            # compare every real token (a decoder's outputs are all real: its inputs carry no padding)
            kept = torch.ones(ours.shape[:2], dtype=torch.bool) if decoder else \
                inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
            assert_close(ours[kept], theirs[kept], atol=_tolerance(model, implementation), rtol=0,
                         what=f"{class_name} {sorted(inputs)}")


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("xglm", "XGLMForCausalLM"), ("trocr", "TrOCRForCausalLM"), ("bart", "BartForCausalLM"),
    ("roberta", "RobertaForCausalLM"), ("pegasus", "PegasusForCausalLM"),
])
def test_generate_with_left_padding_equals_stock(model_type: str, class_name: str) -> None:
    config = tiny_config_for(model_type)
    config.is_decoder = True  # RoBERTa's causal LM
    model, stock, implementation = _pair(model_type, class_name, config)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 100, (2, 7), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = config.pad_token_id
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=config.pad_token_id)
    with torch.no_grad():
        ours, theirs = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits)):
        assert_close(a, b, atol=_tolerance(model, implementation), rtol=0, what=f"{class_name} step {step}")


class _Stop(Exception):
    """Raised by a forward hook to end a forward once the module under test has run."""


def _embeddings(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output of ``model.embeddings`` in a forward on ``inputs`` (the forward stops right after it)."""
    captured = []

    def stop(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)  # IBert: (embeddings, scaling)
        raise _Stop

    handle = model.embeddings.register_forward_hook(stop)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("model_type", "class_name"), [
    ("ibert", "IBertModel"), ("luke", "LukeModel"), ("mpnet", "MPNetModel"),
])
def test_embeddings_of_models_with_their_own_attention(model_type: str, class_name: str, mode: str) -> None:
    """These models' attention is made exact elsewhere; their embeddings (positions from padding_idx + 1) are
    exact per sample here. (Longformer, which pads the row to a multiple of its window, is refused at load.)"""
    model, stock, _ = _pair(model_type, class_name)
    rows = _samples(model.config)
    batch = _packed(rows, mode)
    packed = _embeddings(model, batch)
    for row, samples in enumerate(rows):
        start = 0
        for sample in samples:
            alone = _embeddings(stock, _alone(batch, row, start, sample))[0, :len(sample)]
            assert_close(packed[row, start:start + len(sample)], alone, atol=1e-12, rtol=0,
                         what=f"{class_name} row {row} at {start}")
            start += len(sample)


def test_a_packed_row_longer_than_the_position_table() -> None:
    """Shape-based positions run for the longest sample, not for the row: a row of 22 tokens packs two samples
    into a model with 16 learned positions (stock cannot run the row at all)."""
    config = tiny_config_for("bart")
    config.max_position_embeddings = 16
    model, stock, implementation = _pair("bart", "BartForCausalLM", config)
    generator = torch.Generator().manual_seed(7)
    rows = [[torch.randint(3, 100, (12,), generator=generator), torch.randint(3, 100, (10,), generator=generator)]]
    with pytest.raises(IndexError):
        stock(**_packed(rows, "position_ids"))
    assert _max_diff_from_alone(model, stock, rows, "position_ids") < _tolerance(model, implementation)


def test_bigbird_pegasus_refuses_block_sparse_attention_on_a_packed_row() -> None:
    """Rows longer than (5 + 2 * num_random_blocks) * block_size tokens (44 in the tiny config) keep BigBird-Pegasus'
    block-sparse encoder attention, which attends random blocks of the whole row: refused, naming the layer."""
    model, _, _ = _pair("bigbird_pegasus", "BigBirdPegasusModel")
    generator = torch.Generator().manual_seed(9)
    rows = [[torch.randint(3, 100, (n,), generator=generator) for n in (30, 26)]]
    with pytest.raises(ValueError, match="BigBirdPegasusEncoderAttention.*block-sparse"):
        model(**_packed(rows, "position_ids"))


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("bart", "BartForConditionalGeneration"), ("mbart", "MBartForConditionalGeneration"),
    ("mvp", "MvpForConditionalGeneration"), ("pegasus", "PegasusForConditionalGeneration"),
    ("blenderbot", "BlenderbotForConditionalGeneration"),
    ("blenderbot-small", "BlenderbotSmallForConditionalGeneration"),
])
def test_packed_seq2seq_with_labels_equals_each_sample_alone(model_type: str, class_name: str) -> None:
    """Labels of the packed row's shape: each sample's decoder inputs are its own labels shifted (never the
    previous sample's last label), so logits and loss equal each sample alone. The label contract puts -100
    at every sample's first token."""
    model, stock, implementation = _pair(model_type, class_name)
    rows = _samples(model.config)
    generator = torch.Generator().manual_seed(11)
    labels = [[torch.randint(3, 100, (len(sample),), generator=generator) for sample in row] for row in rows]
    for row in labels:
        for sample in row:
            sample[0] = -100
    batch = {**_packed(rows, "position_ids"), "labels": torch.stack([torch.cat(row) for row in labels])}
    with torch.no_grad():
        packed = model(**batch)
        alone = [stock(input_ids=sample[None], labels=label[None])
                 for row, label_row in zip(rows, labels) for sample, label in zip(row, label_row)]
    pieces = [piece for row in range(len(rows)) for piece in packed.logits[row].split([len(s) for s in rows[row]])]
    tolerance = _tolerance(model, implementation)
    for index, (piece, out) in enumerate(zip(pieces, alone)):
        assert_close(piece, out.logits[0], atol=tolerance, rtol=0, what=f"{class_name} sample {index}")
    counts = torch.tensor([float((label != -100).sum()) for row in labels for label in row])
    expected = (torch.stack([out.loss for out in alone]) * counts).sum() / counts.sum()
    assert_close(packed.loss, expected, atol=tolerance, rtol=0, what=f"{class_name} loss")


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("roberta", "RobertaForMaskedLM"), ("mobilebert", "MobileBertForMaskedLM"), ("xglm", "XGLMForCausalLM"),
    ("bigbird_pegasus", "BigBirdPegasusForCausalLM"),
])
def test_the_gate_admits_them_at_load(model_type: str, class_name: str) -> None:
    """Loaded with packfree and no opt-out, each class passes the gate's proof on a tiny copy (it was refused)."""
    packfree_plugin.register()
    getattr(transformers, class_name)._from_config(tiny_config_for(model_type), attn_implementation="packfree")


def test_the_gates_proof_gives_each_sample_its_packed_ids(monkeypatch) -> None:
    """The gate's proof compares a packed row that carries ``position_ids`` with each sample run alone with its slice
    of them (and a row without ids with samples alone without ids): RoBERTa is exact in every mode, and an adapter
    that ignores the caller's ids (planted) is caught in the first mode, naming the position embedding."""
    from packfree_plugin.quirks import positions
    from packfree_plugin.gate.proof import MODES, build_pair, prove

    with bypassed():
        model, stock, implementation = build_pair(transformers.RobertaForMaskedLM, tiny_config_for("roberta"))
    assert prove(model, stock, stock_name=implementation).exact
    monkeypatch.setattr(positions, "_callers_ids", lambda position_ids, boundaries: False)
    proof = prove(model, stock, stock_name=implementation)
    assert proof.kind == "wrong" and proof.mode == MODES[0] and proof.max_diff > 1e-2
    assert "position_embeddings" in proof.wrong_modules[0]


def test_kosmos_2_5s_text_positions_from_padding_idx(monkeypatch) -> None:
    """Kosmos-2.5's text decoder numbers a lone sample from ``padding_idx + 1`` (fairseq-style sinusoidal positions):
    the gate's proof of text-only packed rows against each sample alone on stock is exact in every mode, and without
    the position adapter the rows without ids (``cu_seq_lens`` alone) are wrong, so the proof can fail. (It was
    refused at load before.)"""
    from packfree_plugin.gate.proof import build_pair, prove

    config = tiny_config_for("kosmos-2.5")
    with bypassed():
        model, stock, implementation = build_pair(transformers.Kosmos2_5ForConditionalGeneration, config)
    proof = prove(model, stock, stock_name=implementation)
    assert proof.exact, proof.summary()
    monkeypatch.delitem(CLASSES, "Kosmos2_5TextSinusoidalPositionalEmbedding")
    with bypassed():
        model, stock, implementation = build_pair(transformers.Kosmos2_5ForConditionalGeneration, config)
    proof = prove(model, stock, stock_name=implementation, diagnose=False)
    assert proof.kind == "wrong" and proof.mode == "cu_seq_lens" and proof.max_diff > 1e-2


@pytest.mark.parametrize(("model_type", "class_name", "overrides"), [
    ("trocr", "TrOCRForCausalLM", {"use_learned_position_embeddings": False}),  # positions count non-padding tokens
    ("mvp", "MvpForConditionalGeneration", {"use_prompt": True}),  # prompt keys prepended to every attention
], ids=["TrOCR-sinusoidal", "MVP-prompts"])
def test_config_variants(model_type: str, class_name: str, overrides: dict) -> None:
    config = tiny_config_for(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    model, stock, implementation = _pair(model_type, class_name, config)
    for mode in ("position_ids", "running_ids"):
        assert _max_diff_from_alone(model, stock, _samples(config), mode) < _tolerance(model, implementation)


@pytest.mark.parametrize(("model_type", "class_name"), [
    ("roberta", "RobertaForMaskedLM"), ("mobilebert", "MobileBertForMaskedLM"),
    ("bart", "BartForConditionalGeneration"), ("mvp", "MvpForConditionalGeneration"),
])
def test_packed_gradients_equal_each_sample_alone(model_type: str, class_name: str) -> None:
    """The packed row's loss and every parameter's gradient equal those of the samples run alone, each loss
    weighted by its count of labelled tokens (the packed loss is the mean over all of them)."""
    model, stock, implementation = _pair(model_type, class_name)
    rows = _samples(model.config)
    generator = torch.Generator().manual_seed(13)
    labels = [[torch.randint(3, 100, (len(sample),), generator=generator) for sample in row] for row in rows]
    for row in labels:
        for sample in row:
            sample[0] = -100  # the label contract of a packed row
    batch = {**_packed(rows, "cu_seq_lens"), "labels": torch.stack([torch.cat(row) for row in labels])}
    packed_loss = model(**batch).loss
    packed_loss.backward()
    pairs = [(sample, label) for row, label_row in zip(rows, labels) for sample, label in zip(row, label_row)]
    counts = torch.tensor([float((label != -100).sum()) for _, label in pairs])
    losses = torch.stack([stock(input_ids=sample[None], labels=label[None]).loss for sample, label in pairs])
    alone_loss = (losses * counts).sum() / counts.sum()
    alone_loss.backward()
    tolerance = _tolerance(model, implementation)
    assert_close(packed_loss.detach(), alone_loss.detach(), atol=tolerance, rtol=0, what=f"{class_name} loss")
    expected = dict(stock.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.grad is not None or expected[name].grad is not None:
            assert_close(parameter.grad, expected[name].grad, atol=tolerance, rtol=0, what=f"{class_name} {name}")
