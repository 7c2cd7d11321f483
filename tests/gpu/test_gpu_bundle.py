"""The offline GPU bundle without its real wheels (``nox -s gpu_rehearsal`` runs the real one): what ``finish``
writes, the commands ``run.sh`` runs, the requirement check and the size limit. Fake wheels carry only METADATA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpu import gpu_bundle

TRANSFORMERS_5_24 = ["huggingface-hub<3.0,>=1.31.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1",
                     "regex>=2025.10.22", "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0",
                     "tqdm>=4.60", "torch>=2.4; extra == 'torch'"]
HUB_1_31 = ["click<9.0.0,>=8.4.2", "filelock>=3.10.0", "fsspec>=2023.5.0", "httpx<1,>=0.23.0", "packaging>=20.9",
            "pyyaml>=5.1", "tomli>=1.1.0; python_version < '3.11'", "tqdm>=4.42.1", "typing-extensions>=4.1.0",
            'hf-xet<2.0.0,>=1.5.2; platform_machine == "x86_64"']
"""The published wheels' Requires-Dist (transformers 5.24.0, huggingface_hub 1.31.0)."""
OTHERS = {"hf-xet": ("1.8.0", []), "click": ("8.5.1", []), "fla-core": ("0.6.0", ["einops"]),
          "flash-linear-attention": ("0.6.0", ["fla-core==0.6.0", "transformers<6,>=5.6.2"]),
          "mamba-ssm": ("2.3.2.post1", ["torch", "triton>=3.5.0", "ninja", "einops", "transformers", "packaging",
                                        "tilelang==0.1.8"]),
          "packfree": ("0.1.0", ["numpy>=1.24", "torch>=2.11", "transformers>=5.20.0,<6", "kernels>=0.10"])}


def fake_wheel(folder: Path, name: str, version: str, requires: list[str], tag: str = "py3-none-any") -> Path:
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = f"{name.replace('-', '_')}-{version}"
    path = wheels / f"{stem}-{tag}.whl"
    metadata = "\n".join([f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", metadata + "\n")
    return path


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    folder = tmp_path / "gpu-bundle"
    fake_wheel(folder, "transformers", "5.24.0", TRANSFORMERS_5_24)
    fake_wheel(folder, "huggingface-hub", "1.31.0", HUB_1_31)
    for name, (version, requires) in OTHERS.items():
        fake_wheel(folder, name, version, requires)
    return folder


def test_finish_writes_everything_the_run_needs(bundle: Path, capsys):
    manifest = gpu_bundle.finish(bundle)
    written = json.loads((bundle / "manifest.json").read_text())
    assert written == manifest
    names = {entry["name"] for entry in manifest["carried"]}
    assert names == {"transformers", "huggingface-hub", *OTHERS}
    assert all(entry["reason"] and len(entry["sha256"]) == 64 for entry in manifest["carried"])
    assert set(manifest["not_carried"]) == {"flash-attn", "causal-conv1d", "kernels-hub", "selective_scan_cuda"}
    for name in ("gpu_check.py", "gpu_setup.py"):
        assert (bundle / name).read_text() == Path(gpu_bundle.__file__).with_name(name).read_text()
    assert "def _not_carried" in (bundle / "shims" / "selective_scan_cuda.py").read_text()
    printed = capsys.readouterr().out
    assert f"{gpu_bundle.size_of(bundle) / 2**20:.1f} MiB of 60 MiB" in printed
    assert "run(command='bash gpu-bundle/run.sh \"$OUT\"', carry=[\"gpu-bundle\"], timeout_s=540)" in printed


def test_the_bundled_check_runs_as_a_plain_script_beside_its_setup_rows(bundle: Path, tmp_path: Path):
    """run.sh runs ``gpu_check.py`` as a file, outside the repository: it must import the bundle's gpu_setup.py."""
    gpu_bundle.finish(bundle)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run_help() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(bundle / "gpu_check.py"), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True)

    done = run_help()
    assert done.returncode == 0, done.stderr
    assert "--bundle" in done.stdout
    (bundle / "gpu_setup.py").unlink()  # without its copy, the script fails: nothing else on the path provides it
    assert run_help().returncode != 0


def test_run_sh_installs_every_wheel_offline_then_runs_the_check_into_the_named_folder(bundle: Path, tmp_path: Path):
    gpu_bundle.finish(bundle)
    log = tmp_path / "calls.log"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "PYTHONPATH=$PYTHONPATH" "HF_HUB_OFFLINE=$HF_HUB_OFFLINE" '
                    f'"$@" "--" >> "{log}"\n')
    stub.chmod(0o755)
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": str(stub), "TMPDIR": str(tmp_path)}
    subprocess.run(["bash", str(bundle / "run.sh"), str(out), "--dry-run"], check=True, env=env,
                   capture_output=True)
    install, check = [call.split("\n") for call in log.read_text().strip("-\n").split("\n--\n")]
    site = install[install.index("--target") + 1]
    assert install[2:9] == ["-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    assert sorted(Path(p).name for p in install[install.index("--target") + 2:]) == sorted(
        p.name for p in (bundle / "wheels").glob("*.whl"))
    assert check[0] == f"PYTHONPATH={site}:{bundle}/shims" and check[1] == "HF_HUB_OFFLINE=1"
    assert check[2:] == [f"{bundle}/gpu_check.py", "--bundle", f"{bundle}/manifest.json", "--site", site,
                         "--out", str(out), "--dry-run"]
    assert out.is_dir() and Path(site).parent == tmp_path


def test_a_requirement_the_image_does_not_meet_stops_the_bundle(tmp_path: Path):
    folder = tmp_path / "gpu-bundle"
    fake_wheel(folder, "transformers", "5.24.0", [*TRANSFORMERS_5_24, "safetensors>=0.9", "newdep>=1"])
    fake_wheel(folder, "huggingface-hub", "1.31.0", HUB_1_31)
    for name, (version, requires) in OTHERS.items():
        fake_wheel(folder, name, version, requires)
    with pytest.raises(SystemExit) as stopped:
        gpu_bundle.finish(folder)
    assert "transformers requires safetensors>=0.9; image at least: 0.8.0" in str(stopped.value)
    assert "transformers requires newdep>=1; neither carried nor in the image" in str(stopped.value)


def test_without_its_carried_hub_transformers_5_24_is_refused(bundle: Path):
    (bundle / "wheels" / "huggingface_hub-1.31.0-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit) as stopped:
        gpu_bundle.finish(bundle)
    assert "missing wheel: huggingface-hub" in str(stopped.value)
    assert "requires huggingface-hub<3.0,>=1.31.0; image at least: 1.5.0" in str(stopped.value)


def test_a_wheel_for_another_python_is_refused(bundle: Path):
    fake_wheel(bundle, "extra", "1.0", [], tag="cp311-cp311-manylinux_2_28_x86_64")
    with pytest.raises(ValueError, match="does not install on CPython 3.12"):
        gpu_bundle.finish(bundle)


def test_a_bundle_over_60_mib_is_refused(bundle: Path):
    with open(bundle / "wheels" / "padding.bin", "wb") as sparse:
        sparse.truncate(gpu_bundle.MAX_BYTES)
    with pytest.raises(SystemExit, match=r"over its 60 MiB"):
        gpu_bundle.finish(bundle)
