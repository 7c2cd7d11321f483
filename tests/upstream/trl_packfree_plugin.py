"""pytest plugin for TRL's own trainer tests (``test_dpo_trainer.py``, ``test_reward_trainer.py``,
``test_grpo_trainer.py`` of a TRL checkout), run offline on the CPU, once stock and once with packfree.

Loaded into a pytest run inside the checkout (see ``tests/upstream/trl_run.py``), never into packfree's own
suite; it edits none of TRL's files. Before any test module imports, it

- hands ``datasets.load_dataset`` the local stand-ins of :mod:`trl_offline` (the models come from the hub cache
  the runner built there, with ``HF_HUB_OFFLINE=1``);
- makes every ``from_pretrained`` that asks for no attention implementation, or for FlashAttention (which the
  padding-free tests ask for, and which a CPU lacks), load ``PACKFREE_TRL_IMPL``; under ``packfree`` any
  explicit ``sdpa`` / ``eager`` too, so every model the trainers see is packfree's;
- lifts the FlashAttention / kernels / Ampere skips of the padding-free tests (on the CPU they would skip under
  both implementations, hiding the very tests this run is for);
- under ``packfree``: replaces ``trl.DPOTrainer`` / ``RewardTrainer`` / ``GRPOTrainer`` with packfree's
  ``Packed*`` ones and turns ``DPOConfig.padding_free`` on, so every DPO, reward and GRPO scoring forward of the
  tests runs packed;
- writes one JSON line per test (``{"test", "outcome", "detail", "packed_batches"}``: how many packed batches
  packfree built during it) to ``PACKFREE_TRL_RESULTS``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

import trl_offline

IMPL = os.environ.get("PACKFREE_TRL_IMPL", "sdpa")
RESULTS = os.environ.get("PACKFREE_TRL_RESULTS")
PACKED_CALLS = [0]  # packed batches built during the current test (packfree run): proof the packed path ran
LIFTED_SKIP_WORDS = ("flash", "kernels", "ampere")
# Availability checks the checkout's ``testing_utils.py`` imports that the installed TRL no longer has: each
# reports the package absent, so the tests needing it skip under every implementation.
ABSENT_IN_INSTALLED = ("is_joblib_available",)


def _patch_from_pretrained() -> None:
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        kwargs["attn_implementation"] = trl_offline.substitute_attention(kwargs.get("attn_implementation"), IMPL)
        return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _swap_trainers() -> None:
    import trl

    from packfree_plugin.integrations import trl as packed
    from packfree_plugin.loading.register import register

    register()
    trl.DPOTrainer = packed.PackedDPOTrainer
    trl.RewardTrainer = packed.PackedRewardTrainer
    trl.GRPOTrainer = packed.PackedGRPOTrainer
    original = trl.DPOConfig.__post_init__

    def post_init(self) -> None:
        self.padding_free = True
        original(self)

    trl.DPOConfig.__post_init__ = post_init
    build = packed.PackedRows.of.__func__

    def counted(cls, *args: Any, **kwargs: Any):
        PACKED_CALLS[0] += 1
        return build(cls, *args, **kwargs)

    packed.PackedRows.of = classmethod(counted)


def pytest_configure(config: pytest.Config) -> None:
    import datasets

    import_utils = importlib.import_module("trl.import_utils")
    for name in ABSENT_IN_INSTALLED:
        if not hasattr(import_utils, name):
            setattr(import_utils, name, lambda: False)

    datasets.load_dataset = trl_offline.load_dataset
    _patch_from_pretrained()
    if IMPL == "packfree":
        _swap_trainers()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.own_markers = [mark for mark in item.own_markers if not (
            mark.name == "skipif" and any(word in str(mark.kwargs.get("reason", "")).lower()
                                          for word in LIFTED_SKIP_WORDS))]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if RESULTS is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome
        detail = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = crash.message.splitlines()[0][:300] if crash is not None else str(report.longrepr)[-300:]
        elif report.skipped and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2])[:200]
        with Path(RESULTS).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"test": report.nodeid, "outcome": outcome, "detail": detail,
                                     "packed_batches": PACKED_CALLS[0]}) + "\n")
        PACKED_CALLS[0] = 0
