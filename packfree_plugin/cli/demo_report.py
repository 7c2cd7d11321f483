"""The demo's report: the Markdown report (report.md), its record (demo.json) and its plot (demo.png), each saying of
the speed only what :mod:`packfree_plugin.cli.demo_figures` allows."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .demo_figures import (
    ABOVE,
    BELOW,
    UNBOUNDED,
    decompose,
    decomposition_table,
    no_figures_reason,
    standing,
    timed_steps,
    verdict,
    work_ratios,
)
from .demo_runs import FLOOR_NOTE, WARMUP_STEPS, DemoOptions, RunResult

__all__ = ["RELATIVE_LOSS_DIFFERENCE", "loss_table", "max_relative_difference", "plot", "speed_plot_labels",
           "summarize", "throughput_table", "write_report"]

RELATIVE_LOSS_DIFFERENCE = "|run - stock padded| / |stock padded| at a step"
"""The one measure of a loss difference the demos report (its largest over the steps)."""


def max_relative_difference(reference: Sequence[float], other: Sequence[float]) -> float:
    """The largest ``|other - reference| / |reference|`` over the steps both have (NaN for none)."""
    return max((abs(b - a) / abs(a) for a, b in zip(reference, other)), default=math.nan)


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """Throughputs, packing efficiencies and losses of the ``padded`` and ``packed`` runs of ``result``."""
    padded, packed = result["padded"], result["packed"]
    return {
        "speedup": packed.tokens_per_second / padded.tokens_per_second,
        "tokens_run_ratio": padded.slot_tokens / packed.slot_tokens,  # tokens run padded / packed
        "padded_tokens_per_s": padded.tokens_per_second,
        "packed_tokens_per_s": packed.tokens_per_second,
        "padded_efficiency": padded.efficiency,
        "packed_efficiency": packed.efficiency,
        "max_loss_diff": max((abs(a - b) for a, b in zip(padded.losses, packed.losses)), default=math.nan),
        "max_rel_loss_diff": max_relative_difference(padded.losses, packed.losses),
        "first_loss": padded.losses[0] if padded.losses else math.nan,
        "last_loss": padded.losses[-1] if padded.losses else math.nan,
    }


def throughput_table(*runs: RunResult, timings: bool = True) -> list[str]:
    """Markdown rows: tokens, padding and efficiency of each run, and its time and throughput if ``timings``."""
    head = "| run | attention | real tokens | tokens run (with padding) | packing efficiency |"
    rule = "|---|---|---:|---:|---:|"
    if timings:
        head, rule = head + " train s | real tokens/s after warm-up |", rule + "---:|---:|"
    rows = [f"| {run.label} | {run.attn_implementation} | {run.real_tokens:,} | {run.slot_tokens:,} | "
            f"{run.efficiency:.1%} |" + (f" {run.seconds:.1f} | {run.tokens_per_second:,.0f} |" if timings else "")
            for run in runs]
    return [head, rule, *rows]


def loss_table(padded: RunResult, packed: RunResult) -> list[str]:
    """Markdown rows: both runs' loss at every step, and their relative loss difference."""
    return ["| step | padded loss | packed loss | relative loss difference |", "|---:|---:|---:|---:|",
            *(f"| {step} | {a:.6f} | {b:.6f} | {abs(b - a) / abs(a):.2e} |"
              for step, (a, b) in enumerate(zip(padded.losses, packed.losses), start=1))]


def speed_plot_labels(parts: Mapping[str, float | bool], no_figures: str | None) -> dict[str, Any]:
    """What the plot may draw: ``no_speed`` (why it has no speed panel), else its ``title`` and whether the padding
    ceiling bar is drawn (only where the packed bar cannot stand above it)."""
    if no_figures:
        return {"no_speed": f"No speed panel: {no_figures}."}
    total = standing(parts, "total")
    title = {BELOW: f"Training throughput: packed {parts['total']:.2f}x stock padded",
             UNBOUNDED: f"Training throughput: packed {parts['total']:.2f}x stock padded (no ceiling)"}.get(
        total, "Training throughput: packed at its ceiling")
    if standing(parts, "padding") == ABOVE:
        title += "\n(padding ceiling's model failed in this run: no ceiling drawn)"
    return {"title": title, "draw_ceiling": standing(parts, "padding") == BELOW}


