"""The ``packfree`` command line: doctor, verify (clean and leaking models), demo (tiny), bench (built-in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from packfree_plugin.catalogue import CATALOGUE
from packfree_plugin.tools.cli import main


def test_doctor_lists_packages_and_each_layers_backend(capsys) -> None:
    assert main(["doctor", "qwen3_next", "llama"]) == 0
    out = capsys.readouterr().out
    for package in ("torch", "transformers", "flash_attn", "mamba_ssm", "causal_conv1d", "fla", "kernels"):
        assert f"- {package}:" in out
    assert "Qwen3NextGatedDeltaNet" in out and "gated_delta" in out
    assert "LlamaAttention" in out and ("segments" if not torch.cuda.is_available() else "") in out
    assert "| NO" not in out
    assert out.count("in the graph") >= 2 and "graph break" not in out  # GDN and attention both compile in-graph


def test_doctor_says_which_layers_run_outside_the_compiled_graph(capsys) -> None:
    assert main(["doctor", "rwkv"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "Rwkv" in line]
    assert rows and all(line.endswith("| eager (1 graph break) |") for line in rows)


def test_doctor_flags_a_model_dir_with_an_unknown_mixer(tmp_path, capsys, monkeypatch) -> None:
    from transformers import AutoConfig

    from packfree_plugin.adapters import entry

    AutoConfig.for_model("mamba2", hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, vocab_size=64,
                         n_groups=1).save_pretrained(tmp_path)
    monkeypatch.setattr(entry, "REGISTRY", {k: v for k, v in entry.REGISTRY.items() if k != "Mamba2Mixer"})
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
    from packfree_plugin.tiny import load_model

    load_model("lfm2", "sdpa", dtype=torch.float32).save_pretrained(tmp_path)
    result = subprocess.run([sys.executable, "-m", "packfree_plugin", "verify", str(tmp_path), "--no-reference"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no leak" in result.stdout


def test_demo_tiny_run_writes_report_plot_and_agreeing_losses(tmp_path) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--out", str(out), "--no-progress"]) == 0
    report = (out / "report.md").read_text()
    assert "Speedup" in report and "Isolation audit" in report and "no leak" in report
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "demo.json").read_text())
    assert len(summary["padded"]["losses"]) == len(summary["packed"]["losses"]) == 2
    assert summary["summary"]["max_rel_loss_diff"] < 1e-5
    assert summary["packed"]["real_tokens"] == summary["padded"]["real_tokens"]
    assert summary["summary"]["packed_efficiency"] > summary["summary"]["padded_efficiency"]
    ceiling = summary["padded"]["slot_tokens"] / summary["packed"]["slot_tokens"]
    assert summary["summary"]["padding_ceiling"] == pytest.approx(ceiling) and ceiling > 1
    assert f"Padding ceiling: **{ceiling:.2f}x**" in report


def test_vision_demo_tiny_run_agrees_and_packs_every_step_into_one_row(tmp_path) -> None:
    out = tmp_path / "demo"
    assert main(["demo-vlm", "--epochs", "1", "--batch-size", "9", "--out", str(out), "--no-progress"]) == 0
    report = (out / "report-vlm.md").read_text()
    summary = json.loads((out / "demo-vlm.json").read_text())["summary"]
    assert "Speedup" in report and (out / "demo-vlm.png").exists()
    assert summary["max_rel_loss_diff"] < 1e-5
    assert summary["packed_efficiency"] == 1.0 and summary["padded_efficiency"] < 1.0


def test_bench_chart_from_rows(tmp_path) -> None:
    from packfree_plugin.tools.bench import chart

    rows = [{"run": "padded", "tokens/s": 100.0, "x padded": 1.0}, {"run": "packed", "tokens/s": 170.0, "x padded": 1.7}]
    path = chart({"training": rows}, tmp_path / "bench.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0


@pytest.mark.parametrize("model_type", sorted(t for t in CATALOGUE if t in CONFIG_MAPPING_NAMES))
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
