"""Run TRL's own DPO, reward and GRPO trainer tests offline on the CPU, stock (TRL's trainers on ``sdpa``) and with
packfree (``Packed*`` trainers, ``attn_implementation="packfree"``, DPO's ``padding_free`` on), and print the
counts and every test packfree fails that stock passes.

    python -m tests.upstream.trl_run CHECKOUT [--files test_dpo_trainer.py ...] [-k EXPR] [--out results-dir]

``CHECKOUT`` is a TRL checkout holding ``tests/`` (nothing of it is copied into this project). The models and
datasets the tests load from the Hub are local stand-ins (:mod:`tests.upstream.trl_offline`, a hub cache built
once in ``--out``); the plugin ``trl_packfree_plugin`` beside this file does the rest. Both implementations run
at once, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.upstream import trl_offline

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent.parent

IMPLEMENTATIONS = ("sdpa", "packfree")
DEFAULT_FILES = ("test_dpo_trainer.py", "test_reward_trainer.py", "test_grpo_trainer.py")
# Trainer tests only (collators need no model); vision-language models, Liger, vLLM, quantisation and the remote-code
# models have no offline stand-in or no CPU path under either implementation.
DEFAULT_SELECTION = ("Trainer and not Collator and not VLM and not vlm and not liger and not vllm and not quantization"
                     " and not Slow and not remote_code and not image")


def read_results(path: Path) -> dict[str, dict]:
    """``{test id: result}`` of one implementation's JSON-lines file (the last line per test wins)."""
    if not path.exists():
        return {}
    results = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            result = json.loads(line)
            results[result["test"]] = result
    return results


def regressions(stock: dict[str, dict], packfree: dict[str, dict]) -> list[tuple[str, str]]:
    """``(test, packfree's error)`` for every test stock passes and packfree does not (or has no result for)."""
    return [(test, packfree.get(test, {"detail": "no result"})["detail"] or packfree[test]["outcome"])
            for test, result in sorted(stock.items())
            if result["outcome"] == "passed" and packfree.get(test, {}).get("outcome") != "passed"]


def render(stock: dict[str, dict], packfree: dict[str, dict], runtimes: dict[str, float]) -> str:
    """Markdown: counts per implementation, how many packfree passes ran packed batches, and the regressions."""
    counts = {impl: Counter(r["outcome"] for r in rs.values()) for impl, rs in (("sdpa", stock), ("packfree", packfree))}
    lines = ["| outcome | stock (sdpa) | packfree |", "| --- | ---: | ---: |"]
    for outcome in ("passed", "failed", "skipped"):
        lines.append(f"| {outcome} | {counts['sdpa'][outcome]} | {counts['packfree'][outcome]} |")
    packed = sum(1 for r in packfree.values() if r["outcome"] == "passed" and r.get("packed_batches", 0) > 0)
    lines += ["", f"packfree passes that ran packed batches: {packed} of {counts['packfree']['passed']}; runtime: "
              + ", ".join(f"{impl} {runtimes.get(impl, 0.0) / 60:.1f} min" for impl in IMPLEMENTATIONS), ""]
    lost = regressions(stock, packfree)
    lines.append(f"Tests stock passes and packfree fails: {len(lost)}")
    lines += [f"- `{test}`: {detail}" for test, detail in lost]
    return "\n".join(lines) + "\n"


def run(checkout: Path, files: list[str], selection: str, out: Path, timeout_s: int) -> dict[str, float]:
    """Both implementations' pytest processes at once; their results go to ``out/<impl>.jsonl``."""
    hub = out / "hub"
    trl_offline.build_hub_cache(hub)
    processes, started = {}, time.monotonic()
    runtimes: dict[str, float] = {}
    for impl in IMPLEMENTATIONS:
        results = out / f"{impl}.jsonl"
        results.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(PROJECT), os.environ.get("PYTHONPATH", "")]),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_CACHE": str(hub),
               "PACKFREE_TRL_IMPL": impl, "PACKFREE_TRL_RESULTS": str(results), "OMP_NUM_THREADS": "1",
               "PACKFREE_AUTOLOAD": "1" if impl == "packfree" else "0"}
        command = [sys.executable, "-m", "pytest", "-p", "trl_packfree_plugin", "-p", "no:cacheprovider",
                   "-p", "no:randomly", "--rootdir", str(checkout), "-q", "-rN", "-W", "ignore", "-k", selection,
                   *(f"tests/{name}" for name in files)]
        log = (out / f"{impl}.log").open("w")
        processes[impl] = subprocess.Popen(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    for impl, process in processes.items():
        try:
            process.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
        runtimes[impl] = time.monotonic() - started
    return runtimes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a TRL checkout holding tests/")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("-k", dest="selection", default=DEFAULT_SELECTION, help="pytest -k expression")
    parser.add_argument("--out", type=Path, default=Path("trl-upstream-results"))
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for both runs together")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runtimes = run(args.checkout.resolve(), args.files, args.selection, args.out.resolve(), args.timeout)
    report = render(read_results(args.out / "sdpa.jsonl"), read_results(args.out / "packfree.jsonl"), runtimes)
    (args.out / "report.md").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
