"""End-to-end training throughput on GSM8K: packfree vs padded, same model, samples and order, one run.

The HF ``Trainer`` trains the demo's Qwen3.5-like hybrid (Gated DeltaNet + attention) four times from the same
initial weights: padded (stock ``sdpa``, each step padded to its longest sample), the same padded batches under
``packfree``, those again with every token-mixing layer skipped (the floor of packfree's ops), and packed
(``packfree``, the same 16 samples of each step in one unpadded row, token budget 4096). Reported: real (non-padding)
tokens per second of training, each run's ratio to stock padded (packed: target >= 1.6x), packing efficiency, and the
largest per-step loss difference (stock padded against packed). Run with
``python -m benchmarks.training [--quick]``; ``nox -s bench`` runs it with the other benchmarks.
"""

from __future__ import annotations

import argparse

from packfree_plugin.cli.bench import markdown as _markdown
from packfree_plugin.cli.bench import training_rows


def run(quick: bool = False) -> list[dict]:
    return training_rows(quick)


def markdown(rows: list[dict]) -> str:
    return _markdown(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print(markdown(run(quick=parser.parse_args().quick)))
