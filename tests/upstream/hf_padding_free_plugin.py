"""pytest plugin for transformers' own test tree: its FlashAttention padding-free tests, run on the CPU with another
attention implementation in FlashAttention's place, one result per (test class, model class, test).

Loaded into a pytest run inside a checkout of transformers' ``tests/`` + ``utils/`` folders (see
``tests/upstream/run.py``), never into packfree's own suite. It edits none of their files; it

- lifts the GPU / FlashAttention / slow requirements of the selected tests (their decorators become no-ops
  before any test module imports them), keeping every ``unittest.skip`` a test file gives for its own model;
- replaces each selected test with one item per generative model class of its test class, seeded the same way
  for every implementation, so each model class is judged alone;
- hands ``attn_implementation=SUBSTITUTE`` to ``from_pretrained`` wherever the test asks for
  ``"flash_attention_2"`` (so both implementations see the same skips, inputs and comparisons);
- writes one JSON line per item to ``$PACKFREE_UPSTREAM_RESULTS`` with its :func:`categorise` outcome.

Environment: ``PACKFREE_UPSTREAM_IMPL`` (the substitute, e.g. ``sdpa`` or ``packfree``) and
``PACKFREE_UPSTREAM_RESULTS`` (the JSON-lines file to append to).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import traceback
import unittest
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

SELECTED_PREFIX = "test_flash_attention_2_padding_matches_padding_free"
REPLACED_IMPLEMENTATION = "flash_attention_2"
PACKFREE_PACKAGE = "packfree_plugin"
# Decorators in ``transformers.testing_utils`` that gate the selected tests on a GPU, FlashAttention or RUN_SLOW.
LIFTED_REQUIREMENTS = (
    "require_flash_attn", "require_flash_attn_3", "require_flash_attn_4", "require_torch_accelerator",
    "require_torch_gpu", "slow",
)
# Names the v5.15 ``tests/test_modeling_common.py`` imports that transformers 5.24 no longer has; none is used by
# the padding-free tests. Each becomes a function that raises if anything calls it.
ABSENT_IN_INSTALLED = {
    "transformers.integrations.tensor_parallel": ("_get_parameter_tp_plan",),
    "transformers.distributed.fsdp": ("expand_fsdp_plan",),
    "transformers.distributed.utils": ("load_optimizer_distributed", "save_optimizer_distributed"),
}
# The tree's own ``testing_utils.py`` (optional beside its tests): constants its testers import that the installed
# transformers dropped (``_TEXT_MODEL_TESTER_DEFAULTS`` in 5.24) are read from it, literals only.
TREE_TESTING_UTILS = Path("src") / "transformers" / "testing_utils.py"

OUTCOMES = ("pass", "refused", "crash", "mismatch", "not_applicable")


@dataclass(frozen=True)
class Result:
    """One item's outcome. ``outcome`` is one of :data:`OUTCOMES` (or ``collection_error`` for a module that did
    not import, with ``test_class``/``model_class`` empty)."""

    implementation: str
    module: str
    test_class: str
    model_class: str
    test: str
    outcome: str
    detail: str = ""
    where: str = ""


class ComparisonMismatch(AssertionError):
    """The test's own ``torch.testing.assert_close`` between the padded and the padding-free logits failed."""


def _raising_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame outside this plugin (a failed comparison names the test's line, not the wrapper's)."""
    frames = [frame for frame in traceback.extract_tb(tb) if Path(frame.filename).name != Path(__file__).name]
    return frames[-1] if frames else None


def _is_packfree_file(filename: str) -> bool:
    return PACKFREE_PACKAGE in Path(filename).parts


def categorise(error: BaseException | None, *, compared: int, skipped: str | None = None) -> tuple[str, str, str]:
    """``(outcome, one-line detail, file:line)`` of one item.

    ``error`` is what the test raised (None when it returned), ``compared`` how many times it compared outputs,
    ``skipped`` the reason of a ``unittest`` skip. A ``ValueError`` raised from packfree's own code is a refusal,
    a failed comparison a silent mismatch, anything else a crash; a test that returned without comparing
    anything did not apply.
    """
    if skipped is not None:
        return "not_applicable", _one_line(skipped), ""
    if error is None:
        if compared == 0:
            return "not_applicable", "returned without comparing outputs", ""
        return "pass", "", ""
    frame = _raising_frame(error.__traceback__)
    where = f"{frame.filename}:{frame.lineno}" if frame is not None else ""
    detail = _one_line(f"{type(error).__name__}: {error}")
    if isinstance(error, ComparisonMismatch):
        return "mismatch", detail, where
    if isinstance(error, ValueError) and frame is not None and _is_packfree_file(frame.filename):
        return "refused", detail, where
    return "crash", detail, where


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ------------------------------------------------------------------------------------------ set-up
def _identity(obj: Any) -> Any:
    return obj


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module imports them: the requirement decorators become no-ops, absent names get
    placeholders."""
    import importlib

    import transformers.testing_utils as testing_utils

    for name in LIFTED_REQUIREMENTS:
        setattr(testing_utils, name, _identity)
    for module_name, names in ABSENT_IN_INSTALLED.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, _absent(f"{module_name}.{name}"))
    for name, value in _tree_literals(config.rootpath / TREE_TESTING_UTILS).items():
        if not hasattr(testing_utils, name):
            setattr(testing_utils, name, value)
    _import_installed_transformers_for_source_paths()
    config.addinivalue_line("markers", "flash_attn_test: transformers' FlashAttention marker")


