"""Run every benchmark once and print (and save) their tables: ``python -m benchmarks [--quick] [--only SUITE]``.

Every table comes with the machine's load while its suite ran (:class:`packfree_plugin.cli.load.LoadWatch`); a suite
during which other processes took more than :data:`packfree_plugin.cli.load.OTHERS_PER_CORE` of each core is called
NOISY under its table: its ratios were taken on a loaded machine, which slows the packed path more than its
reference, and are no figures to quote."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from packfree_plugin.cli.load import LoadWatch

SUITES = {
    "attention": "benchmarks.attention",
    "linear-attention / recurrences": "benchmarks.ops_linear",
    "conv / SSD / selective scan": "benchmarks.ops_scan_conv",
    "native vs generic tier (MiniMax, RecurrentGemma)": "benchmarks.native_tiers",
    "short samples (16 of 4-32 tokens)": "benchmarks.short_samples",
    "real sizes (published widths)": "benchmarks.real_sizes",
    "training (GSM8K, HF Trainer)": "benchmarks.training",
    "DPO and GRPO scoring steps (GSM8K, TRL's fused LM head)": "benchmarks.rl",
    "sentence-transformers encode (MiniLM, GSM8K)": "benchmarks.sentence_embeddings",
    "compiled training step (inductor)": "benchmarks.compiled",
    "the loss on packed rows (per-sample mean, weights) vs the token mean": "benchmarks.loss",
    "load-time gate": "benchmarks.gate_cost",
    "one packed row over 4 ranks (Ulysses)": "benchmarks.sequence_parallel",
    "speed targets (issue 34)": "benchmarks.speed_targets",
}


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_note(load: LoadWatch) -> str:
    """The line under a suite's table: the machine's load while it ran, and NOISY when too loaded
    (:attr:`~packfree_plugin.cli.load.LoadWatch.too_loaded`)."""
    verdict = "NOISY: do not quote these ratios" if load.too_loaded else "quiet"
    return f"{load.describe()}; {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    parser.add_argument("--out", default="bench-results", help="folder for bench.md and bench.json")
    short_names = {module_name.rsplit(".", 1)[1]: title for title, module_name in SUITES.items()}
    parser.add_argument("--only", choices=[*SUITES, *short_names], action="append",
                        help="run only these suites (a title, or its module's name: --only speed_targets)")
    args = parser.parse_args()
    only = {short_names.get(name, name) for name in args.only or ()}
    results, sections, loads = {}, [], {}
    for title, module_name in SUITES.items():
        if only and title not in only:
            continue
        module = importlib.import_module(module_name)
        with LoadWatch() as load:
            rows = module.run(quick=args.quick)
        loads[title] = load.as_dict()
        results[title] = rows
        table = module.markdown(rows) if hasattr(module, "markdown") else _table(rows)
        sections.append(f"## {title}\n\n{table}\n\n{load_note(load)}\n")
        print(sections[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text("# packfree benchmarks\n\n" + "\n".join(sections))
    (out / "bench.json").write_text(json.dumps({**results, "load per core": loads}, indent=2))
    print(f"saved {out / 'bench.md'} and {out / 'bench.json'}")


if __name__ == "__main__":
    main()
