"""The GPU check's set-up rows (gpu/gpu_check.py): the ``--install`` step's pip installs, or the offline
bundle's wheels (``--bundle``, gpu/gpu_bundle.py) checked intact and imported from where ``run.sh`` put them;
and :func:`error_row`, the row every check writes for an exception it reports and goes past.

A file of its own beside gpu_check.py: the bundle carries both, and runs gpu_check.py as a plain script.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import time
from pathlib import Path

import torch

OPTIONAL_WHEELS = ("flash-attn", "mamba-ssm", "causal-conv1d")
REQUIRED = ("transformers==5.24.0", "kernels>=0.10", "flash-linear-attention")


def error_row(row: dict, error: BaseException) -> dict:
    """``row`` with ``status`` saying ``error: ...`` (cut to 240 characters)."""
    return row | {"status": f"error: {error!r}"[:240]}


def _pip(*args: str, timeout: float) -> tuple[bool, str]:
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    tail = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode == 0, tail[:160]


def install_rows(timeout: float, *, dry_run: bool) -> list[dict]:
    """pip-install transformers, kernels and fla (the installed torch pinned), then each optional CUDA package as a
    prebuilt wheel only; every install within ``timeout`` seconds. A failed install is a skip, not an error: the
    checks that need the package then say it is missing."""
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    plan = [("required: " + ", ".join(REQUIRED), (*REQUIRED, torch_pin))]
    plan += [(name, (name, "--only-binary=:all:", "--no-deps")) for name in OPTIONAL_WHEELS]
    rows = []
    for name, args in plan:
        row = {"check": f"install {name}"}
        if dry_run:
            rows.append(row | {"status": "skipped (dry run)"})
            continue
        start = time.perf_counter()
        ok, message = _pip(*args, timeout=timeout)
        rows.append(row | {"status": "ok" if ok else f"skipped ({message})", "ms": (time.perf_counter() - start) * 1e3})
    return rows


def bundle_rows(manifest: dict, site: Path | None, folder: Path) -> list[dict]:
    """The offline bundle (gpu/gpu_bundle.py): each carried wheel intact (its sha256) and imported from
    ``site`` at its pinned version, so it shadows the image's; each package that could not travel, skipped with why."""
    rows = []
    for entry in manifest["carried"]:
        row = {"check": f"bundle {entry['name']}=={entry['version']}"}
        try:
            wheel = folder / "wheels" / entry["file"]
            if hashlib.sha256(wheel.read_bytes()).hexdigest() != entry["sha256"]:
                rows.append(row | {"status": f"error: {entry['file']} differs from the manifest's sha256"})
                continue
            distribution = importlib.metadata.distribution(entry["name"])
            where = Path(distribution.locate_file("")).resolve()
            if distribution.version != entry["version"] or (site is not None and where != site.resolve()):
                rows.append(row | {"status": f"error: {entry['name']} {distribution.version} imports from {where}"})
                continue
            rows.append(row | {"status": "ok"})
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(error_row(row, error))
    for module in ("transformers", "fla.ops.gated_delta_rule", "fla.ops.kda", "mamba_ssm.ops.triton.ssd_combined"):
        row = {"check": f"bundle import {module}"}
        try:
            imported = importlib.import_module(module)
            inside = site is None or Path(imported.__file__).resolve().is_relative_to(site.resolve())
            rows.append(row | {"status": "ok" if inside else f"error: imported from {imported.__file__}"})
        except Exception as error:  # noqa: BLE001
            rows.append(error_row(row, error))
    return rows + [{"check": f"not carried: {name}", "status": f"skipped ({reason})"}
                   for name, reason in manifest["not_carried"].items()]