def _tree_literals(path: Path) -> dict[str, Any]:
    """Top-level ``NAME = <literal>`` assignments of a Python file (none when it is absent)."""
    import ast

    if not path.is_file():
        return {}
    literals = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):
                literals[node.targets[0].id] = ast.literal_eval(node.value)
    return literals


def _import_installed_transformers_for_source_paths() -> None:
    """Some test modules import transformers from the tree's ``src/transformers`` (which a tests-only checkout
    lacks); they get the installed transformers, the one under test."""
    import transformers
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    original = import_utils.direct_transformers_import

    def direct_transformers_import(path: str, file: str = "__init__.py"):
        if not (Path(path) / file).is_file():
            return transformers
        return original(path, file)

    import_utils.direct_transformers_import = direct_transformers_import
    utils.direct_transformers_import = direct_transformers_import


def _absent(qualified: str):
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualified} is not in the installed transformers")

    return absent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Only the modeling test files (not tokenizer, processor or pipeline tests) are collected."""
    if collection_path.is_file() and collection_path.suffix == ".py":
        return not collection_path.name.startswith("test_modeling_")
    return None


# ------------------------------------------------------------------------------------------ items
class PaddingFreeCase(pytest.Item):
    """One selected test of one test class, restricted to one generative model class."""

    def __init__(self, *, testcase_class: type[unittest.TestCase], method: str, model_class: type | None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.testcase_class = testcase_class
        self.method = method
        self.model_class = model_class
        self.compared = 0

    def runtest(self) -> None:
        skipped = _own_skip(self.testcase_class, self.method)
        if skipped is not None:
            raise unittest.SkipTest(skipped)
        if self.model_class is None:
            raise unittest.SkipTest("the test class has no generative model class")
        case_class = type(self.testcase_class.__name__, (self.testcase_class,),
                          {"all_generative_model_classes": (self.model_class,)})
        _seed(f"{self.testcase_class.__module__}::{self.testcase_class.__name__}::{self.name}")
        _own_config_arguments()
        case_class.setUpClass()
        try:
            case = case_class(self.method)
            case.setUp()
            try:
                with _counting_comparisons(self), _substituted_from_pretrained(_substitute()):
                    getattr(case, self.method)()
            finally:
                case.tearDown()
                case.doCleanups()
        finally:
            case_class.tearDownClass()

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


def _own_skip(testcase_class: type, method: str) -> str | None:
    """The reason of a ``unittest.skip`` the test file puts on this test or its class (requirement skips are lifted
    before import, so what is left is the file's own)."""
    for obj in (testcase_class, getattr(testcase_class, method)):
        if getattr(obj, "__unittest_skip__", False):
            return getattr(obj, "__unittest_skip_why__", "skipped")
    return None


def _seed(key: str) -> None:
    """The same random inputs and weights for every implementation: transformers' test helpers draw ids and masks
    from ``tests.test_modeling_common.global_rng``."""
    import sys

    import numpy as np
    import torch

    seed = zlib.crc32(key.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    common = sys.modules.get("tests.test_modeling_common")
    if common is not None and hasattr(common, "global_rng"):
        common.global_rng.seed(seed)


_COPYING = "_packfree_copies_its_arguments"


def _own_config_arguments() -> None:
    """Each sub-config of a multimodal tester gets its own copy of the tester's arguments. The v5.15 testers hand the
    text and vision config classes the same ``rope_parameters`` dict; transformers 5.24 sets a default rope type into
    that dict in place (Kimi-K2.5's vision config makes it ``"axial"``), and the text model then fails with
    ``KeyError: 'axial'``, on stock as on packfree. With a copy each config reads what the tester gave it."""
    import copy
    import sys

    tester_module = sys.modules.get("tests.multimodal_tester")
    tester = getattr(tester_module, "MultiModalModelTester", None)
    if tester is None or getattr(tester._collect_kwargs, _COPYING, False):
        return
    collect = tester._collect_kwargs

    def collect_copies(self, sig_keys, config_class):
        return copy.deepcopy(collect(self, sig_keys, config_class))

    setattr(collect_copies, _COPYING, True)
    tester._collect_kwargs = collect_copies


def _substitute() -> str:
    implementation = os.environ.get("PACKFREE_UPSTREAM_IMPL")
    if not implementation:
        raise RuntimeError("PACKFREE_UPSTREAM_IMPL is not set (the implementation to use instead of FlashAttention)")
    return implementation


@contextlib.contextmanager
def _substituted_from_pretrained(implementation: str) -> Iterator[None]:
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        if kwargs.get("attn_implementation") == REPLACED_IMPLEMENTATION:
            kwargs["attn_implementation"] = implementation
        return original.__func__(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


@contextlib.contextmanager
def _counting_comparisons(item: PaddingFreeCase) -> Iterator[None]:
    """``torch.testing.assert_close`` counts its calls on ``item`` and raises :class:`ComparisonMismatch`."""
    import torch

    original = torch.testing.assert_close

    def assert_close(actual: Any, expected: Any, *args: Any, **kwargs: Any) -> None:
        item.compared += 1
        try:
            original(actual, expected, *args, **kwargs)
        except AssertionError as error:
            raise ComparisonMismatch(_max_difference(actual, expected) + str(error).split("\n")[0]) from error

    torch.testing.assert_close = assert_close
    try:
        yield
    finally:
        torch.testing.assert_close = original


def _max_difference(actual: Any, expected: Any) -> str:
    import torch

    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and actual.shape == expected.shape:
        return f"max |diff| {(actual.double() - expected.double()).abs().max().item():.3g}; "
    return ""


def _generative_classes(testcase_class: type[unittest.TestCase], method: str) -> tuple[type, ...]:
    """The test class's generative model classes (some test classes fill ``all_model_classes`` in ``setUp``)."""
    case = testcase_class(method)
    case.setUp()
    try:
        return tuple(case.all_generative_model_classes)
    finally:
        case.tearDown()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep only the selected tests, each split into one :class:`PaddingFreeCase` per generative model class."""
    from _pytest.unittest import TestCaseFunction

    kept: list[pytest.Item] = []
    for item in items:
        if not (isinstance(item, TestCaseFunction) and item.name.startswith(SELECTED_PREFIX)):
            continue
        testcase_class = item.cls
        try:
            model_classes: tuple[type | None, ...] = (
                (None,) if _own_skip(testcase_class, item.name) is not None
                else _generative_classes(testcase_class, item.name) or (None,))
        except Exception as error:  # a test class that cannot even list its classes is recorded, not hidden
            _write(_result(item, None, "crash", f"listing model classes: {type(error).__name__}: {error}"))
            continue
        for model_class in model_classes:
            label = model_class.__name__ if model_class is not None else "-"
            kept.append(PaddingFreeCase.from_parent(
                item.parent, name=f"{item.name}[{label}]", testcase_class=testcase_class, method=item.name,
                model_class=model_class))
    deselected = [item for item in items if item not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


# ------------------------------------------------------------------------------------------ results
def _result(item: pytest.Item, model_class: type | None, outcome: str, detail: str = "", where: str = "",
            test: str | None = None) -> Result:
    testcase_class = getattr(item, "testcase_class", None) or item.cls
    return Result(
        implementation=os.environ.get("PACKFREE_UPSTREAM_IMPL", ""),
        module=testcase_class.__module__,
        test_class=testcase_class.__name__,
        model_class=model_class.__name__ if model_class is not None else "-",
        test=test or getattr(item, "method", item.name),
        outcome=outcome,
        detail=detail,
        where=where,
    )


def _write(result: Result) -> None:
    path = os.environ.get("PACKFREE_UPSTREAM_RESULTS")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(asdict(result)) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if not isinstance(item, PaddingFreeCase):
        return report
    error = call.excinfo.value if call.excinfo is not None else None
    skipped = None
    if isinstance(error, (unittest.SkipTest, pytest.skip.Exception)):
        skipped, error = str(error) or "skipped", None
    if call.when == "call" or (call.when == "setup" and (error is not None or skipped is not None)):
        outcome, detail, where = categorise(error, compared=item.compared, skipped=skipped)
        _write(_result(item, item.model_class, outcome, detail, _short_where(where)))
    return report


def _short_where(where: str) -> str:
    """``…/site-packages/transformers/x.py:12`` -> ``transformers/x.py:12``."""
    for anchor in ("site-packages/", "/tests/models/", "/tests/"):
        if anchor in where:
            head = "tests/" if anchor != "site-packages/" else ""
            prefix = "models/" if anchor == "/tests/models/" else ""
            return head + prefix + where.split(anchor, 1)[1]
    return where


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test module that did not import (a v5.15 test against the installed transformers) is recorded."""
    if report.failed and report.nodeid.endswith(".py"):
        lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
        error_lines = [line for line in lines if line.startswith("E ")]
        detail = (error_lines or lines or ["?"])[-1].removeprefix("E").strip()
        _write(Result(implementation=os.environ.get("PACKFREE_UPSTREAM_IMPL", ""), module=report.nodeid,
                      test_class="", model_class="", test="", outcome="collection_error", detail=_one_line(detail)))
