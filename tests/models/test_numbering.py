"""RoBERTa-family numbering, said (``packfree_plugin/quirks/numbering.py``): a packed row whose ``position_ids``
restart at 0 on a model that numbers a lone sample from ``padding_idx + 1`` warns once per model class, naming the
module, both numberings and the fix; models that number from 0, and ids that start where the model starts, stay
silent. The warning is about a real difference: 0-based packed rows are not each sample alone (stock, no ids), and
rows numbered from ``padding_idx + 1`` (``PackedCollator(position_ids_start=2)``,
``DataCollatorWithFlattening(position_ids_start=2)``) are.

References are stock transformers (``sdpa``, else ``eager``) running each sample alone without ``position_ids``,
same weights. How a model numbers a lone sample is measured on stock too: the ``k`` for which ids ``k, k + 1, ...``
give what no ids give.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import packfree_plugin
from packfree_plugin.quirks import numbering
from packfree_plugin.quirks.numbering import PositionNumberingWarning
from packfree_plugin.quirks.positions import numbering_of
from packfree_plugin.gate import bypassed
from packfree_plugin.gate.proof import main_output, prove
from packfree_plugin.gate.shrink import tiny_config_for
from packfree_plugin.packing import PackedCollator
from tooling.sweep.run import targets

LENGTHS = (6, 4, 5)
LAYERS = 3
"""More than one layer, so a warning per layer would show."""


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch) -> None:
    """Each test starts with no model class warned about yet."""
    monkeypatch.setattr(numbering, "_WARNED", set())


def _config(model_type: str):
    config = tiny_config_for(model_type)
    if hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = LAYERS
    return config


def _pair(cls: type, config, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree model, stock twin)``, same weights, eval mode (the gate bypassed: tested in tests/gate)."""
    packfree_plugin.register()
    torch.manual_seed(0)
    with bypassed():
        model = cls._from_config(copy.deepcopy(config), attn_implementation="packfree", dtype=dtype).eval()
    try:
        stock = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype).eval()
    except (ValueError, ImportError):  # no sdpa path
        stock = cls._from_config(copy.deepcopy(config), attn_implementation="eager", dtype=dtype).eval()
    stock.load_state_dict(model.state_dict())
    return model, stock


def _features(vocab: int = 100, lengths=LENGTHS) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, min(vocab, 100), (n,), generator=generator).tolist()} for n in lengths]


def _inputs(batch: dict) -> dict:
    return {name: value for name, value in batch.items() if name != "labels"}


