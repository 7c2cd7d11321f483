"""The ``packfree`` command line: doctor, verify (clean and leaking models), demo (tiny), bench (built-in)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from packfree_plugin.gate.catalogue import sized_types
from packfree_plugin.cli.load import OTHERS_PER_CORE, LoadWatch
from packfree_plugin.cli.main import main
from packfree_plugin.cli.demo import (
    GDN_CHUNK,
    WARMUP_STEPS,
    PaddedCollator,
    RunResult,
    StepPacker,
    decompose,
    demo_config,
    gdn_chunk,
    tokenize_gsm8k,
    verdict,
    work_units,
)
from packfree_plugin.cli.demo_figures import decomposition_lines, part_phrase, standing
from packfree_plugin.cli.demo_report import speed_plot_labels


def test_doctor_lists_packages_and_each_layers_backend(capsys) -> None:
    assert main(["doctor", "qwen3_next", "llama"]) == 0
    out = capsys.readouterr().out
    for package in ("torch", "transformers", "flash_attn", "mamba_ssm", "causal_conv1d", "fla", "kernels"):
        assert f"- {package}:" in out
    assert "Qwen3NextGatedDeltaNet" in out and "gated_delta" in out
    assert "LlamaAttention" in out and ("segments" if not torch.cuda.is_available() else "") in out
    assert "| NO" not in out
    assert out.count("in the graph") >= 2 and "graph break" not in out  # GDN and attention both compile in-graph


def test_doctor_says_how_each_model_numbers_positions(capsys) -> None:
    """From ``padding_idx + 1`` (RoBERTa), from a position buffer (MRA's, read on the CPU: the model is built on the
    meta device), from 0 (Llama), not by ids (Mamba2)."""
    assert main(["doctor", "roberta", "mra", "llama", "mamba2"]) == 0
    said = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("positions of a lone sample: ")]
    assert len(said) == 4
    assert said[0].startswith("from padding_idx + 1 = 2 (roberta.embeddings: RobertaEmbeddings)")
    assert said[1].startswith("from 2, its position_ids buffer (") and "MraEmbeddings" in said[1]
    assert said[2] == "from 0" and said[3].startswith("not by ids")


def test_doctor_says_which_layers_run_outside_the_compiled_graph(capsys) -> None:
    assert main(["doctor", "rwkv"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|") and "Rwkv" in line]
    assert rows and all(line.endswith("| eager (1 graph break) |") for line in rows)


def test_doctor_flags_a_model_dir_with_an_unknown_mixer(tmp_path, capsys, monkeypatch) -> None:
    from transformers import AutoConfig

    from packfree_plugin import classes

    AutoConfig.for_model("mamba2", hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, vocab_size=64,
                         n_groups=1).save_pretrained(tmp_path)
    monkeypatch.delitem(classes.CLASSES, "Mamba2Mixer")
    assert main(["doctor", str(tmp_path)]) == 1
    assert "NO (no adapter" in capsys.readouterr().out


def test_verify_passes_under_packfree_and_shows_the_stock_leak(capsys) -> None:
    assert main(["verify", "qwen3_next"]) == 0
    out = capsys.readouterr().out
    assert "packfree: " in out and "no leak" in out.splitlines()[0]
    assert "sdpa: " in out and "modules leak" in out  # stock sdpa mixes the packed samples


def test_verify_fails_on_a_deliberately_leaking_model(capsys, monkeypatch) -> None:
    """A tiny Llama whose MLP adds a running sum along the sequence: packed samples mix outside attention."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward

    def leaking_forward(self, x):
        return original(self, x) + 0.1 * x.cumsum(dim=1)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", leaking_forward)
    assert main(["verify", "llama", "--no-reference"]) == 1
    out = capsys.readouterr().out
    assert "LEAK" in out and "mlp" in out


def test_verify_from_a_saved_model_dir_as_a_subprocess(tmp_path) -> None:
    from packfree_plugin.cli.tiny import load_model

    load_model("lfm2", "sdpa", dtype=torch.float32).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "packfree_plugin", "verify", str(tmp_path), "--no-reference"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no leak" in result.stdout


FIGURE_AND_CEILING = re.compile(r"(\d+\.\d+)x(?:\*\*)? (?:\(ceiling |\| )(\d+\.\d+)x")
"""A figure and its ceiling as the console (``1.52x (ceiling 1.70x``) and the report's table (``**1.52x** | 1.70x``)
print them."""


