"""The offline GPU bundle (``nox -s gpu_bundle``): everything the lent GPU machine's image lacks, in one ignored
folder that travels with the working tree, and the ``run.sh`` that installs it there with no index and runs the
GPU check (``gpu/gpu_check.py``). See docs/gpu-check.md.

The image (:data:`IMAGE`) holds Python 3.12, torch 2.11.0 (CUDA), transformers 5.17.0 and triton 3.6.0. The bundle
carries, each pinned: transformers 5.24 and the dependencies whose minimum it (or a carried package) raises above
what the image's transformers 5.17.0 guarantees (:data:`DOWNLOADED`, wheels for CPython 3.12 manylinux x86-64),
fla, mamba-ssm built here without its CUDA code, packfree's own wheel, a stand-in for mamba-ssm's compiled scan,
the check script and ``manifest.json``. :func:`check_requirements` proves every carried wheel's requirements are met
by the bundle or the image, so nothing is found missing on the GPU machine. What cannot travel is in
:data:`NOT_CARRIED`; the check reports it as skipped, with the reason.

``python -m gpu.gpu_bundle download DIR [PIN ...]`` fetches the wheels; the nox session then builds mamba-ssm
and packfree into ``DIR/wheels``; ``python -m gpu.gpu_bundle finish DIR`` writes the rest, checks it, and
prints the bundle's size and the one command to run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
"""pip 23's ``--platform manylinux_2_28_x86_64`` alone does not match the older manylinux2014 wheels (hf-xet's)."""
MAX_BYTES = 60 * 2**20
"""What may travel (64 MiB carried in all), less room for the working tree's other ignored paths."""
RUN_TIMEOUT_S = 540
"""The ``run`` call's timeout: the check's own budget (gpu_check ``--budget``, 420 s) plus installs and start-up."""

IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "sentence-transformers": "6.0.1"}
"""The GPU machine's image, as far as it is known exactly (plus accelerate, peft, hypothesis, pytest, einops)."""
IMAGE_FLOORS = {
    # what transformers 5.17.0 requires (so the image has at least this) ...
    "huggingface-hub": "1.5.0", "packaging": "20.9", "pyyaml": "5.1", "regex": "2025.10.22",
    "tokenizers": "0.23.1", "typer": "0", "safetensors": "0.8.0", "tqdm": "4.60",
    # ... and what huggingface_hub 1.5.0 requires (packaging: >= 20.9; typer's click: >= 8.0)
    "filelock": "3.10.0", "fsspec": "2023.5.0", "hf-xet": "1.2.0", "httpx": "0.23.0", "typing-extensions": "4.1.0",
    "click": "8.0.0", "einops": "0",
    "numpy": "1.26.0",  # transformers asks >= 1.17; 1.26.0 is numpy's first release for CPython 3.12
}
"""The least version of each package the image must hold for its own transformers 5.17.0 to import."""


@dataclass(frozen=True)
class Carried:
    """One pinned wheel fetched from the registry and why it travels."""

    name: str
    version: str
    reason: str

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"


DOWNLOADED = (
    Carried("transformers", "5.24.0", "the newest release packfree is tested on; the image has 5.17.0"),
    Carried("huggingface-hub", "1.31.0", "transformers 5.24 requires >= 1.31.0 (5.17: >= 1.5.0)"),
    Carried("hf-xet", "1.8.0", "huggingface_hub 1.31 requires >= 1.5.2 (1.5: >= 1.2.0)"),
    Carried("click", "8.5.1", "huggingface_hub 1.31 requires >= 8.4.2 (the image's comes with typer: >= 8.0)"),
)
KERNEL_REASON = "the kernel test mode's pin (noxfile KERNEL_PACKAGES): fla's Triton GDN / KDA kernels"
BUILT = {
    "mamba-ssm": "built here without its CUDA code (noxfile PYTHON_ONLY): its Triton SSD kernels, which packfree "
                 "routes Mamba2 to",
    "packfree": "this tree, built as a wheel",
}
NOT_CARRIED = {
    "flash-attn": "CUDA build: no prebuilt wheel for torch 2.11+cu130 travels, and its Python alone cannot run",
    "causal-conv1d": "CUDA build: no prebuilt wheel for torch 2.11+cu130 travels, and its Python alone cannot run",
    "kernels-hub": "needs the network (kernels.get_kernel downloads its build from the Hub)",
    "selective_scan_cuda": "mamba-ssm's compiled Mamba1 scan (CUDA build); packfree never calls it, and a stand-in "
                           "module that raises if called lets mamba-ssm import",
}
"""What the GPU machine runs without, and why: the check reports each as skipped with this reason."""
UNUSED_REQUIREMENTS = {
    "ninja": "mamba-ssm's build tool; nothing is compiled there",
    "setuptools": "mamba-ssm's build requirement",
    "tilelang": "mamba-ssm's optional Mamba3 kernels, imported under try",
    "apache-tvm-ffi": "tilelang's",
    "quack-kernels": "mamba-ssm's optional CuTe kernels, imported under try",
    "kernels": "the kernels hub, which needs the network (NOT_CARRIED)",
}
"""Declared requirements of carried wheels that the check never imports."""
KNOWN_GAPS = {
    ("packfree", "torch"): "packfree's declared torch range reaches 2.11 with issue 27 item 1; nothing reads it at "
                           "run time (pip --no-deps)",
}
"""Requirement gaps reported as notes rather than failures: ``(wheel, requirement): why``."""
STANDIN = '''"""Stand-in for mamba-ssm's compiled CUDA scan, which the bundle does not carry (gpu_bundle.NOT_CARRIED).

mamba-ssm imports it at import time; packfree never calls it (its Mamba2 route is mamba-ssm's Triton SSD).
"""


def _not_carried(*args, **kwargs):
    raise RuntimeError("selective_scan_cuda is not in the GPU bundle: mamba-ssm's compiled scan was not built")


fwd = bwd = _not_carried
'''


