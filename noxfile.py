"""Developer and CI entry points. ``python3 -m nox -s tests`` is the README's (and CI's) test command."""

from __future__ import annotations

import os
import secrets

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU wheel this machine keeps on disk; unpinned torch pulls a multi-GB CUDA build


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH)
    session.install(f".[{extras}]")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: train a small GDN hybrid on GSM8K padded and packed; report + plot in packfree-report/."""
    _install(session, "demo")
    session.run("python", "-m", "packfree_plugin", "demo", *session.posargs)


@nox.session
def examples(session: nox.Session) -> None:
    """Every recipe in examples/ in its ``--tiny`` mode, in an environment with only what the README's install gives
    (``pip install ".[integrations]"``) and pytest to run them: tests/test_examples.py without the suite's conftest,
    which needs the test extra. A recipe that needs anything more fails here."""
    _install(session, "integrations")
    session.install("pytest>=8")
    session.run("python", "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "tests/test_examples.py",
                *session.posargs)


@nox.session
def demo_vlm(session: nox.Session) -> None:
    """The vision-language demo: a small Qwen2-VL on the embedded captioned images, padded and packed."""
    _install(session, "demo")
    session.run("python", "-m", "packfree_plugin", "demo-vlm", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The default suite (Hypothesis profile ``ci``), in file order (pyproject's addopts: ``-p no:randomly``)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session(name="random")
def random_order(session: nox.Session) -> None:
    """The default suite in a random order (pytest-randomly shuffles files, then the tests in each), with its seed
    printed before and after the run; ``nox -s random -- --randomly-seed=N`` replays one order. Only the order is
    random: every test still starts from the seeds tests/conftest.py gives it (``--randomly-dont-reset-seed``)."""
    _install(session)
    seed = []
    if not any(arg.startswith("--randomly-seed") for arg in session.posargs):
        seed = [f"--randomly-seed={secrets.randbits(32)}"]
        session.log(f"random order {seed[0]} (replay: nox -s random -- {seed[0]})")
    session.run("python", "-m", "pytest", "-q", "-p", "randomly", "--randomly-dont-reset-seed", *seed,
                *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def alone(session: nox.Session) -> None:
    """Every test file of the default suite alone, one pytest process per file (tooling/alone.py), then the files
    that fail alone and their failing tests: such a file depends on what an earlier file left behind. It costs the
    suite's time plus one start of torch and transformers per file (about 90 files); ``nox -s alone -- --files
    tests/gate`` runs some files, ``-- --jobs 2`` two at once."""
    _install(session)
    session.run("python", "-m", "tooling.alone", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci"})


OLDEST_TRANSFORMERS = "5.20.0"  # packfree_plugin.compat.OLDEST_TRANSFORMERS
NEWEST_TRANSFORMERS = "5.25.0"  # packfree_plugin.compat.NEWEST_TESTED_TRANSFORMERS
COMPAT_TRANSFORMERS = [OLDEST_TRANSFORMERS, "5.24.0", NEWEST_TRANSFORMERS]
"""The transformers releases ``nox -s compat`` runs on every torch: the oldest declared, the one before the newest
(the last release without a compatible ``kernels`` seam for the mixers), the newest tested."""
COMPAT_TORCH = ["2.11.0", "2.13.0", "2.14.1", "2.15.0"]
"""The torch releases ``nox -s compat`` runs; the first and the last bound pyproject's ``torch`` range."""
COMPAT_TESTS = ["tests/ops", "tests/attention", "tests/models", "tests/test_boundaries.py", "tests/gate/test_proof.py",
                "tests/test_compat.py"]
"""What differs between releases: the attention and mixer ops, every model family against stock, the proof."""
OLDEST_INTEGRATIONS = ["trl==1.16.0", "peft==0.21.0", "accelerate==1.10.1", "sentence-transformers==6.2.0",
                       "deepspeed==0.19.8"]