def assert_no_figure_above_its_ceiling(text: str) -> None:
    pairs = [(float(a), float(b)) for a, b in FIGURE_AND_CEILING.findall(text)]
    assert all(figure <= ceiling for figure, ceiling in pairs), pairs


def assert_no_speed_figure(text: str) -> None:
    """No ratio (``2.06x``), throughput (``tokens/s``) or training time in ``text``."""
    assert not re.search(r"\d\.\d+x", text) and "tokens/s" not in text and "train s" not in text, text


def _tokens_per_second(run: dict) -> float:
    """Real tokens per second over every step (a 2-step run has no step left after the demo's warm-up)."""
    return sum(run["step_real_tokens"]) / sum(run["step_seconds"])


def test_demo_tiny_run_writes_report_plot_and_agreeing_losses(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    report = (out / "report.md").read_text()
    assert "Speedup" in report and "Isolation audit" in report and "no leak" in report
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recorded = json.loads((out / "demo.json").read_text())
    stock, mine, floor, packed = (recorded[k] for k in ("padded", "packfree_padded", "floor", "packed"))
    assert all(len(run["losses"]) == 2 for run in (stock, mine, floor, packed))
    assert stock["attn_implementation"] == "sdpa" and mine["attn_implementation"] == "packfree"
    # packfree on stock's padded batches, and packed, train like stock; the floor skipped its token mixers
    for run in (mine, packed):
        assert max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], run["losses"])) < 1e-5
    assert max(abs(a - b) for a, b in zip(stock["losses"], floor["losses"])) > 1e-3
    assert recorded["skipped"] == ["model.layers.0.linear_attn", "model.layers.1.linear_attn",
                                   "model.layers.2.linear_attn", "model.layers.3.self_attn"]
    assert stock["real_tokens"] == mine["real_tokens"] == floor["real_tokens"] == packed["real_tokens"]
    assert stock["slot_tokens"] == mine["slot_tokens"] == floor["slot_tokens"] > packed["slot_tokens"]
    assert recorded["summary"]["packed_efficiency"] > recorded["summary"]["padded_efficiency"]

    # each part from the runs' own step times and work counts, its ceiling from the run it is bounded by
    parts = recorded["decomposition"]
    assert [step["tokens run"] for step in packed["step_work"]] == packed["step_slot_tokens"]
    ratios = {kind: sum(step[kind] for step in mine["step_work"]) / sum(step[kind] for step in packed["step_work"])
              for kind in ("tokens run", "attention pairs", "chunk-padded tokens")}
    assert recorded["work_ratios"] == pytest.approx(ratios, rel=1e-12)
    assert ratios["tokens run"] == pytest.approx(mine["slot_tokens"] / packed["slot_tokens"], rel=1e-12)
    expected = {"ops": _tokens_per_second(mine) / _tokens_per_second(stock),
                "ops_ceiling": _tokens_per_second(floor) / _tokens_per_second(stock),
                "padding": _tokens_per_second(packed) / _tokens_per_second(mine),
                "padding_ceiling": max(ratios.values()),
                "total": _tokens_per_second(packed) / _tokens_per_second(stock)}
    expected["total_ceiling"] = expected["ops_ceiling"] * expected["padding_ceiling"]
    for key, value in expected.items():
        assert parts[key] == pytest.approx(value, rel=1e-9), key
    assert parts["within_ceilings"] == (not any(parts[f"{k}_above_ceiling"] for k in ("ops", "padding", "total")))

    console = capsys.readouterr().out
    # each run named as it starts; no unlabelled Trainer metrics dict; the floor said to be no training result
    for label in ("stock padded (sdpa)", "packfree padded (packfree)", "packfree packed (packfree)"):
        assert console.count(f"training run: {label}, 2 steps of 16 samples") == 1
    assert "token mixers skipped (packfree), 2 steps of 16 samples; a timing bound, not a training result" in console
    assert "train_runtime" not in console and "a timing bound, not a training result" in report
    # one measure of loss difference, by one name
    assert "max loss diff" not in console and "Max |loss" not in report
    assert f"largest relative loss difference {recorded['summary']['max_rel_loss_diff']:.1e}" in console
    # the load comes with the ratios; a loaded machine gives no figures, a quiet one a result
    load = recorded["load"]
    assert len(load["samples"]) == 2 and load["per_core"] == max(load["samples"])
    assert f"load average {load['per_core']:.2f} per core" in console
    others = load["others_per_core"]
    assert others is not None and f"other processes used {others:.2f} of each core" in console  # Linux: /proc/stat
    assert load["too_loaded"] is (others > OTHERS_PER_CORE)
    said = console.split("verdict: ", 1)[1].splitlines()[0]
    assert "equal losses" in said and said in report
    assert_no_figure_above_its_ceiling(console + report)
    assert f"packfree CLI: {os.path.join(os.path.dirname(sys.executable), 'packfree')}" in console  # the demo's env
    if load["too_loaded"]:
        assert said.startswith("no figures: ")
        assert_no_speed_figure(console + report)
        return
    assert said.startswith("packed trains ")
    rows = {"packfree's ops": "ops", "padding removed": "padding", "both": "total"}
    for name, key in rows.items():
        assert f"| {name} |" in report
        if standing(parts, key) == "below":
            assert f"**{expected[key]:.2f}x** | {expected[key + '_ceiling']:.2f}x |" in report
    for label, key in (("speedup ", "total"), ("packfree's ops  ", "ops"), ("padding removed ", "padding")):
        assert f"{label}{part_phrase(parts, key)}" in console
    # each figure printed once (count the labels: two figures may round to the same number)
    assert [console.count(label) for label in ("speedup ", "packfree's ops  ", "padding removed ")] == [1, 1, 1]