def download_command(folder: Path, pins: list[str]) -> list[str]:
    """``pip download`` of ``pins`` as wheels for CPython 3.12 on manylinux x86-64, no dependencies."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            PYTHON, "--implementation", "cp", *platforms, "--dest", str(folder / "wheels"), *pins]


def download(folder: Path, extra_pins: list[str]) -> None:
    """Empty ``folder``, then fetch :data:`DOWNLOADED` and ``extra_pins`` into ``folder/wheels``."""
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "wheels").mkdir(parents=True)
    subprocess.run(download_command(folder, [c.pin for c in DOWNLOADED] + extra_pins), check=True)


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode())


def wheels_of(folder: Path) -> dict[str, tuple[str, Path]]:
    """``{canonical name: (version, wheel path)}`` for ``folder/wheels``; raises if a name repeats."""
    found: dict[str, tuple[str, Path]] = {}
    for wheel in sorted((folder / "wheels").glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if not any(t.interpreter in ("py3", "cp312") or t.abi == "abi3" for t in tags):
            raise ValueError(f"{wheel.name} does not install on CPython {PYTHON}")
        if name in found:
            raise ValueError(f"two wheels of {name} in {folder / 'wheels'}")
        found[name] = (str(version), wheel)
    return found


def check_requirements(wheels: dict[str, tuple[str, Path]]) -> tuple[list[str], list[str]]:
    """``(gaps, notes)``: each carried wheel's requirement (on CPython 3.12, Linux x86-64) that neither a carried
    wheel nor the image (:data:`IMAGE`, else at least :data:`IMAGE_FLOORS`) meets; notes for :data:`KNOWN_GAPS`."""
    environment = default_environment() | {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0",
                                           "platform_machine": "x86_64", "sys_platform": "linux",
                                           "platform_system": "Linux", "extra": ""}
    image = {canonicalize_name(k): v for k, v in IMAGE.items()}
    floors = {canonicalize_name(k): v for k, v in IMAGE_FLOORS.items()}
    gaps, notes = [], []
    for owner, (_, wheel) in wheels.items():
        for line in _metadata(wheel).get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            name = canonicalize_name(requirement.name)
            if name in UNUSED_REQUIREMENTS:
                continue
            have, where = (wheels[name][0], "carried") if name in wheels else (
                (image[name], "image") if name in image else (floors.get(name), "image at least"))
            if have is not None and requirement.specifier.contains(Version(have), prereleases=True):
                continue
            problem = f"{owner} requires {requirement}; " + (f"{where}: {have}" if have else "neither carried nor "
                                                                                           "in the image")
            known = KNOWN_GAPS.get((owner, name))
            (notes if known else gaps).append(problem + (f" ({known})" if known else ""))
    return gaps, notes


def run_script(wheel_names: list[str]) -> str:
    """``run.sh``: install the listed wheels (no index, no dependencies) into a fresh folder, put it and the
    stand-ins first on ``PYTHONPATH``, run the check into the folder given as ``$1``."""
    wheels = " \\\n  ".join(f'"$bundle/wheels/{name}"' for name in wheel_names)
    return f"""#!/usr/bin/env bash
