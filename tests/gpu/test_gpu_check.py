"""The GPU check's CPU dry run: every check runs (no CUDA call), nothing fails, one folder gets gpu.md + gpu.json."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from pathlib import Path

import pytest

from gpu import gpu_check, gpu_setup


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
    measured = [row for row in rows if row["status"].startswith(("ok", "MISMATCH", "differs"))
                and not row["check"].startswith("install")]
    assert measured and all(any(k.startswith("x_") and isinstance(row[k], float) for k in row) for row in measured), [
        row["check"] for row in measured if not any(k.startswith("x_") for k in row)]
    assert rows[-1] == {"check": "one packed row over 2 ranks", "status": "skipped (dry run)"}
    assert "| check |" in (out / "gpu.md").read_text()


def test_a_package_that_does_not_install_is_skipped(monkeypatch):
    calls = []

    def fake_pip(*args, timeout):
        calls.append(args)
        return (args[0] not in gpu_setup.OPTIONAL_WHEELS, f"timed out after {timeout:.0f} s")

    monkeypatch.setattr(gpu_setup, "_pip", fake_pip)
    rows = gpu_setup.install_rows(5.0, dry_run=False)
    assert [row["status"] for row in rows] == ["ok"] + ["skipped (timed out after 5 s)"] * 3
    assert all("--only-binary=:all:" in args for args in calls[1:])
    assert any(arg.startswith("torch==") for arg in calls[0])


def test_without_cuda_and_without_dry_run_nothing_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "x")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "x").exists()


def test_a_check_past_its_budget_keeps_its_rows_and_the_next_checks_run(monkeypatch, tmp_path):
    def slow(env, rows):
        rows.append({"check": "slow, first row", "status": "ok"})
        time.sleep(30)
        rows.append({"check": "slow, never reached", "status": "ok"})

    def fast(env, rows):
        rows.append({"check": "fast", "status": "ok"})

    monkeypatch.setattr(gpu_check, "CHECKS", {"attention": slow, "ops": fast, "stock": fast, "compiled": fast})
    assert gpu_check.main(["--dry-run", "--budget", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    # the slow check's second row never came: it was stopped, and the next checks ran
    assert [row["check"] for row in rows] == ["slow, first row", "attention", "fast", "fast", "fast",
                                              "one packed row over 2 ranks"]
    assert rows[1]["status"].startswith("skipped (over its 1 s share of --budget; the 1 rows above finished")


def _manifest(tmp_path: Path, sha256: str, version: str) -> dict:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "pytest.whl").write_bytes(b"wheel")
    return {"carried": [{"name": "pytest", "version": version, "file": "pytest.whl", "sha256": sha256}],
            "not_carried": {"flash-attn": "CUDA build"}}


@pytest.mark.parametrize("case", ["intact", "sha256", "version", "site"])
def test_bundle_rows_check_each_wheel_and_where_it_imports_from(tmp_path, case):
    installed = importlib.metadata.distribution("pytest")
    sha = hashlib.sha256(b"wheel").hexdigest() if case != "sha256" else "0" * 64
    manifest = _manifest(tmp_path, sha, installed.version if case != "version" else "0.0.1")
    site = Path(installed.locate_file("")) if case != "site" else tmp_path
    rows = gpu_setup.bundle_rows(manifest, site, tmp_path)
    assert rows[0]["status"].startswith("ok" if case == "intact" else "error")
    assert rows[-1] == {"check": "not carried: flash-attn", "status": "skipped (CUDA build)"}
