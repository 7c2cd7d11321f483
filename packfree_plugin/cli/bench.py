"""``packfree bench``: the repository's benchmark tables when its ``benchmarks`` package is importable (a
source checkout), else a built-in table (end-to-end training tokens/s, packed vs padded); plus a PNG chart
of each table's ratio column."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["chart", "markdown", "run_bench", "training_rows"]


def training_rows(quick: bool = False, *, model_type: str = "qwen3_next") -> list[dict[str, Any]]:
    """End-to-end HF ``Trainer`` throughput on GSM8K: the demo's four runs (same model, samples, order): stock
    padded, packfree padded, its floor (token mixers skipped) and packfree packed."""
    import tempfile

    from .demo import DemoOptions, compare_training, summarize

    with tempfile.TemporaryDirectory() as out:
        options = DemoOptions(model_type=model_type, steps=6 if quick else 32, out=out, progress=False)
        result = compare_training(options)
    summary = summarize(result)
    config = result["config"]
    name = f"{config.model_type} {config.num_hidden_layers}L h{config.hidden_size}"
    rows = []
    for key in ("padded", "packfree_padded", "floor", "packed"):
        run = result[key]
        rows.append({
            "model": name, "run": f"{run.label} ({run.attn_implementation})", "steps": len(run.losses),
            "samples": result["samples"], "real tokens": run.real_tokens, "tokens run": run.slot_tokens,
            "efficiency": run.efficiency, "train s": run.seconds, "tokens/s": run.tokens_per_second,
            "x padded": run.tokens_per_second / result["padded"].tokens_per_second,
            "max loss diff": summary["max_loss_diff"],
        })
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | run | steps | real tokens | tokens run | packing efficiency | train s | tokens/s | x padded "
             "| max loss diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['run']} | {r['steps']} | {r['real tokens']:,} | {r['tokens run']:,} | "
                     f"{r['efficiency']:.1%} | {r['train s']:.1f} | {r['tokens/s']:,.0f} | {r['x padded']:.2f} | "
                     f"{r['max loss diff']:.1e} |")
    return "\n".join(lines)


def _ratio_column(rows: list[dict[str, Any]]) -> str | None:
    numeric = [k for k in dict.fromkeys(k for r in rows for k in r) if any(isinstance(r.get(k), (int, float))
                                                                             and not isinstance(r.get(k), bool)
                                                                             for r in rows)]
    for hint in ("x ", "speedup", "ratio", "tokens/s", "seconds"):
        for key in numeric:
            if hint in key.lower():
                return key
    return numeric[-1] if numeric else None


def chart(results: dict[str, list[dict[str, Any]]], path: str | Path) -> Path | None:
    """One horizontal bar chart per table, of its ratio column (``x ...``, speedup, else tokens/s or seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = [(title, rows, _ratio_column(rows)) for title, rows in results.items() if rows]
    panels = [p for p in panels if p[2] is not None]
    if not panels:
        return None
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.35 * sum(len(p[1]) for p in panels)),
                                squeeze=False)
    for axis, (title, rows, column) in zip(axes[:, 0], panels):
        labels, values = [], []
        for row in rows:
            value = row.get(column)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                labels.append(" / ".join(str(v) for k, v in row.items() if isinstance(v, str) or k in ("tokens",))[:60])
                values.append(float(value))
        axis.barh(range(len(values)), values, color="#2a7ab9")
        axis.set_yticks(range(len(values)), labels, fontsize=7)
        axis.invert_yaxis()
        axis.set_title(f"{title}: {column}", fontsize=9)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _repo_benchmarks() -> bool:
    try:
        return importlib.util.find_spec("benchmarks.__main__") is not None
    except (ImportError, ValueError):
        return False


def run_bench(out: str | Path = "bench-results", quick: bool = False, *, use_repo: bool | None = None) -> Path:
    """Write ``bench.md``, ``bench.json`` and ``bench.png`` into ``out``; returns the Markdown path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if use_repo is None:
        use_repo = _repo_benchmarks()
    if use_repo:
        command = [sys.executable, "-m", "benchmarks", "--out", str(out)] + (["--quick"] if quick else [])
        subprocess.run(command, check=True)
        results = json.loads((out / "bench.json").read_text())
    else:
        rows = training_rows(quick)
        results = {"training (built-in)": rows}
        text = f"# packfree benchmarks (built-in)\n\n## training\n\n{markdown(rows)}\n"
        print(text)
        (out / "bench.md").write_text(text)
        (out / "bench.json").write_text(json.dumps(results, indent=2))
    png = chart(results, out / "bench.png")
    print(f"saved {out / 'bench.md'}" + (f" and {png}" if png else ""))
    return out / "bench.md"