# packfree's GPU check, offline, from this bundle (gpu/gpu_bundle.py wrote it; docs/gpu-check.md):
#   bash gpu-bundle/run.sh OUT [gpu_check arguments]    writes OUT/gpu.md and OUT/gpu.json
# PYTHON picks the interpreter (default python3); nothing is fetched.
set -euo pipefail
bundle="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
out="${{1:?usage: run.sh OUT [gpu_check arguments]}}"
shift
python="${{PYTHON:-python3}}"
site="$(mktemp -d "${{TMPDIR:-/tmp}}/packfree-gpu-site.XXXXXX")"
mkdir -p "$out"
start=$SECONDS
"$python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" \\
  {wheels}
echo "bundle installed into $site in $((SECONDS - start)) s" >&2
export PYTHONPATH="$site:$bundle/shims${{PYTHONPATH:+:$PYTHONPATH}}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "$python" "$bundle/gpu_check.py" --bundle "$bundle/manifest.json" --site "$site" --out "$out" "$@"
"""


def one_call(folder: str) -> str:
    """The one call that runs the bundle on a lent machine."""
    return (f"run(command='bash {folder}/run.sh \"$OUT\"', carry=[\"{folder}\"], timeout_s={RUN_TIMEOUT_S})"
            f"   # gpu.md and gpu.json come back from $OUT")


def size_of(folder: Path) -> int:
    """Bytes of every file under ``folder`` (what travels)."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _commit() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


CHECK_FILES = ("gpu_check.py", "gpu_setup.py")
"""The check's files, copied beside ``run.sh``: gpu_check.py runs as a script and imports gpu_setup.py."""


def finish(folder: Path) -> dict:
    """Write the manifest, ``run.sh``, the stand-in and the check into ``folder`` (its ``wheels/`` filled); raise
    ``SystemExit`` if a wheel is missing, a requirement is unmet or the bundle is over :data:`MAX_BYTES`."""
    wheels = wheels_of(folder)
    expected = {canonicalize_name(c.name): c for c in DOWNLOADED}
    missing = [name for name in [*expected, *BUILT, "fla-core", "flash-linear-attention"] if name not in wheels]
    wrong = [f"{name} {wheels[name][0]} (pinned {c.version})" for name, c in expected.items()
             if name in wheels and wheels[name][0] != c.version]
    gaps, notes = check_requirements(wheels)
    problems = [f"missing wheel: {m}" for m in missing] + [f"wrong version: {w}" for w in wrong] + gaps
    (folder / "shims").mkdir(exist_ok=True)
    (folder / "shims" / "selective_scan_cuda.py").write_text(STANDIN)
    for name in CHECK_FILES:
        shutil.copy(Path(__file__).with_name(name), folder / name)
    run_sh = folder / "run.sh"
    run_sh.write_text(run_script([path.name for _, path in wheels.values()]))
    run_sh.chmod(0o755)
    carried = []
    for name, (version, path) in wheels.items():
        reason = expected[name].reason if name in expected else BUILT.get(name, KERNEL_REASON)
        carried.append({"name": name, "version": version, "file": path.name, "bytes": path.stat().st_size,
                        "sha256": _sha256(path), "reason": reason})
    manifest = {"python": PYTHON, "platforms": list(PLATFORMS), "image": IMAGE, "commit": _commit(),
                "carried": carried, "not_carried": NOT_CARRIED, "notes": notes,
                "configs": "built in code (transformers' config classes, packfree_plugin.cli.tiny); no hub, no data "
                           "file", "command": one_call(folder.name), "max_bytes": MAX_BYTES}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    size = size_of(folder)
    if size > MAX_BYTES:
        problems.append(f"the bundle is {size / 2**20:.1f} MiB, over its {MAX_BYTES / 2**20:.0f} MiB")
    for note in notes:
        print(f"note: {note}")
    if problems:
        raise SystemExit("gpu bundle not ready:\n  " + "\n  ".join(problems))
    print(f"gpu bundle: {folder} holds {len(carried)} wheels, {size / 2**20:.1f} MiB of {MAX_BYTES / 2**20:.0f} "
          f"MiB\nrun it on a lent GPU machine in one call:\n  {manifest['command']}")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["download", "finish"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("pins", nargs="*", help="more pinned wheels to fetch (download)")
    args = parser.parse_args(argv)
    if args.step == "download":
        download(args.folder, args.pins)
    else:
        finish(args.folder)


if __name__ == "__main__":
    main()