def _run(model: torch.nn.Module, batch: dict, times: int = 1) -> tuple[torch.Tensor, list[warnings.WarningMessage]]:
    """``model`` on ``batch`` ``times`` times: its main output and every numbering warning (none filtered)."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(times):
            output = main_output(model(**_inputs(batch)))
    return output, [w for w in caught if issubclass(w.category, PositionNumberingWarning)]


def _diff_from_alone(packed: torch.Tensor, stock: torch.nn.Module, features, pooled: bool = False) -> float:
    """max |packed sample - stock on that sample alone, no position_ids| over the samples of one packed row (a
    pooled head's packed output is one row per sample)."""
    worst, start = 0.0, 0
    with torch.no_grad():
        for index, feature in enumerate(features):
            ids = torch.tensor([feature["input_ids"]])
            alone = main_output(stock(input_ids=ids))[0]
            piece = packed[index] if pooled else packed[0, start:start + ids.shape[1]]
            assert torch.isfinite(piece).all()
            worst = max(worst, float((piece - alone).abs().max()))
            start += ids.shape[1]
    return worst


def _flattening(**options) -> transformers.DataCollatorWithFlattening:
    return transformers.DataCollatorWithFlattening(return_tensors="pt", **options)


NUMBERED_FROM_PADDING_IDX = [("roberta", "RobertaForMaskedLM"), ("xlm-roberta", "XLMRobertaForMaskedLM"),
                             ("mpnet", "MPNetForMaskedLM"), ("mra", "MraForMaskedLM")]


@pytest.mark.parametrize(("model_type", "class_name"), NUMBERED_FROM_PADDING_IDX,
                         ids=[name for _, name in NUMBERED_FROM_PADDING_IDX])
def test_zero_based_ids_warn_once_per_model_class(model_type: str, class_name: str) -> None:
    """``DataCollatorWithFlattening``'s defaults and ``PackedCollator``'s, three forwards, three layers: one warning,
    naming the model class, the module, both numberings and both fixes; a second model of the same class stays
    silent, and the packed samples are numbered 0, 1, ... (not each sample alone)."""
    model, stock = _pair(getattr(transformers, class_name), _config(model_type), torch.float32)
    features = _features(model.config.vocab_size)
    packed, caught = _run(model, _flattening()(features), times=3)
    _, again = _run(model, PackedCollator()(features), times=2)
    assert len(caught) == 1 and not again, [str(w.message) for w in caught + again]
    message = str(caught[0].message)
    start = model.config.pad_token_id + 1
    embeddings = next(path for path, module in model.named_modules() if type(module).__name__.endswith("Embeddings"))
    for said in (class_name, f"{embeddings} (", "restart at 0", f"{start}, {start + 1}, ...", "0, 1, ...",
                 f"DataCollatorWithFlattening(position_ids_start={start})", f"PackedCollator(position_ids_start={start})",
                 "return_position_ids=False"):
        assert said in message, (said, message)
    assert ("padding_idx + 1 = 2" if model_type != "mra" else "position_ids buffer") in message
    twin, _ = _pair(getattr(transformers, class_name), _config(model_type), torch.float32)
    assert not _run(twin, PackedCollator()(features))[1]
    assert _diff_from_alone(packed, stock, features) > 1e-3  # the warning is about a real difference


@pytest.mark.parametrize(("model_type", "class_name", "reported"), [
    ("bert", "BertForMaskedLM", "from 0"), ("llama", "LlamaForCausalLM", "from 0"),
    ("mobilebert", "MobileBertForMaskedLM", "from 0"),  # a position adapter of its own (per sample), ids from 0
    ("xglm", "XGLMForCausalLM", "from 0"),  # a sinusoidal table with padding_idx, offset inside: ids from 0
    ("bart", "BartForCausalLM", "not by ids"),  # its learned table (offset 2 inside) is indexed by the position
])
def test_models_numbering_from_0_never_warn(model_type: str, class_name: str, reported: str) -> None:
    dtype = torch.float32 if model_type == "xglm" else torch.float64  # XGLM's stock code fails in float64
    model, stock = _pair(getattr(transformers, class_name), _config(model_type), dtype)
    features = _features(model.config.vocab_size)
    packed, caught = _run(model, PackedCollator()(features), times=2)
    assert not caught
    assert numbering_of(model).describe().startswith(reported)
    # 0-based ids are how these models number a sample alone
    assert _diff_from_alone(packed, stock, features) < (2e-5 if dtype == torch.float32 else 1e-9)


def _roberta() -> tuple[torch.nn.Module, torch.nn.Module, list[dict[str, list[int]]]]:
    model, stock = _pair(transformers.RobertaForMaskedLM, _config("roberta"))
    return model, stock, _features(model.config.vocab_size)


@pytest.mark.parametrize("collator", ["PackedCollator", "PackedCollator-rows", "DataCollatorWithFlattening",
                                      "cu_seq_lens-only"])
def test_roberta_numbered_from_padding_idx_is_exact_and_silent(collator: str) -> None:
    """Ids from ``padding_idx + 1 = 2`` (or none, boundaries from ``cu_seq_lens``): every packed sample equals stock on
    that sample alone without ids, and nothing is said."""
    model, stock, features = _roberta()
    start = model.config.pad_token_id + 1
    if collator == "DataCollatorWithFlattening":
        if "position_ids_start" not in inspect.signature(transformers.DataCollatorWithFlattening).parameters:
            pytest.skip(f"transformers {transformers.__version__}'s collator has no position_ids_start (5.24 added it)")
        batch = _flattening(position_ids_start=start)(features)
        assert batch["position_ids"][0, 0] == start
    elif collator == "PackedCollator-rows":  # two rows padded to 10 tokens: the padding spans number from 2 too
        batch = PackedCollator(rows_per_batch=2, max_tokens=10, pad_token_id=model.config.pad_token_id,
                               position_ids_start=start)(features)
        assert "attention_mask" in batch
    else:
        batch = PackedCollator(position_ids_start=start, return_position_ids=collator == "PackedCollator")(features)
    packed, caught = _run(model, batch, times=2)
    assert not caught, [str(w.message) for w in caught]
    if collator == "PackedCollator-rows":
        rows = [[0, 1], [2]]  # best fit decreasing: 6 + 4 in the first row, 5 in the second
        assert batch["input_ids"][1, :5].tolist() == features[2]["input_ids"]
        worst = max(_diff_from_alone(packed[row:row + 1], stock, [features[i] for i in members])
                    for row, members in enumerate(rows))
    else:
        worst = _diff_from_alone(packed, stock, features)
    assert worst < 1e-9, f"{collator}: max |packed - alone| = {worst:.3g}"


def test_unpacked_rows_and_the_gates_own_runs_say_nothing() -> None:
    """One sample per row with 0-based ids is not a packed row; the gate's proof and the leak audit pack 0-based ids
    on purpose and stay silent without using up the class's warning."""
    from packfree_plugin.gate.audit import audit

    model, stock, features = _roberta()
    ids = torch.tensor([features[0]["input_ids"]])
    assert not _run(model, {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None]})[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert prove(model, stock).exact
        audit(model)
    assert not [w for w in caught if issubclass(w.category, PositionNumberingWarning)]
    assert len(_run(model, PackedCollator()(features))[1]) == 1


def test_packed_collator_numbers_every_segment_from_its_start() -> None:
    batch = PackedCollator(rows_per_batch=2, max_tokens=6, position_ids_start=2)(
        [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [4, 4, 4, 4]}])
    # rows by best fit decreasing, samples in their order: [8, 9 | 4, 4, 4, 4] and [5, 6, 7 | padding]
    assert batch["position_ids"].tolist() == [[2, 3, 2, 3, 4, 5], [2, 3, 4, 2, 3, 4]]
    assert PackedCollator()([{"input_ids": [5, 6]}])["position_ids"].tolist() == [[0, 1]]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="position_ids_start"):
            PackedCollator(position_ids_start=bad)


