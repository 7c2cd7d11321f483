"""Shared gate fixtures."""

from __future__ import annotations

import pytest
import torch
from transformers import BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


@pytest.fixture
def fresh_verdicts(monkeypatch) -> None:
    """packfree registered, no verdict remembered from another test, and the trust switch off."""
    import packfree_plugin
    from packfree_plugin.gate import TRUST_ENV
    from packfree_plugin.gate import admission

    packfree_plugin.register()
    monkeypatch.setattr(admission, "_verdicts", {})
    monkeypatch.delenv(TRUST_ENV, raising=False)


@pytest.fixture
def newest_record(monkeypatch) -> None:
    """Where ``verified.json`` has no entry for the installed transformers (a release the sweep has not run on yet),
    the gate reads the newest entry instead, so that a class the sweep proved there counts as verified."""
    import json

    import transformers
    from packaging.version import Version

    from packfree_plugin.gate import admission

    records = json.loads(admission.VERIFIED_FILE.read_text())
    if transformers.__version__ not in records:
        newest = max(records, key=Version)
        monkeypatch.setattr(admission, "_verified", lambda version: records[newest])


@pytest.fixture
def roberta_without_positions(monkeypatch) -> None:
    """RoBERTa as packfree ran it before its numbering quirk (``classes.py``, ``quirks/positions.py``): packed 0-based
    ``position_ids`` shift its positions (numbered from ``padding_idx + 1``), so it is wrong although no sample
    leaks into another: the gate's example of such a model. Not verified, with a fresh verdict cache."""
    from packfree_plugin.classes import CLASSES
    from packfree_plugin.gate import admission

    monkeypatch.delitem(CLASSES, "RobertaEmbeddings")
    monkeypatch.setattr(admission, "_verdicts", {})
    monkeypatch.setattr(admission, "is_verified", lambda model: False)


class RowPoolingBert(BertPreTrainedModel):
    """A remote-code head packfree knows nothing about: it pools [CLS] once per row."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.bert = BertModel(config)
        self.score = torch.nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, **kwargs) -> SequenceClassifierOutput:
        return SequenceClassifierOutput(logits=self.score(self.bert(input_ids, **kwargs).pooler_output))
