"""Run every benchmark once and print (and save) their tables: ``python -m benchmarks [--quick]``."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

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
    "load-time gate": "benchmarks.gate_cost",
    "one packed row over 4 ranks (Ulysses)": "benchmarks.sequence_parallel",
}


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    parser.add_argument("--out", default="bench-results", help="folder for bench.md and bench.json")
    parser.add_argument("--only", choices=list(SUITES), action="append", help="run only these suites")
    args = parser.parse_args()
    results, sections = {}, []
    for title, module_name in SUITES.items():
        if args.only and title not in args.only:
            continue
        module = importlib.import_module(module_name)
        rows = module.run(quick=args.quick)
        results[title] = rows
        table = module.markdown(rows) if hasattr(module, "markdown") else _table(rows)
        sections.append(f"## {title}\n\n{table}\n")
        print(sections[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text("# packfree benchmarks\n\n" + "\n".join(sections))
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print(f"saved {out / 'bench.md'} and {out / 'bench.json'}")


if __name__ == "__main__":
    main()