def _run(step_seconds: list[float], step_slot_tokens: list[int], chunk_padded: list[int] | None = None) -> RunResult:
    """A run whose steps ran ``step_slot_tokens`` tokens (and ``chunk_padded`` chunk-padded ones; else as many)."""
    work = [{"tokens run": tokens, "attention pairs": 1000, "chunk-padded tokens": chunked}
            for tokens, chunked in zip(step_slot_tokens, chunk_padded or step_slot_tokens)]
    return RunResult("run", "sdpa", [1.0] * len(step_seconds), sum(step_seconds), step_seconds, 100 * len(step_seconds),
                     sum(step_slot_tokens), [100] * len(step_seconds), step_slot_tokens, work)


QUIET = LoadWatch(cores=2, samples=[0.1, 0.3])


@pytest.mark.parametrize("excess, above", [(1.006, False), (1.5, True)])
def test_demo_verdict_allows_for_timing_noise(excess: float, above: bool) -> None:
    """Packing measured ``excess`` times its padding ceiling with 3 % step-to-step timing noise: 0.6 % over (the
    1.71x-against-1.70x run) lies inside the noise band; 50 % over is flagged."""
    jitter = 1 + 0.03 * np.random.default_rng(1).standard_normal(40)
    padded_slots, packed_slots = [170] * 40, [100] * 40
    mine = (jitter * 1.7).tolist()  # step time follows tokens run; the packed run beats that by ``excess``
    result = {"padded": _run([2.0] * 40, padded_slots), "packfree_padded": _run(mine, padded_slots),
              "floor": _run([1.0] * 40, padded_slots), "packed": _run([1.0 / excess] * 40, packed_slots)}
    parts = decompose(result)
    assert parts["padding"] / parts["padding_ceiling"] == pytest.approx(float(jitter[WARMUP_STEPS:].mean()) * excess)
    assert 0.005 < parts["padding_noise"] < 0.05  # about 2 standard errors of 38 steps of 3 % noise
    assert parts["padding_above_ceiling"] is above and parts["within_ceilings"] is not above
    said = verdict(parts, QUIET, 0.0)
    assert ("padding above its ceiling by more than its timing noise" in said) is above
    if above:  # no figure of padding's; the speedup without a ceiling, the plot without the ceiling bar
        assert standing(parts, "padding") == "above" and standing(parts, "total") == "unbounded"
        assert part_phrase(parts, "padding").startswith("no figure: measured above its ceiling")
        assert f"packed trains {parts['total']:.2f}x as fast as stock padded, with no ceiling" in said
        assert speed_plot_labels(parts, None)["draw_ceiling"] is False
    else:  # above its ceiling inside the noise: "at its ceiling", the ceiling alone
        assert standing(parts, "padding") == "at" and parts["padding"] > parts["padding_ceiling"]
        assert part_phrase(parts, "padding").startswith(f"at its ceiling {parts['padding_ceiling']:.2f}x")
        assert speed_plot_labels(parts, None)["draw_ceiling"] is False
    lines = "\n".join(decomposition_lines(parts, {"tokens run": 1.7}, QUIET, 0.0))
    assert_no_figure_above_its_ceiling(lines)
    assert f"{parts['padding']:.2f}x" not in lines


