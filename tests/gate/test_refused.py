"""The gate's own guard: every class the sweep refuses for its own reason is refused at load, with that reason.

The sweep (:mod:`tooling.sweep`) proves each class with the gate bypassed and records in
``verified.json`` why a refused one is refused: a layer packfree knows it cannot run exactly (refused at load by
``check_coverage``, before the gate), or an error on the proof's packed row (BLT's own-mask cross-attention), which
only the gate's load-time proof turns into a refusal at load. Each is rebuilt here from the sweep's tiny config and
loaded with ``attn_implementation="packfree"``: the load must raise, naming the recorded reason. A gate that admits
classes without proof lets the second kind load (and fail later, at the first packed call).
"""

from __future__ import annotations

import re

import pytest
import transformers

import packfree_plugin
from tooling.sweep.render import load_results
from tooling.sweep.run import Target, tiny_target

REFUSED = [r for r in load_results(transformers.__version__) if r.status == "refused"]
_ERROR_PREFIX = re.compile(r"^at (load|call \([^)]*\)): (ValueError|NotImplementedError): ")


def reason(detail: str) -> str:
    """The recorded refusal's own words: the error message without the sweep's prefix, cut where the sweep cut it
    (300 characters) and before the generic advice that follows the reason."""
    text = _ERROR_PREFIX.sub("", detail)
    return text.split(". Load the model without packfree")[0].split(". Pass one sample per row")[0][:120]


def test_the_sweep_recorded_refusals_of_both_kinds() -> None:
    """The positive control: the installed release's record holds refusals at load and at call (else the guard
    below would check nothing of the gate's own)."""
    if not load_results(transformers.__version__):
        pytest.skip(f"no sweep recorded for transformers {transformers.__version__}")
    kinds = {r.detail.split(":")[0].split(" (")[0] for r in REFUSED}
    assert kinds == {"at load", "at call"}, kinds


SLOW_TO_BUILD = {"perceiver"}  # its tiny copy takes ~12 s to build on 2 busy cores


@pytest.mark.parametrize("result", [
    pytest.param(r, id=f"{r.model_type}-{r.cls}", marks=[pytest.mark.slow] if r.model_type in SLOW_TO_BUILD else [])
    for r in REFUSED])
def test_a_class_the_sweep_refuses_is_refused_at_load_with_its_reason(result, fresh_verdicts) -> None:
    packfree_plugin.register()
    cls, config = tiny_target(Target(result.group, result.model_type, result.cls))
    with pytest.raises((ValueError, NotImplementedError)) as refused:
        cls._from_config(config, attn_implementation="packfree")
    assert reason(result.detail) in " ".join(str(refused.value).split()), str(refused.value)