"""The oldest releases pyproject's ``integrations`` extra declares (``nox -s compat_integrations`` runs them)."""
INTEGRATION_TESTS = ["tests/e2e/test_trl.py", "tests/e2e/test_peft.py", "tests/e2e/test_sentence_transformers.py",
                     "tests/integrations", "tests/test_compat.py"]


@nox.session
@nox.parametrize("torch", COMPAT_TORCH, ids=COMPAT_TORCH)
def compat(session: nox.Session, torch: str) -> None:
    """The model, op and proof tests on one torch release with each of :data:`COMPAT_TRANSFORMERS` (one environment
    per torch, so each multi-GB build is installed once): ``nox -s compat`` runs every torch, ``nox -s "compat(2.14.1)"`` one, ``nox -s compat -- tests`` the whole default suite."""
    pin = f"torch=={torch}"
    session.install(pin)
    session.install(".[test]")  # unpinned, as a user would: pip must keep the torch already there
    session.run("python", "-c", f"import torch; assert torch.__version__.split('+')[0] == {torch!r}, torch.__version__")
    for transformers in COMPAT_TRANSFORMERS:
        session.install(f"transformers=={transformers}", pin)
        session.run("python", "-m", "pytest", "-q", *(session.posargs or COMPAT_TESTS),
                    env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def compat_integrations(session: nox.Session) -> None:
    """The TRL and PEFT tests on the oldest integration releases declared, with the oldest transformers."""
    _install(session)
    session.install(f"transformers=={OLDEST_TRANSFORMERS}", *OLDEST_INTEGRATIONS, TORCH)
    session.run("python", "-m", "pytest", "-q", *(session.posargs or INTEGRATION_TESTS),
                env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session
def thorough(session: nox.Session) -> None:
    """The suite with the heavier Hypothesis profile (``thorough``)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs, env={"HYPOTHESIS_PROFILE": "thorough"})


@nox.session
def sweep(session: nox.Session) -> None:
    """Prove every model type of the installed transformers (tooling/sweep); regenerate gate/verified.json, the
    support matrix in docs/support-matrix.md and docs/gate-checks.md."""
    _install(session)
    session.run("python", "-m", "tooling.sweep", *session.posargs)


MUTMUT = "mutmut==3.8.1"
MUTANTS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": "ci"}
"""One OpenMP thread: mutmut forks a worker per mutant from a process that has run torch, and a forked OpenMP pool
can hang."""
MUTANTS_SAMPLE = "packfree_plugin.*[15]"
"""What ``nox -s mutants`` runs by default: the mutants of every mutated function numbered 1, 5, 11, 15, 21, ...,
a fifth of them (docs/testing.md says why and how long it takes)."""


def _mutant_scores() -> None:
    """Print, per mutated module, how its mutants checked ended (mutmut's ``mutants/*.meta``), then the survivors
    and timeouts by name."""
    import json
    from collections import Counter
    from pathlib import Path

    outcome = {0: "survived", 1: "killed", 3: "killed", 5: "no tests", 33: "no tests", 36: "timeout", -24: "timeout",
               24: "timeout", 152: "timeout", 255: "timeout"}
    print(f"{'module':38} {'mutants':>8} {'checked':>8} {'killed':>7} {'survived':>9} {'timeout':>8} {'no tests':>9} "
          f"{'other':>6}")
    left: list[str] = []
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts = Counter(outcome.get(code, "other") for code in codes.values() if code is not None)
        module = str(meta.relative_to("mutants")).removesuffix(".py.meta").replace("/", ".")
        print(f"{module:38} {len(codes):>8} {sum(counts.values()):>8} {counts['killed']:>7} {counts['survived']:>9} "
              f"{counts['timeout']:>8} {counts['no tests']:>9} {counts['other']:>6}")
        left += [f"{outcome.get(code, 'other')}: {name}" for name, code in codes.items()
                 if code is not None and outcome.get(code) not in ("killed", "no tests")]
    print("\n".join(sorted(left)))


@nox.session
def mutants(session: nox.Session) -> None:
    """Planted bugs (docs/testing.md): mutmut mutates the modules that decide correctness (``[tool.mutmut]`` in
    pyproject.toml) and runs against each mutant the tests of its module that call the mutated function
    (tests/mutants_plugin.py); prints the score per module and the survivors. Not in CI: run it before a stop that
    changes those modules. ``nox -s mutants`` runs :data:`MUTANTS_SAMPLE`; ``-- "packfree_plugin.boundaries.*"``
    one package, ``-- NAME`` one mutant, ``-- "*"`` all; ``mutmut show NAME`` (in .nox/mutants) prints a mutant."""
    _install(session)
    session.install(MUTMUT, TORCH)
    session.run("mutmut", "run", "--max-children", "2", *(session.posargs or [MUTANTS_SAMPLE]), env=MUTANTS_ENV)
    _mutant_scores()


@nox.session
def bench(session: nox.Session) -> None:
    """Speed and memory ratios against baselines measured in the same run (never asserted in tests), the
    real-sizes table and one packed row over 4 ranks (DeepSpeed Ulysses) included; ``nox -s bench -- --quick`` for one
    repeat."""
    _install(session)
    session.run("python", "-m", "benchmarks", *session.posargs)


KERNEL_PACKAGES = ["triton==3.9.0", "fla-core==0.6.0", "flash-linear-attention==0.6.0", "einops",
                   "liger-kernel==0.8.5", "trl>=1.16"]  # tests/kernels/test_liger.py: Liger alone and through TRL
PYTHON_ONLY = {
    # package: the environment that skips its CUDA build (and the prebuilt-wheel lookup, which needs CUDA torch)
    "mamba-ssm==2.3.2.post1": {"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"},  # Triton kernels kept
    "causal-conv1d==1.6.1": {"CAUSAL_CONV1D_SKIP_CUDA_BUILD": "TRUE", "CAUSAL_CONV1D_FORCE_BUILD": "TRUE"},
    "flash-attn==2.8.3": {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"},
}
"""Installed without their compiled CUDA code; the kernel test mode runs their Python (tests/kernels/standins.py)."""


@nox.session
def kernels(session: nox.Session) -> None:
    """packfree's kernel routes against the real fla and mamba-ssm Triton kernels, interpreted on CPU tensors, and
    the real Python of flash-attn, causal-conv1d and torch's varlen_attn over stand-ins for their compiled code
    (tests/README.md); ``nox -s kernels -- -m kernels_smoke tests/kernels`` runs the smoke subset."""
    session.install(TORCH)
    session.install(".", "pytest>=8", "hypothesis>=6.100", "setuptools", "wheel", "packaging", *KERNEL_PACKAGES, TORCH)
    for package, env in PYTHON_ONLY.items():
        session.install("--no-build-isolation", "--no-deps", package, env=env)
    session.run("python", "-m", "pytest", "-q", *(session.posargs or ["tests/kernels"]),
                env={"HYPOTHESIS_PROFILE": "ci"})


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """On a CUDA machine with a CUDA torch (sized for < 8 min, installs included): installs transformers, kernels, fla,
    tries flash-attn / mamba-ssm / causal-conv1d as prebuilt wheels (skipped if they do not install in time), then
    checks packfree against stock transformers on the same GPU; writes gpu-results/gpu.md and gpu.json.
    ``nox -s gpu -- --dry-run`` runs every check on the CPU with no CUDA call and installs nothing."""
    install = [] if "--dry-run" in session.posargs else ["--install", "--install-timeout", "60"]
    session.run("python", "-m", "gpu.gpu_check", *install, *session.posargs, env={"PYTHONPATH": os.getcwd()})


@nox.session
def distributed(session: nox.Session) -> None:
    """One packed row split over 2 and 4 CPU ranks (gloo): DeepSpeed Ulysses and packfree's head-parallel mixers
    equal the stock model on each sample alone, every case (the default suite runs a subset), torch's
    context_parallel refused (tests/parallel), plus data parallelism (tests/e2e/test_distributed.py)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "tests/parallel", "tests/e2e/test_distributed.py", *session.posargs,
                env={"HYPOTHESIS_PROFILE": "ci", "PACKFREE_SP_FULL": "1"})


UPSTREAM_TEST_REQUIREMENTS = ["parameterized>=0.9", "httpx>=0.27", "pytest-timeout>=2.3", "timeout-decorator>=0.5"]


@nox.session
def upstream(session: nox.Session) -> None:
    """transformers' own padding-free tests with stock sdpa and with packfree in FlashAttention's place, on the CPU;
    writes docs/upstream-padding-free.md. ``nox -s upstream -- PATH [--models llama bert]``, PATH holding
    transformers' ``tests/`` and ``utils/`` folders of a release (see that file for how to get them)."""
    if not session.posargs:
        session.error("give the path of a folder holding transformers' tests/ and utils/ (nox -s upstream -- PATH)")
    _install(session)
    session.install(*UPSTREAM_TEST_REQUIREMENTS)
    session.run("python", "-m", "tests.upstream.run", *session.posargs)


@nox.session
def upstream_trl(session: nox.Session) -> None:
    """TRL's own DPO, reward and GRPO trainer tests offline on the CPU, stock against packfree's Packed* trainers
    (docs/rl.md, "TRL's own tests"). ``nox -s upstream_trl -- PATH [--files ...] [-k EXPR]``, PATH a TRL checkout
    holding ``tests/``; results in ``trl-upstream-results/``."""
    if not session.posargs:
        session.error("give the path of a TRL checkout holding tests/ (nox -s upstream_trl -- PATH)")
    _install(session)
    session.install("psutil>=5.9")
    session.run("python", "-m", "tests.upstream.trl_run", *session.posargs)


GPU_IMAGE = ["torch==2.11.0", "triton==3.6.0", "transformers==5.17.0", "accelerate==1.15.0", "peft==0.21.2",
             "sentence-transformers==6.0.1", "hypothesis==6.170.17", "pytest==9.2.0", "einops==0.8.2"]
"""The lent GPU machine's image as pinned packages (its torch is the CUDA 2.11.0 build; here it runs on the CPU)."""
GPU_BUNDLE = "gpu-bundle"  # ignored (.gitignore): what the GPU machine lacks, carried with the working tree


@nox.session
def gpu_bundle(session: nox.Session) -> None:
    """Fill gpu-bundle/ with everything the GPU machine's image lacks (gpu/gpu_bundle.py): pinned CPython 3.12
    wheels, fla, mamba-ssm without its CUDA code, packfree's own wheel, run.sh; prints its size and the one call."""
    session.install(TORCH)
    session.install("setuptools", "wheel", "packaging", "ninja", TORCH)
    wheels = os.path.join(GPU_BUNDLE, "wheels")
    env = {"PYTHONPATH": os.getcwd()}
    fla = [pin for pin in KERNEL_PACKAGES if pin.startswith(("fla-core", "flash-linear-attention"))]
    session.run("python", "-m", "gpu.gpu_bundle", "download", GPU_BUNDLE, *fla, env=env)
    mamba = next(pin for pin in PYTHON_ONLY if pin.startswith("mamba-ssm"))
    session.run("python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", wheels, mamba,
                env=PYTHON_ONLY[mamba])
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", wheels, ".")
    session.run("python", "-m", "gpu.gpu_bundle", "finish", GPU_BUNDLE, env=env)


@nox.session(python=["3.12"])
def gpu_rehearsal(session: nox.Session) -> None:
    """The GPU run rehearsed here: a fresh venv holding only the image's packages (torch 2.11.0, transformers 5.17.0,
    ...), then gpu-bundle/run.sh with no index and no network, running the check's CPU dry run end to end."""
    session.install(*GPU_IMAGE)
    out = os.path.join(session.create_tmp(), "gpu-results")
    offline = {"PIP_NO_INDEX": "1", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
               "PYTHON": os.path.join(session.bin, "python")}
    session.run("bash", f"{GPU_BUNDLE}/run.sh", out, "--dry-run", *session.posargs, env=offline, external=True)
