"""The committed sweep results (``gate/verified.json`` and the support matrix of its docs page) must match the
installed transformers: the same targets, and a sample of them re-proved gives the recorded class."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import transformers

from packfree_plugin.gate.admission import VERIFIED_FILE, switches, verified_classes
from packfree_plugin.gate.shrink import tiny_config_for
from tooling.sweep.render import MATRIX_MARKERS, SUPPORT_DOC, documented_version, load_results, render_matrix
from tooling.sweep.run import Target, run_target, targets

VERSION = transformers.__version__
REGENERATE = "stale: regenerate with `python -m tooling.sweep` (nox -s sweep)"
SAMPLE = os.environ.get("PACKFREE_SWEEP_SAMPLE", "40")
"""How many recorded-exact classes are re-proved (``all``: every target; half as many non-exact ones)."""
SAMPLE_EXACT = 10**6 if SAMPLE == "all" else int(SAMPLE)
SAMPLE_NOT_EXACT = max(1, SAMPLE_EXACT // 2)


def _recorded():
    results = load_results(VERSION)
    assert results, f"no sweep results recorded for transformers {VERSION}; {REGENERATE}"
    return results


def _sample(results, count: int):
    """A stable sample: the ``count`` results whose (version, class) hash lowest."""
    key = lambda r: hashlib.sha256(f"{VERSION}:{r.model_type}:{r.cls}".encode()).hexdigest()  # noqa: E731
    return sorted(results, key=key)[:count]


def test_recorded_targets_are_the_installed_transformers_targets() -> None:
    recorded = {(r.group, r.model_type, r.cls) for r in _recorded()}
    installed = {(t.group, t.model_type, t.cls) for t in targets()}
    assert recorded == installed, (f"missing: {sorted(installed - recorded)[:10]}, "
                                   f"gone: {sorted(recorded - installed)[:10]}; {REGENERATE}")


def test_the_verified_list_is_exactly_the_exact_results() -> None:
    exact = {(r.config_type, r.cls) for r in _recorded() if r.status == "exact"}
    assert verified_classes() == exact
    data = json.loads(VERIFIED_FILE.read_text())[VERSION]
    assert sorted(data["switches"]) == sorted({config_type for config_type, _ in exact})


def test_the_recorded_switches_are_those_of_the_tiny_configs_now() -> None:
    """A changed default config (a new switch, another default) makes the recorded switches stale."""
    data = json.loads(VERIFIED_FILE.read_text())[VERSION]["switches"]
    for r in _recorded():
        if r.status == "exact" and r.group != "backbone":
            config = tiny_config_for(r.model_type)
            if config.model_type != r.config_type:
                config = config.get_text_config(decoder=True)  # as the sweep picks it (MusicGen: its decoder)
            assert switches(config) == data[r.config_type], f"{r.model_type}; {REGENERATE}"


def test_every_recorded_non_exact_target_is_refused_by_the_gate() -> None:
    admitted = [r.cls for r in _recorded() if r.status in ("wrong", "internal", "refused") and not r.gate_refuses]
    assert admitted == []


def test_the_docs_page_section_is_generated_from_the_results() -> None:
    """The one matrix documents the newest transformers swept (also when the suite runs on an older supported one)."""
    documented = documented_version()
    matrix = render_matrix(documented, sorted(load_results(documented), key=lambda r: (r.group, r.model_type, r.cls)))
    page = SUPPORT_DOC.read_text()
    start, end = MATRIX_MARKERS
    assert page.split(start, 1)[1].split(end, 1)[0] == "\n" + matrix, REGENERATE


@pytest.mark.parametrize("recorded", _sample([r for r in load_results(VERSION) if r.status == "exact"],
                                             SAMPLE_EXACT), ids=lambda r: r.cls)
def test_a_sampled_exact_class_is_still_exact(recorded) -> None:
    result = run_target(Target(recorded.group, recorded.model_type, recorded.cls), user_configs=False)
    assert result.status == "exact", f"{recorded.cls}: {result.status} {result.detail}; {REGENERATE}"


@pytest.mark.parametrize("recorded", _sample([r for r in load_results(VERSION)
                                              if r.status in ("wrong", "internal", "refused")],
                                             SAMPLE_NOT_EXACT), ids=lambda r: r.cls)
def test_a_sampled_non_exact_class_is_still_refused_by_the_gate(recorded) -> None:
    """Re-run under stock packfree: still not exact, with the recorded verdict (else the verified list is stale),
    and the gate refuses it."""
    result = run_target(Target(recorded.group, recorded.model_type, recorded.cls), user_configs=False)
    assert result.status == recorded.status, f"{recorded.cls}: now {result.status}; {REGENERATE}"
    assert result.gate_refuses


def test_the_sweep_runs_targets_in_workers_and_stops_one_past_its_time_limit() -> None:
    """Two targets in one worker process give their verdicts; a time limit shorter than a worker's start
    records the target as not buildable (over the limit) instead of waiting for it."""
    from tooling.sweep.run import sweep

    chosen = [Target("causal", "llama", "LlamaForCausalLM"),
              Target("causal", "gemma4_assistant", "Gemma4AssistantForCausalLM")]
    verdicts = {r.cls: r.status for r in sweep(chosen, progress=False)}
    # packfree refuses the assistant at load: it attends to its target model's keys and values
    assert verdicts == {"LlamaForCausalLM": "exact", "Gemma4AssistantForCausalLM": "refused"}
    (late,) = sweep(chosen[:1], time_limit=0.05, progress=False)
    assert late.status == "unbuildable" and "time limit" in late.detail