def test_demo_padding_ceiling_counts_attentions_square() -> None:
    """Samples of 5, 9 and 3 tokens, chunks of 8. Padded: three rows of 9; the attention skips their padding, the
    chunked Gated DeltaNet rounds each row up to 16. Packed: one row of 17 (rounded up to 24), or two rows of 10
    (a 9 and its pad of 1; a 5, a 3 and a pad of 2)."""
    features = [{"input_ids": [1] * n} for n in (5, 9, 3)]
    pairs = 5 ** 2 + 9 ** 2 + 3 ** 2
    assert work_units(PaddedCollator().layout(features), chunk=8) == {
        "tokens run": 27, "attention pairs": pairs, "chunk-padded tokens": 48}
    assert work_units(StepPacker(4096).layout(features), chunk=8) == {
        "tokens run": 17, "attention pairs": pairs, "chunk-padded tokens": 24}
    assert work_units(StepPacker(10).layout(features), chunk=8) == {
        "tokens run": 20, "attention pairs": pairs, "chunk-padded tokens": 32}
    assert work_units(StepPacker(10).layout(features), chunk=None) == {"tokens run": 20, "attention pairs": pairs}


def test_demo_work_units_match_the_batches_the_model_receives() -> None:
    """A real GSM8K step of 16 samples, counted from the collated tensors themselves: tokens are their size,
    attention pairs each sample's length squared (the padded batch's mask rows, the packed row's ``cu_seq_lens``),
    chunk-padded tokens each row rounded up to the chunk."""
    assert gdn_chunk(demo_config("qwen3_next", 64)) == GDN_CHUNK and gdn_chunk(demo_config("llama", 64)) is None
    samples, _ = tokenize_gsm8k(16, progress=False)
    features = [{"input_ids": sample} for sample in samples]
    padded, packed = PaddedCollator()(features), StepPacker(4096)(features)
    rows, width = padded["input_ids"].shape
    assert work_units(PaddedCollator().layout(features), chunk=GDN_CHUNK) == {
        "tokens run": rows * width, "attention pairs": int(padded["attention_mask"].sum(-1).square().sum()),
        "chunk-padded tokens": rows * math.ceil(width / GDN_CHUNK) * GDN_CHUNK}
    (length,) = packed["input_ids"].shape[1:]
    assert packed["input_ids"].shape[0] == 1
    assert work_units(StepPacker(4096).layout(features), chunk=GDN_CHUNK) == {
        "tokens run": length, "attention pairs": int(packed["cu_seq_lens_q"].diff().square().sum()),
        "chunk-padded tokens": math.ceil(length / GDN_CHUNK) * GDN_CHUNK}


def test_demo_padding_ceiling_is_the_largest_work_ratio() -> None:
    """Rows padded to whole chunks: 1.7x the tokens run padded, 2x the chunk-padded tokens. Packing measured 1.86x
    (what the token ratio alone called above its ceiling) is within the ceiling of 2x."""
    padded_slots, packed_slots = [170] * 10, [100] * 10
    result = {"padded": _run([2.0] * 10, padded_slots), "floor": _run([1.0] * 10, padded_slots),
              "packfree_padded": _run([1.86] * 10, padded_slots, [256] * 10),
              "packed": _run([1.0] * 10, packed_slots, [128] * 10)}
    parts = decompose(result, resamples=50)
    assert parts["padding"] == pytest.approx(1.86) and parts["padding_ceiling"] == pytest.approx(2.0)
    assert not parts["padding_above_ceiling"]


def test_load_watch_samples_start_and_end_and_keeps_the_largest() -> None:
    readings = iter([(1.0, 0.0, 0.0), (3.0, 0.0, 0.0)])
    with LoadWatch(cores=4, read=lambda: next(readings), busy=lambda: None) as load:
        assert load.samples == [0.25]
    assert load.samples == [0.25, 0.75] and load.per_core == 0.75 and not load.too_loaded
    assert load.as_dict()["per_core"] == 0.75 and load.others_per_core is None
    assert LoadWatch(cores=4, samples=[0.2, 0.76]).too_loaded


def test_load_watch_counts_other_processes_not_the_run_itself() -> None:
    """2 cores busy 4 s over 2 s of wall time, 2 s of them this process's own: the others used half of each core
    (too loaded), whatever the load average says; the run alone keeping both cores busy is no load."""
    def watch(busy: list[float], own: list[float]) -> LoadWatch:
        busy_reads, own_reads, clock = iter(busy), iter(own), iter([0.0, 2.0])
        with LoadWatch(cores=2, read=lambda: (2.0, 0.0, 0.0), busy=lambda: next(busy_reads),
                       own=lambda: next(own_reads), clock=lambda: next(clock)) as load:
            pass
        return load

    others = watch([10.0, 14.0], [0.0, 2.0])
    assert others.others_per_core == pytest.approx(0.5) and others.too_loaded
    alone = watch([10.0, 14.0], [0.0, 4.0])
    assert alone.others_per_core == 0.0 and alone.per_core == 1.0 and not alone.too_loaded
    assert "other processes used 0.50 of each core" in others.describe()


