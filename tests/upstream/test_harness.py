"""The harness that runs transformers' own padding-free tests: its categories, its table, and its pytest plugin run
on a small stand-in for transformers' test tree (the real tree is not needed here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from packfree_plugin.boundaries import Boundaries
from tests.upstream.hf_padding_free_plugin import ComparisonMismatch, Result, categorise
from tests.upstream.run import class_outcomes, combine, render

HERE = Path(__file__).resolve().parent


def _raised(build) -> BaseException:
    try:
        build()
    except BaseException as error:  # noqa: BLE001 - the error itself is under test
        return error
    raise AssertionError("expected an exception")


def test_a_packfree_value_error_is_a_refusal_and_any_other_error_a_crash() -> None:
    refusal = _raised(lambda: Boundaries.from_cu_seqlens(torch.tensor([[0, 3]]), batch_size=1, seq_len=3, device="cpu"))
    outcome, detail, where = categorise(refusal, compared=0)
    assert (outcome, detail.split(":")[0], Path(where).name.split(":")[0]) == ("refused", "ValueError", "sources.py")
    stock = _raised(lambda: int("not a number"))  # a ValueError raised outside packfree
    assert categorise(stock, compared=0)[0] == "crash"
    assert categorise(_raised(lambda: [][1]), compared=0)[0] == "crash"


def test_a_failed_comparison_is_a_mismatch_and_a_pass_needs_a_comparison() -> None:
    assert categorise(_raised(lambda: (_ for _ in ()).throw(ComparisonMismatch("x"))), compared=1)[0] == "mismatch"
    assert categorise(None, compared=1)[0] == "pass"
    assert categorise(None, compared=0)[0] == "not_applicable"
    assert categorise(None, compared=0, skipped="no padding")[0:2] == ("not_applicable", "no padding")


def test_a_class_takes_the_worst_of_its_applicable_tests() -> None:
    assert combine(["pass", "not_applicable"]) == "pass"
    assert combine(["pass", "refused"]) == "refused"
    assert combine(["refused", "crash"]) == "crash"
    assert combine(["crash", "mismatch", "pass"]) == "mismatch"
    assert combine(["not_applicable", "not_applicable"]) == "not_applicable"


def _result(impl: str, model_class: str, test: str, outcome: str, detail: str = "") -> Result:
    return Result(impl, "tests.models.fake.test_modeling_fake", "FakeTest", model_class, test, outcome, detail)


def test_the_table_counts_classes_and_names_where_packfree_is_worse() -> None:
    results = {
        "sdpa": [_result("sdpa", "A", "t1", "pass"), _result("sdpa", "A", "t2", "pass"),
                 _result("sdpa", "B", "t1", "pass"), _result("sdpa", "C", "t1", "crash", "boom")],
        "packfree": [_result("packfree", "A", "t1", "pass"), _result("packfree", "A", "t2", "refused", "no hole"),
                     _result("packfree", "B", "t1", "pass"), _result("packfree", "C", "t1", "pass")],
    }
    assert sorted(class_outcomes(results["packfree"]).values()) == ["pass", "pass", "refused"]
    report = render(results, checkout="v0", transformers_version="0", runtimes={}, models=[])
    assert "| pass | 2 | 2 |" in report
    worse = report.split("## Where packfree does worse than stock sdpa")[1].split("##")[0]
    assert "FakeTest · A" in worse and "no hole" in worse
    assert "FakeTest · B" not in worse and "FakeTest · C" not in worse


def test_a_test_skipped_for_its_whole_test_class_joins_that_class_s_model_classes() -> None:
    results = [_result("sdpa", "-", "t1", "not_applicable", "the file's reason"), _result("sdpa", "A", "t2", "pass"),
               _result("sdpa", "B", "t2", "crash")]
    assert {key.model_class: outcome for key, outcome in class_outcomes(results).items()} == {"A": "pass",
                                                                                              "B": "crash"}
    alone = class_outcomes([_result("sdpa", "-", "t1", "not_applicable")])
    assert [key.model_class for key in alone] == ["-"]


# A stand-in for transformers' tree: a test file whose padding-free test needs a GPU and FlashAttention (lifted by
# the plugin), loads a tiny Llama with attn_implementation="flash_attention_2" (substituted), and behaves per
# model class: one passes, one compares unequal outputs, one has its class skipped by the file.
_TREE = {
    "tests/__init__.py": "",
    "tests/test_modeling_common.py": "import random\nglobal_rng = random.Random()\n",
    "tests/models/__init__.py": "",
    "tests/models/fake/__init__.py": "",
    "tests/models/fake/test_modeling_fake.py": '''
        import tempfile
        import unittest

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
        from transformers.testing_utils import require_flash_attn, require_torch_gpu, slow


        class FakeTest(unittest.TestCase):
            all_generative_model_classes = (LlamaForCausalLM, MistralForCausalLM)

            @require_flash_attn
            @require_torch_gpu
            @slow
            def test_flash_attention_2_padding_matches_padding_free_with_position_ids(self):
                (model_class,) = self.all_generative_model_classes
                config = LlamaConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
                with tempfile.TemporaryDirectory() as tmp:
                    LlamaForCausalLM(config).save_pretrained(tmp)
                    model = LlamaForCausalLM.from_pretrained(tmp, attn_implementation="flash_attention_2")
                assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
                ones = torch.ones(3)
                torch.testing.assert_close(ones, ones if model_class is LlamaForCausalLM else 2 * ones)


        @unittest.skip("the file's own reason")
        class SkippedTest(FakeTest):
            all_generative_model_classes = (Qwen2ForCausalLM,)
    ''',
}


@pytest.mark.slow
def test_the_plugin_lifts_requirements_substitutes_and_splits_per_model_class(tmp_path: Path) -> None:
    for relative, text in _TREE.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(textwrap.dedent(text))
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONPATH": str(HERE), "PACKFREE_UPSTREAM_IMPL": "sdpa", "PACKFREE_AUTOLOAD": "0",
           "PACKFREE_UPSTREAM_RESULTS": str(results), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hf_padding_free_plugin", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--rootdir", str(tmp_path), "-q", "tests/models"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300)
    outcomes = {(r["test_class"], r["model_class"]): r["outcome"]
                for r in map(json.loads, results.read_text().splitlines())}
    assert outcomes == {
        ("FakeTest", "LlamaForCausalLM"): "pass",
        ("FakeTest", "MistralForCausalLM"): "mismatch",
        ("SkippedTest", "-"): "not_applicable",  # a class its file skips is not listed
    }, run.stdout[-3000:]


def test_each_sub_config_gets_its_own_copy_of_the_testers_arguments(monkeypatch) -> None:
    """A v5.15 multimodal tester hands its text and vision configs one ``rope_parameters`` dict; transformers 5.24
    writes a vision default into it in place (Kimi-K2.5's ``"axial"``), which broke the text model on stock and
    packfree alike. The harness gives each config class its own copy (once, however many tests run)."""
    import types

    from tests.upstream import hf_padding_free_plugin as plugin

    class Tester:
        rope_parameters = {"rope_type": "default"}

        def _collect_kwargs(self, sig_keys, config_class):
            return {key: getattr(self, key) for key in sig_keys}

    monkeypatch.setitem(sys.modules, "tests.multimodal_tester", types.SimpleNamespace(MultiModalModelTester=Tester))
    shared = Tester()._collect_kwargs(["rope_parameters"], None)
    assert shared["rope_parameters"] is Tester.rope_parameters  # the sharing the harness undoes
    plugin._own_config_arguments()
    plugin._own_config_arguments()
    vision = Tester()._collect_kwargs(["rope_parameters"], None)
    vision["rope_parameters"]["rope_type"] = "axial"  # what the vision config does to its arguments
    assert Tester()._collect_kwargs(["rope_parameters"], None)["rope_parameters"] == {"rope_type": "default"}
