"""Run every test file of the default suite alone, one pytest process per file, and summarise the failures.

``python -m tooling.alone`` (``nox -s alone``). A file that passes in suite order but fails alone depends on what an
earlier file left behind (an import, a registration, a cache); one that passes alone but fails in suite order left
something behind itself. ``nox -s random`` finds the second kind, this the first. Arguments after ``--`` go to each
pytest process (``-- -x``, ``-- -k llama``); ``--files`` picks files; ``--jobs`` runs several files at once.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5
"""pytest's exit status when a file collects nothing (every test deselected on this transformers): not a failure."""
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)")


@dataclass
class FileRun:
    """One file's run alone: its exit status, wall time, the failing test ids and pytest's last line."""

    path: str
    returncode: int
    seconds: float
    failures: list[str]
    last_line: str

    @property
    def passed(self) -> bool:
        return self.returncode in (0, NO_TESTS)


def collected_files(paths: Sequence[str]) -> list[str]:
    """The test files pytest collects from ``paths`` (default: the configured testpaths), in collection order."""
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *paths],
                             cwd=ROOT, capture_output=True, text=True, check=False)
    files = dict.fromkeys(line.split("::")[0] for line in listing.stdout.splitlines() if "::" in line)
    if not files:
        raise SystemExit(f"pytest collected no test file:\n{listing.stdout[-2000:]}{listing.stderr[-2000:]}")
    return list(files)


def run_alone(path: str, pytest_args: Sequence[str], log_dir: Path) -> FileRun:
    """Run one file in its own pytest process (in file order: pyproject's addopts); its output goes to ``log_dir``."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, path],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    (log_dir / (path.replace("/", "__") + ".log")).write_text(output)
    failures = [match.group(2) for line in output.splitlines() if (match := _SUMMARY.match(line))]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return FileRun(path, done.returncode, seconds, failures, lines[-1] if lines else "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the files, print one line per file as it ends, then the failing files and their failing tests."""
    parser = argparse.ArgumentParser(prog="python -m tooling.alone", description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="*", default=[], help="files or folders (default: the whole default suite)")
    parser.add_argument("--jobs", type=int, default=1, help="files run at once (default 1; each test uses 2 threads)")
    parser.add_argument("--logs", help="folder for each file's output (default: a new temporary folder)")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [arg for arg in pytest_args if arg != "--"]
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="packfree-alone-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    files = collected_files(args.files)
    print(f"{len(files)} files, each alone ({args.jobs} at once); output of each in {log_dir}", flush=True)
    start = time.monotonic()
    runs: list[FileRun] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for run in pool.map(lambda path: run_alone(path, pytest_args, log_dir), files):
            runs.append(run)
            print(f"{'ok  ' if run.passed else 'FAIL'} {run.seconds:7.1f} s  {run.path}  {run.last_line}", flush=True)
    failed = [run for run in runs if not run.passed]
    print(f"\n{len(files) - len(failed)} of {len(files)} files pass alone in {time.monotonic() - start:.0f} s")
    for run in failed:
        print(f"\n{run.path} (exit {run.returncode}): {run.last_line}")
        for test in run.failures or ["(no test named: see its log)"]:
            print(f"    {test}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