def write_report(out: Path, options: DemoOptions, result: Mapping[str, Any], audits: tuple[Any, Any]) -> Path:
    """report.md and demo.json in ``out``; returns the report's path."""
    padded, packed, mine = result["padded"], result["packed"], result["packfree_padded"]
    summary = summarize(result)
    parts = decompose(result)
    ratios = work_ratios(result, timed_steps(result))
    load = result["load"]
    no_figures = no_figures_reason(load)
    config = result["config"]
    layer_types = getattr(config, "layer_types", None)
    mine_audit, stock_audit = audits
    said = verdict(parts, load, summary["max_rel_loss_diff"])
    speed = ([f"Verdict: {said}.", ""] if no_figures else [
        "Real tokens/s, packfree packed over stock padded, as the product of two gains measured in this run (same "
        f"machine, same samples; each run's first {WARMUP_STEPS} steps are its warm-up and left out; noise measured "
        f"by resampling the timed steps; {load.describe()}). A figure above its ceiling by more than its noise is not "
        f"given: that ceiling's model is wrong for the run. Verdict: {said}.", "",
        *decomposition_table(parts, ratios), ""])
    lines = [
        "# packfree demo: padded vs packed training on GSM8K",
        "",
        f"Model: `{config.model_type}`, hidden {config.hidden_size}, {config.num_hidden_layers} layers"
        + (f" ({', '.join(layer_types)})" if layer_types else "")
        + f", vocabulary {result['vocab']} (MiniLM WordPiece ids used by the data), random init seed {options.seed}.",
        f"Data: the first {result['samples']} GSM8K samples ({options.data_file or 'embedded test split'}), "
        f"{options.steps} steps of {options.batch_size} samples in the same order in every run; packed rows of "
        f"at most {options.max_tokens} tokens. HF `Trainer`, AdamW lr {options.learning_rate}, constant schedule.",
        "",
        "## Speedup" + (": no figures" if no_figures else ", in its parts"),
        "",
        *speed,
        f"The floor run skipped {len(result['skipped'])} token-mixing layers ({', '.join(result['skipped'])}): "
        f"{FLOOR_NOTE}.",
        "",
        "## Runs",
        "",
        *throughput_table(padded, mine, result["floor"], packed, timings=not no_figures),
        "",
        "## Loss agreement",
        "",
        f"Largest relative loss difference ({RELATIVE_LOSS_DIFFERENCE}) over {len(padded.losses)} steps: packfree "
        f"packed **{summary['max_rel_loss_diff']:.2e}**, packfree padded "
        f"**{max_relative_difference(padded.losses, mine.losses):.2e}**; stock padded's loss went "
        f"{summary['first_loss']:.3f} -> {summary['last_loss']:.3f}.",
        "",
        *loss_table(padded, packed),
        "",
        "## Isolation audit (trained weights, float64)",
        "",
        "One packed row of 4 samples (boundaries from `position_ids` only, default `use_cache`); sample 0's "
        "tokens replaced; forward hooks on every module report any output that moved at another sample's "
        "positions.",
        "",
        "```",
        mine_audit.summary(),
        stock_audit.summary(),
        "```",
        "",
        "![losses" + ("" if no_figures else " and throughput") + "](demo.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    (out / "demo.json").write_text(json.dumps({
        "options": asdict(options), "summary": summary,
        "decomposition": parts, "work_ratios": ratios, "load": load.as_dict(), "skipped": result["skipped"],
        **{key: {**asdict(result[key]), "tokens_per_second": result[key].tokens_per_second}
           for key in ("padded", "packfree_padded", "floor", "packed")},
        "audit": {"packfree_leaks": [asdict(leak) for leak in mine_audit.leaks],
                  "stock_leaks": len(stock_audit.leaks)},
    }, indent=2))
    return path


def plot(path: Path, padded: RunResult, packed: RunResult, middle: Sequence[RunResult] = (), *,
         ceiling: float | None = None, title: str | None = None, no_speed: str | None = None) -> None:
    """Losses per step of ``padded`` and ``packed``, and beside them either ``no_speed`` (why there is no speed
    panel) or real tokens/s of ``padded``, each of ``middle``, ``packed`` and the ``ceiling`` (real tokens/s that
    removing padding can reach at most) if given, under ``title`` (default: packed over padded)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, len(padded.losses) + 1)
    left.plot(steps, padded.losses, "o-", label=f"padded ({padded.attn_implementation})", markersize=4)
    left.plot(range(1, len(packed.losses) + 1), packed.losses, "x--", label="packed (packfree)", markersize=5)
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_title("Loss per step (same samples each step)")
    left.legend()
    if no_speed:
        right.axis("off")
        right.text(0.5, 0.5, textwrap.fill(no_speed, 48), ha="center", va="center", wrap=True)
    else:
        runs = [padded, *middle, packed]
        names = [f"{'packed' if run is packed else 'padded'}\n({run.attn_implementation})" for run in runs]
        values = [run.tokens_per_second for run in runs]
        bars = right.bar(names, values, color=["#999999", *["#9cc3e0"] * len(middle), "#2a7ab9"])
        right.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
        if ceiling is not None:
            bound = right.bar(["ceiling\n(padding removed)"], [ceiling], color="none", edgecolor="#2a7ab9",
                              hatch="//")
            right.bar_label(bound, labels=[f"{ceiling:,.0f}"])
        right.set_ylabel("real tokens / s")
        right.set_title(title or f"Training throughput: packed "
                                 f"{packed.tokens_per_second / padded.tokens_per_second:.2f}x padded")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
