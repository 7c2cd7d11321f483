"""The main job: train one small hybrid model on GSM8K padded and packed, and compare.

Data flows top to bottom, one module for each job:

1. :mod:`.demo_batches`: GSM8K records -> token ids of a real offline tokenizer (MiniLM's WordPiece), compacted to the
   ids the data uses; a Qwen3.5-like hybrid config (three Gated DeltaNet layers to one attention layer) or any family
   of :mod:`packfree_plugin.cli.tiny`; the padding and packing collators and the work each step's rows run.
2. :mod:`.demo_runs`: the HF ``Trainer``, sequential sampler, ``batch_size`` samples per step, four runs from the same
   initial weights on the same samples at every step: stock padded, packfree padded, the floor (packfree padded with
   every token-mixing layer skipped: a timing bound, not a training result) and packfree packed. The three runs that
   mix tokens must give the same per-step losses.
3. :mod:`.demo_figures`: the speedup as its parts (packfree's ops, padding removed, their product), each against its
   ceiling with its timing noise and the machine's load; what each part may print (none on a loaded machine, no
   figure above its own ceiling); one measure of loss difference.
4. :mod:`.demo_report`: the Markdown report, its JSON record and the PNG plot.
5. :func:`run_demo` (here): the runs, the isolation audit of :mod:`packfree_plugin.gate.audit` on the trained model
   (packfree and stock), the report, and the console lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .demo_batches import (GDN_CHUNK, PaddedCollator, StepPacker, demo_config, gdn_chunk, minilm_tokenizer,
                           tokenize_gsm8k, work_units)
from .demo_figures import (BELOW, UNBOUNDED, decompose, decomposition_lines, no_figures_reason, standing, timed_steps,
                           verdict, work_ratios)
from .demo_report import plot, speed_plot_labels, summarize, write_report
from .demo_runs import (WARMUP_STEPS, DemoOptions, RunResult, build_model, compare_training, skip_token_mixers,
                        train)

__all__ = ["GDN_CHUNK", "WARMUP_STEPS", "DemoOptions", "PaddedCollator", "RunResult", "StepPacker", "build_model",
           "cli_hint", "compare_training", "decompose", "demo_config", "gdn_chunk", "minilm_tokenizer", "run_demo",
           "skip_token_mixers", "summarize", "tokenize_gsm8k", "train", "verdict", "work_ratios", "work_units"]


def _audit_trained(packed_model, config) -> tuple[Any, Any]:
    """The verify leak audit on a float64 copy of the trained weights, under packfree and stock sdpa."""
    from ..gate.audit import audit

    state = packed_model.state_dict()
    mine = build_model(config, "packfree", state).double().eval()
    try:
        stock = build_model(config, "sdpa", state).double().eval()
    except ValueError:
        stock = build_model(config, "eager", state).double().eval()
    return audit(mine), audit(stock)


def cli_hint() -> str:
    """Where the ``packfree`` command of this Python lives and how to reach it (a nox session's environment is
    not on the caller's ``PATH``)."""
    scripts = Path(sys.executable).parent
    command = scripts / "packfree"
    if not command.exists():
        return f"packfree CLI: not installed for {sys.executable}; run `{sys.executable} -m packfree_plugin` instead"
    activate = scripts / "activate"
    return f"packfree CLI: {command}" + (f" (put it on PATH: `source {activate}`)" if activate.exists() else "")


def run_demo(options: DemoOptions, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole main job; returns the summary (with ``audit_ok``) and writes report.md, demo.png, demo.json."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = compare_training(options)
    echo("isolation audit of the trained model ...")
    audits = _audit_trained(result["packed_model"], result["config"])
    summary = summarize(result)
    parts = decompose(result)
    ratios = work_ratios(result, timed_steps(result))
    load = result["load"]
    mine = result["packfree_padded"]
    labels = speed_plot_labels(parts, no_figures_reason(load))
    ceiling = mine.tokens_per_second * parts["padding_ceiling"] if labels.get("draw_ceiling") else None
    plot(out / "demo.png", result["padded"], result["packed"], (mine,), ceiling=ceiling, title=labels.get("title"),
         no_speed=labels.get("no_speed"))
    report = write_report(out, options, result, audits)
    summary.update(decomposition=parts, work_ratios=ratios, load=load.as_dict(), audit_ok=audits[0].ok,
                   stock_leaks=len(audits[1].leaks), report=str(report), plot=str(out / "demo.png"),
                   total_seconds=time.perf_counter() - started)
    for line in decomposition_lines(parts, ratios, load, summary["max_rel_loss_diff"]):
        echo(line)
    shows_speed = not load.too_loaded and standing(parts, "total") in (BELOW, UNBOUNDED)  # the ratio of these two
    speed = "" if not shows_speed else (f"{summary['padded_tokens_per_s']:,.0f} -> "
                                        f"{summary['packed_tokens_per_s']:,.0f} real tokens/s after warm-up; ")
    echo(f"{speed}packing efficiency {summary['padded_efficiency']:.1%} padded -> {summary['packed_efficiency']:.1%} "
         "packed")
    echo(audits[0].summary())
    echo(audits[1].summary(limit=3))
    echo(f"report: {report}  plot: {out / 'demo.png'}  ({summary['total_seconds']:.0f} s)")
    echo(cli_hint())
    return summary
