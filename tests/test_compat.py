"""The version contract: what pyproject declares is what load enforces, and an untested release is refused."""

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
def test_untested_releases_are_refused_naming_the_range(installed: str) -> None:
    with pytest.raises(ValueError, match=f"supports transformers {compat.TRANSFORMERS_RANGE}.*{installed}"):
        compat.check_transformers_version(installed)


def test_the_installed_release_is_supported() -> None:
    compat.check_transformers_version()


def test_loading_on_an_untested_release_is_refused(monkeypatch) -> None:
    packfree_plugin.register()
    monkeypatch.setattr(compat, "version", lambda name: "5.0.0")
    with pytest.raises(ValueError, match="packfree supports transformers"):
        AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree", dtype=torch.float64)


def test_the_compat_session_runs_the_declared_oldest_release() -> None:
    noxfile = (ROOT / "noxfile.py").read_text()
    assert f'OLDEST_TRANSFORMERS = "{compat.OLDEST_TRANSFORMERS}"' in noxfile