def test_numbering_reports() -> None:
    model, _, _ = _roberta()
    assert numbering_of(model).describe().startswith("from padding_idx + 1 = 2 (roberta.embeddings: RobertaEmbeddings)")
    packfree_plugin.register()
    with bypassed():
        mamba = transformers.Mamba2ForCausalLM._from_config(tiny_config_for("mamba2"), attn_implementation="packfree")
    assert numbering_of(mamba).describe().startswith("not by ids")


# ------------------------------------------------------------------ every installed class that numbers this way
_NUMBERING_CODE = re.compile(r"create_position_ids_from_input_ids|padding_idx \+ 1|"
                             r"position_ids.*arange\(.*\)(\.expand\(.*\))? *\+ *[1-9]")
"""Source that numbers a lone sample from elsewhere than 0: fairseq's ``create_position_ids_from_input_ids``,
``padding_idx + 1``, a ``position_ids`` buffer ``arange(...) + k``."""


def _numbering_candidates() -> list[tuple[str, str]]:
    """Every sweep target (``tooling.sweep.run.targets``) of the installed transformers whose modeling
    source holds such numbering code (files read as text: nothing imported at collection)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    root = Path(transformers.__file__).parent / "models"
    found = []
    for target in targets():
        folder = root / model_type_to_module_name(target.model_type)
        if any(_NUMBERING_CODE.search(path.read_text()) for path in folder.glob("modeling_*.py")):
            found.append((target.model_type, target.cls))
    return sorted(set(found))


CANDIDATES = _numbering_candidates()


def _lone_starts(stock: torch.nn.Module, vocab: int) -> list[int]:
    """The ``k`` in 0..3 for which stock on a lone sample with ids ``k, k + 1, ...`` equals stock without ids."""
    ids = torch.randint(3, min(vocab, 100), (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = main_output(stock(input_ids=ids))
        return [k for k in range(4) if torch.allclose(
            main_output(stock(input_ids=ids, position_ids=torch.arange(k, k + 6)[None])), alone, atol=1e-5)]


def test_the_candidates_hold_the_roberta_family() -> None:
    """The source scan finds the families the issue names (so an empty or broken scan cannot pass)."""
    types = {model_type for model_type, _ in CANDIDATES}
    assert {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "roberta-prelayernorm", "mpnet",
            "luke", "ibert", "mra", "yoso", "nystromformer"} <= types


@pytest.mark.parametrize(("model_type", "class_name"), CANDIDATES, ids=[name for _, name in CANDIDATES])
def test_every_class_numbering_from_elsewhere_is_said_and_exact(model_type: str, class_name: str) -> None:
    """For every installed class whose source numbers positions from elsewhere than 0: how stock numbers a lone sample
    is measured; packfree reports that start, warns on 0-based packed ids exactly when it is not 0, and is exact
    against each sample alone when the ids start there. A class packfree refuses at load has nothing to warn about."""
    cls = getattr(transformers, class_name)
    config = tiny_config_for(model_type)
    if hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = 1  # numbering happens below the layers: one keeps the sweep fast
    try:
        model, stock = _pair(cls, config, torch.float32)
    except ValueError as refusal:  # packfree refuses the class's layers at load (Longformer): no packed row runs
        assert "packfree" in str(refusal)
        return
    starts = _lone_starts(stock, model.config.vocab_size)
    reported = numbering_of(model)
    features = _features(model.config.vocab_size)
    packed, caught = _run(model, PackedCollator()(features))
    pooled = packed.ndim == 2 and packed.shape[0] == len(features)
    if len(starts) != 1 or starts == [0]:  # numbers from 0, or positions do not come from ids (rotary, none)
        assert reported.start in (0, None) and not caught, (starts, reported, caught)
        return
    start = starts[0]
    assert reported.start == start, (reported, starts)
    assert len(caught) == 1 and f"{start}, {start + 1}, ..." in str(caught[0].message)
    exact, caught = _run(model, PackedCollator(position_ids_start=start)(features))
    assert not caught
    assert _diff_from_alone(exact, stock, features, pooled) < 2e-5
    assert _diff_from_alone(packed, stock, features, pooled) > 1e-4
