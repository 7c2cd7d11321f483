"""pytest plugin of ``nox -s mutants`` (``-p tests.mutants_plugin`` in pyproject's ``[tool.mutmut]``): packfree is
imported from mutmut's ``mutants/`` copy, and a mutant runs only the tests of its own module (:data:`TESTS`).

``packfree_autoload.pth`` imports ``packfree_plugin.loading.autoload`` at interpreter start, before mutmut puts
``mutants/`` first on ``sys.path``: those packages then come from the installed packfree, and every later
``import packfree_plugin.<module>`` would follow their ``__path__`` there, never reaching a mutant. Forgetting them
makes the next import read ``mutants/``. The start-up hook they installed stays on ``sys.meta_path`` and registers
the packfree imported then, the copy. Outside a mutmut run (no ``MUTANT_UNDER_TEST``) the plugin does nothing.

mutmut's stats run records every test of the selection that calls a mutated function, however deep; a mutant of a
function every forward calls would run them all. :data:`TESTS` keeps, for each mutated module, the fast tests that
judge it, and a mutant deselects the others, unless ``PACKFREE_MUTANT_ANY_TEST=1`` (to ask whether other tests
kill a survivor: ``cd mutants && MUTANT_UNDER_TEST=NAME PACKFREE_MUTANT_ANY_TEST=1 python -m pytest -p
tests.mutants_plugin FILES``, in ``.nox/mutants``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

PACKAGE = "packfree_plugin"
COPY = Path(__file__).resolve().parents[1]
"""mutmut's ``mutants/`` folder: this file runs from its copy of ``tests/``."""
MUTANT_UNDER_TEST = "MUTANT_UNDER_TEST"
"""mutmut's variable: ``module.x_function__mutmut_N`` while a mutant runs (set in the worker it forks, so read at
each run); ``stats``, ``fail`` or empty in its other runs."""

_ENTRY = ["tests/test_batch_reading.py", "tests/test_model_entry.py", "tests/mixers/test_model_hook.py",
          "tests/test_decode_steps.py", "tests/e2e/test_user_inputs.py", "tests/models/test_causal_lm.py",
          "tests/e2e/test_checkpointing.py", "tests/e2e/test_checkpointing_no_kwargs.py", "tests/test_guard_failed_forward.py",
          "tests/test_guard_id_holes.py", "tests/test_guard_own_mask.py", "tests/test_inplace_refill.py"]
_ATTENTION = ["tests/attention/test_segments.py", "tests/attention/test_varlen_routing.py",
              "tests/models/test_mask_indexing.py", "tests/test_decode_steps.py", "tests/models/test_causal_lm.py",
              "tests/test_mutant_gaps.py", "tests/attention/test_segments_backward.py", "tests/models/test_seq2seq.py",
              "tests/models/test_vlm.py", "tests/models/test_decoder_families.py", "tests/models/test_encoder_families.py",
              "tests/test_guard_decode_softcap_sinks.py", "tests/test_guard_own_mask.py"]
_OPS = ["tests/ops/test_conv.py", "tests/ops/test_ssd.py", "tests/ops/test_gated_delta.py",
        "tests/ops/test_selective_scan.py", "tests/ops/test_inplace_refill_ops.py", "tests/test_mutant_gaps.py"]
_BOUNDARIES = ["tests/test_boundaries.py", "tests/test_batch_reading.py", "tests/test_host_reads.py",
               "tests/e2e/test_user_inputs.py", "tests/attention/test_segments.py", "tests/test_mutant_gaps.py",
               "tests/test_inplace_refill.py", "tests/ops/test_inplace_refill_ops.py", "tests/models/test_seq2seq.py",
               "tests/models/test_mask_indexing.py"]
_KEPT = ["tests/test_inplace_refill.py", "tests/ops/test_inplace_refill_ops.py", "tests/test_nothing_on_tensors.py",
         "tests/test_host_reads.py", "tests/test_boundaries.py"]
TESTS: dict[str, list[str]] = {
    **{f"packfree_plugin.boundaries.{module}": _BOUNDARIES for module in ("tiling", "sources", "ids", "messages",
                                                                          "seq2seq")},
    "packfree_plugin.boundaries.forms": [*_BOUNDARIES, "tests/loss/test_reductions.py", "tests/ops/test_conv.py"],
    "packfree_plugin.boundaries.store": _KEPT,
    "packfree_plugin.forward.hook": _ENTRY,
    "packfree_plugin.forward.reading": [*_ENTRY, "tests/test_boundaries.py", "tests/test_host_reads.py"],
    "packfree_plugin.forward.context": _ENTRY,
    "packfree_plugin.attention.interface": _ATTENTION,
    "packfree_plugin.attention.masks": _ATTENTION,
    "packfree_plugin.attention.segments": _ATTENTION,
    "packfree_plugin.ops._dispatch": _OPS,
    "packfree_plugin.ops.backends": _OPS,
    "packfree_plugin.ops.conv.op": _OPS,
    "packfree_plugin.ops.gated_delta.op": _OPS,
    "packfree_plugin.ops.selective_scan.op": _OPS,
    "packfree_plugin.ops.ssd.op": _OPS,
    "packfree_plugin.gate.admission": ["tests/gate/test_admit.py", "tests/gate/test_refused.py", "tests/test_compat.py",
                                       "tests/gate/test_unrecorded_release.py", "tests/gate/test_no_copy.py"],
}
"""Mutated module -> the test files its mutants run (those of them that call the mutated function). pyproject's
``pytest_add_cli_args_test_selection`` lists their union; ``only_mutate`` lists these modules' files."""


def _installed(name: str) -> bool:
    """Whether ``name`` is packfree or one of its modules, imported from somewhere other than the copy."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return False
    origin = getattr(sys.modules[name], "__file__", None)
    return origin is None or COPY not in Path(origin).resolve().parents


if MUTANT_UNDER_TEST in os.environ:
    for stale in [name for name in sys.modules if _installed(name)]:
        del sys.modules[stale]


def pytest_configure(config: pytest.Config) -> None:
    """While a mutant runs, forget what the unmutated code built: mutmut forks each mutant's run from the process
    that ran the clean tests, so a model pair cached there (with the layer facts kept on its modules), a gate
    verdict or a compiled graph would serve the mutant's tests what the original code computed, and the mutant would
    never run (the chunk size of Llama 4's layers, read once per layer, survived so)."""
    if "__mutmut_" not in os.environ.get(MUTANT_UNDER_TEST, ""):
        return
    import torch._dynamo

    torch._dynamo.reset()
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("tests", PACKAGE):
            for value in list(vars(module).values()):
                clear = getattr(value, "cache_clear", None)  # functools.cache / lru_cache
                if callable(clear):
                    clear()
    admission = sys.modules.get(f"{PACKAGE}.gate.admission")
    if admission is not None:
        admission._verdicts.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """While a mutant runs, deselect the tests outside its module's :data:`TESTS`."""
    mutant = os.environ.get(MUTANT_UNDER_TEST, "")
    if "__mutmut_" not in mutant or os.environ.get("PACKFREE_MUTANT_ANY_TEST") == "1":
        return
    module = mutant.rpartition(".")[0]
    files = TESTS[module]
    kept = [item for item in items if item.nodeid.split("::")[0] in files]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
