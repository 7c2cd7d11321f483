"""Shared gate fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def roberta_without_positions(monkeypatch) -> None:
    """RoBERTa as packfree ran it before its position adapter (``adapters/positions.py``): packed 0-based
    ``position_ids`` shift its positions (numbered from ``padding_idx + 1``), so it is wrong although no sample
    leaks into another: the gate's example of such a model. Not verified, with a fresh verdict cache."""
    from packfree_plugin.adapters.positions import POSITION_ADAPTERS
    from packfree_plugin.gate import admission

    monkeypatch.delitem(POSITION_ADAPTERS, "RobertaEmbeddings")
    monkeypatch.setattr(admission, "_verdicts", {})
    monkeypatch.setattr(admission, "is_verified", lambda model: False)
