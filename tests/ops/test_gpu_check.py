"""The GPU check's CPU dry run: every check runs (no CUDA call), nothing fails, one folder gets gpu.md + gpu.json."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check


@pytest.mark.slow
def test_dry_run_runs_every_check_and_writes_one_folder(tmp_path):
    out = tmp_path / "gpu-results"
    assert gpu_check.main(["--dry-run", "--install", "--tokens", "64", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md"]
    rows = json.loads((out / "gpu.json").read_text())["rows"]
    checks = " ".join(row["check"] for row in rows)
    for head_dim in gpu_check.HEAD_DIMS:
        for window, _, _ in gpu_check.WINDOWS:
            assert f"attention head_dim={head_dim} window={window}" in checks
    for expected in ("install flash-attn", "causal-conv1d", "chunk_gated_delta_rule", "mamba_chunk_scan_combined",
                     "stock gemma3", "stock modernbert", "compiled packed step mamba2"):
        assert expected in checks
    ran = [row for row in rows if row["status"] == "ok"]
    assert any(row.get("backend") == "packfree" for row in ran)
    assert any(row.get("backend") == "segments (portable)" for row in ran)
    allowed = ("ok", "skipped", "differs from alone (stock)", "refused by packfree's gate")
    assert all(row["status"].startswith(allowed) for row in rows), [
        row for row in rows if not row["status"].startswith(allowed)]
    assert not [row["check"] for row in rows if row["status"].startswith("refused")]  # ModernBERT's window too
    assert "| check |" in (out / "gpu.md").read_text()


def test_a_package_that_does_not_install_is_skipped(monkeypatch):
    calls = []

    def fake_pip(*args, timeout):
        calls.append(args)
        return (args[0] not in gpu_check.OPTIONAL_WHEELS, f"timed out after {timeout:.0f} s")

    monkeypatch.setattr(gpu_check, "_pip", fake_pip)
    rows = gpu_check.install_rows(5.0, dry_run=False)
    assert [row["status"] for row in rows] == ["ok"] + ["skipped (timed out after 5 s)"] * 3
    assert all("--only-binary=:all:" in args for args in calls[1:])
    assert any(arg.startswith("torch==") for arg in calls[0])


def test_without_cuda_and_without_dry_run_nothing_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "x").exists()
