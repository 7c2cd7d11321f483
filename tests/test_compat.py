"""The version contract: what pyproject declares is what load enforces, a release outside it is refused, a newer one
inside it is proved at load and said once, and the README, noxfile and docs state the same releases."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import packfree_plugin
from packfree_plugin import compat
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_enforced_range() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{compat.TRANSFORMERS_RANGE}" in dependencies


@pytest.mark.parametrize("installed", ["5.0.0", "5.19.0", "6.0.0"])
def test_releases_outside_the_range_are_refused_naming_the_range(installed: str) -> None:
    with pytest.raises(ValueError, match=f"supports transformers {compat.TRANSFORMERS_RANGE}.*{installed}"):
        compat.check_transformers_version(installed)


def test_the_installed_release_is_supported() -> None:
    compat.check_transformers_version()


def test_a_newer_release_inside_the_range_is_said_once_and_every_model_proved(monkeypatch, caplog) -> None:
    """A release newer than the tested ones loads; packfree says so once, naming it, and the gate proves the model
    (verified.json records tested releases only). The release is faked where packfree reads it, the distribution
    metadata (``transformers.__version__`` is on whichever module object transformers last put in ``sys.modules``)."""
    from packfree_plugin.gate import admission

    newer = "5.99.0"
    assert compat.is_untested(newer) and not compat.is_untested(compat.NEWEST_TESTED_TRANSFORMERS)
    packfree_plugin.register()
    monkeypatch.setattr(compat, "version", lambda name: newer)
    monkeypatch.setattr(compat, "_said_untested", set())  # said once in this test, whatever ran before
    monkeypatch.setattr(admission, "_verdicts", {})
    with caplog.at_level("WARNING", logger="packfree"):
        models = [AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree",
                                                   dtype=torch.float64) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if newer in r.getMessage()]
    assert len(said) == 1 and "proved exact" in said[0], said
    assert not admission.is_verified(models[0])
    assert list(admission._verdicts.values()) == [None], "the gate did not prove the model, or refused it"


def test_the_readme_docs_and_noxfile_state_the_tested_releases() -> None:
    tested = compat.TESTED_TRANSFORMERS.replace(" - ", "–")
    newest = compat.NEWEST_TESTED_TRANSFORMERS
    assert f"tested on {tested}" in (ROOT / "README.md").read_text()
    assert f"transformers{compat.TRANSFORMERS_RANGE}" in (ROOT / "README.md").read_text().replace("`", "")
    assert compat.TESTED_TRANSFORMERS.replace(" - ", " to ") in (ROOT / "docs" / "loading.md").read_text()
    assert f'NEWEST_TRANSFORMERS = "{newest}"' in (ROOT / "noxfile.py").read_text()


def test_loading_on_an_untested_release_is_refused(monkeypatch) -> None:
    packfree_plugin.register()
    monkeypatch.setattr(compat, "version", lambda name: "5.0.0")
    with pytest.raises(ValueError, match="packfree supports transformers"):
        AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree", dtype=torch.float64)


def test_the_compat_session_runs_the_declared_oldest_release() -> None:
    noxfile = (ROOT / "noxfile.py").read_text()
    assert f'OLDEST_TRANSFORMERS = "{compat.OLDEST_TRANSFORMERS}"' in noxfile
