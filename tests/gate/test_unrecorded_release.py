"""A transformers release that ``gate/verified.json`` does not record is proved at load: the sweep's verdicts of another
release (the newest recorded one included) never admit a model. A recorded release admits its classes from the record,
with no proof.

The installed release is faked where packfree reads it (the distribution metadata, ``compat.version``), so these tests
hold whatever transformers is installed and whatever ran before them."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable

import pytest
from packaging.version import Version
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

from packfree_plugin import compat
from packfree_plugin.gate import admission, is_verified, proof
from packfree_plugin.gate.shrink import tiny_config_for

pytestmark = pytest.mark.usefixtures("fresh_verdicts")

RECORDS: dict[str, dict] = json.loads(admission.VERIFIED_FILE.read_text())
NEWEST_RECORDED = max(RECORDS, key=Version)

MODELS = {
    "llama": (AutoModelForCausalLM, "llama.modeling_llama", "LlamaMLP"),
    "lfm2": (AutoModelForCausalLM, "lfm2.modeling_lfm2", "Lfm2MLP"),
    "bert": (AutoModelForMaskedLM, "bert.modeling_bert", "BertOutput"),
}
"""An attention model, a hybrid (short convolutions and attention), an encoder: the auto class that loads each, and a
per-token layer of its modeling module (output ``[B, T, hidden]``) where a release could start to mix samples."""

UNRECORDED = ["5.22.0", f"{Version(NEWEST_RECORDED).major}.{Version(NEWEST_RECORDED).minor}.99", "5.99.0"]
"""Inside the declared range, none in ``verified.json``: between recorded ones, a patch release of the newest recorded
series, newer than the tested series."""


def _fake_installed(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    """Make packfree read ``release`` as the installed transformers (its "newer than tested" note said afresh)."""
    monkeypatch.setattr(compat, "version", lambda name: release)
    monkeypatch.setattr(compat, "_said_untested", set())


def _load(model_type: str) -> nn.Module:
    auto_class = MODELS[model_type][0]
    return auto_class.from_config(tiny_config_for(model_type), attn_implementation="packfree")


@pytest.fixture
def proved(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the classes the isolation proof (``proof.prove``) ran on during the test."""
    seen: list[str] = []
    original: Callable = proof.prove

    def spying(packed: nn.Module, stock: nn.Module, **kwargs) -> proof.Proof:
        seen.append(type(packed).__name__)
        return original(packed, stock, **kwargs)

    monkeypatch.setattr(proof, "prove", spying)
    return seen


def _leak_in(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """The release mixes tokens along the row in ``model_type``'s per-token layer (a running sum of its output)."""
    _, module_name, class_name = MODELS[model_type]
    layer = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
    original = layer.forward

    def leaking(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out + 0.1 * out.cumsum(1)

    monkeypatch.setattr(layer, "forward", leaking)


def test_the_unrecorded_releases_are_inside_the_range_and_unrecorded() -> None:
    for release in UNRECORDED:
        compat.check_transformers_version(release)
    assert not set(UNRECORDED) & set(RECORDS)


PROVED_CASES = [(model_type, UNRECORDED[1]) for model_type in MODELS] + [("llama", UNRECORDED[0]),
                                                                        ("llama", UNRECORDED[2])]
"""Every model on the patch release of the newest recorded series (the likeliest to be taken for it), and the other
unrecorded releases on one model."""


@pytest.mark.parametrize(("model_type", "release"), PROVED_CASES)
def test_an_unrecorded_release_proves_a_model_the_newest_record_calls_exact(monkeypatch, proved, model_type: str,
                                                                            release: str) -> None:
    _fake_installed(monkeypatch, release)
    model = _load(model_type)
    assert proved == [type(model).__name__], f"transformers {release}: the gate admitted {model_type} without a proof"
    assert not is_verified(model)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_an_unrecorded_release_refuses_a_model_its_proof_finds_leaking(monkeypatch, model_type: str) -> None:
    """The release changed a layer so that packed samples mix: the newest record still lists the class as exact, the
    proof finds the leak, and load refuses, naming the model and the layer."""
    _fake_installed(monkeypatch, UNRECORDED[1])
    _leak_in(monkeypatch, model_type)
    with pytest.raises(ValueError, match=f"packfree refuses .*model type '{model_type}'") as refused:
        _load(model_type)
    assert "outputs that cross samples in" in str(refused.value), refused.value
    assert f"({MODELS[model_type][2]})" in str(refused.value), refused.value


@pytest.mark.parametrize("release", sorted(RECORDS, key=Version))
@pytest.mark.parametrize("model_type", list(MODELS))
def test_a_recorded_release_admits_its_exact_classes_from_the_record(monkeypatch, proved, model_type: str,
                                                                     release: str) -> None:
    _fake_installed(monkeypatch, release)
    model = _load(model_type)
    assert type(model).__name__ in RECORDS[release]["exact"].get(model_type, []), "the premise: it is recorded exact"
    assert is_verified(model) and proved == []