def test_demo_verdict_gives_no_figures_on_a_loaded_machine() -> None:
    """The same timings: a result sentence on a quiet machine, no figures above the load threshold; the losses'
    agreement either way."""
    slots = [150] * 10
    result = {"padded": _run([2.0] * 10, slots), "packfree_padded": _run([1.5] * 10, slots),
              "floor": _run([1.0] * 10, slots), "packed": _run([1.0] * 10, [100] * 10)}
    parts = decompose(result, resamples=50)
    quiet = verdict(parts, QUIET, 2e-7)
    assert quiet == ("packed trains 2.00x as fast as stock padded, 67% of its ceiling 3.00x. Padded and packed "
                     "trained with equal losses (largest relative loss difference 2.0e-07)")
    busy = LoadWatch(cores=2, samples=[0.5, 1.9])
    loaded = verdict(parts, busy, 2e-7)
    assert loaded.startswith("no figures: the machine ran at 1.90 load per core (above 0.75)")
    assert "2.00x" not in loaded and "equal losses" in loaded
    assert "DIFFERENT losses (largest relative loss difference 1.0e-03)" in verdict(parts, QUIET, 1e-3)
    # loaded: the console's lines and the plot carry no speed figure either
    assert_no_speed_figure("\n".join(decomposition_lines(parts, {"tokens run": 1.5}, busy, 2e-7)))
    labels = speed_plot_labels(parts, "busy")
    assert labels == {"no_speed": "No speed panel: busy."}
    assert speed_plot_labels(parts, None) == {"title": "Training throughput: packed 2.00x stock padded",
                                              "draw_ceiling": True}


def test_vision_demo_tiny_run_agrees_and_packs_every_step_into_one_row(tmp_path) -> None:
    out = tmp_path / "demo"
    assert main(["demo-vlm", "--epochs", "1", "--batch-size", "9", "--out", str(out), "--no-progress"]) == 0
    report = (out / "report-vlm.md").read_text()
    summary = json.loads((out / "demo-vlm.json").read_text())["summary"]
    assert "Speedup" in report and (out / "demo-vlm.png").exists()
    assert summary["max_rel_loss_diff"] < 1e-5
    assert summary["packed_efficiency"] == 1.0 and summary["padded_efficiency"] < 1.0


def test_bench_chart_from_rows(tmp_path) -> None:
    from packfree_plugin.cli.bench import chart

    rows = [{"run": "padded", "tokens/s": 100.0, "x padded": 1.0}, {"run": "packed", "tokens/s": 170.0, "x padded": 1.7}]
    path = chart({"training": rows}, tmp_path / "bench.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0


@pytest.mark.parametrize("model_type", sorted(t for t in sized_types() if t in CONFIG_MAPPING_NAMES))
def test_doctor_and_verify_cover_every_catalogue_type(model_type: str, capsys) -> None:
    """By model type alone (tiny config from the catalogue), every covered type plans boundary-safe layers
    and passes the leak audit."""
    assert main(["doctor", model_type]) == 0
    assert "| NO" not in capsys.readouterr().out
    assert main(["verify", model_type, "--no-reference"]) == 0
    assert "no leak" in capsys.readouterr().out


def test_verify_reports_a_stock_reference_that_cannot_run(capsys) -> None:
    """Stock xLSTM crashes on this input with its default cache (a transformers bug); verify still gives
    packfree's verdict and says why the reference is missing."""
    assert main(["verify", "xlstm"]) == 0
    out = capsys.readouterr().out
    assert "eager: could not run this input (RuntimeError" in out and "OK: no module leaks" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "/no/such/dir"], "no such model directory: /no/such/dir"),
        (["doctor", "not_a_model_type"], "neither a model directory nor a model type"),
        (["verify", "llama", "--lengths", "7,x"], "--lengths must be comma-separated positive integers"),
        (["demo", "--steps", "many"], "invalid int value"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_directory_without_config_is_a_usage_error(tmp_path, capsys) -> None:
    assert main(["verify", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err
