"""The demo's figures: the speedup of its four runs as its parts, each against its ceiling, and what may be said of
them.

:func:`decompose` measures. The speedup is the product of two parts: stock padded -> packfree padded (*packfree's
ops*, bounded by the floor run) and packfree padded -> packfree packed (*padding removed*, bounded by the padding
ceiling: the largest ratio, padded over packed, of the kinds of work
:func:`~packfree_plugin.cli.demo_batches.work_units` counts: tokens run, attention pairs, chunk-padded tokens).

:func:`standing` decides what each part may print, so that the console, the report and the plot never disagree:

- the machine too loaded (:class:`~packfree_plugin.cli.load.LoadWatch`): no speed figure of any kind;
- a part at most its ceiling: its figure and its ceiling;
- a part above its ceiling but inside its timing noise: "at its ceiling", the ceiling alone;
- a part above its ceiling by more than its noise: no figure; the ceiling's model is wrong for this run, and the
  report says so. The speedup then has no ceiling: its figure is printed alone.

The losses are compared by one measure, the *relative loss difference*: at a step, ``|run - stock padded| /
|stock padded|``; the largest over the steps is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .demo_batches import GDN_CHUNK
from .demo_runs import WARMUP_STEPS
from .load import LOADED_PER_CORE, OTHERS_PER_CORE, LoadWatch

__all__ = ["LOSS_TOLERANCE", "NOISE_RESAMPLES", "PARTS", "decompose", "decomposition_lines", "decomposition_table",
           "no_figures_reason", "part_phrase", "standing", "timed_steps", "verdict", "work_ratios"]

NOISE_RESAMPLES = 2000
"""Resamples of the timed steps behind each part's noise band (:func:`decompose`)."""
PARTS = ("ops", "padding", "total")
NAMES = {"ops": "packfree's ops", "padding": "padding removed", "total": "speedup"}
LOSS_TOLERANCE = 1e-5
"""Largest relative loss difference from stock padded that the verdict calls equal (float32 sums in another
order)."""

BELOW, AT, ABOVE, UNBOUNDED = "below", "at", "above", "unbounded"
"""A part's standing: at most its ceiling; above it inside the timing noise; above it by more than the noise (the
ceiling's model failed); for the speedup, a product whose part's ceiling failed, so it has no ceiling."""


def timed_steps(result: Mapping[str, Any]) -> np.ndarray:
    """The indices of the steps every figure is taken over: all but the first :data:`WARMUP_STEPS`, if any remain."""
    count = len(result["padded"].step_seconds)
    return np.arange(WARMUP_STEPS if count > WARMUP_STEPS else 0, count)


def work_ratios(result: Mapping[str, Any], steps: np.ndarray) -> dict[str, float]:
    """Each kind of work, packfree padded over packfree packed, summed over the step indices ``steps``."""
    padded, packed = (result[key].step_work for key in ("packfree_padded", "packed"))
    return {kind: sum(padded[i][kind] for i in steps) / sum(packed[i][kind] for i in steps) for kind in padded[0]}


def _parts_over(result: Mapping[str, Any], steps: np.ndarray) -> dict[str, float]:
    """Each part and its ceiling over the step indices ``steps`` (repeats allowed), the same steps in every run."""
    seconds = {k: np.asarray(result[k].step_seconds)[steps].sum() for k in ("padded", "packfree_padded", "floor",
                                                                            "packed")}
    # every run trains on the same samples at each step, so real tokens/s ratios are step-time ratios
    stock, mine, floor, packed = (seconds[k] for k in ("padded", "packfree_padded", "floor", "packed"))
    parts = {"ops": stock / mine, "ops_ceiling": stock / floor, "padding": mine / packed,
             "padding_ceiling": max(work_ratios(result, steps).values())}
    parts.update(total=parts["ops"] * parts["padding"], total_ceiling=parts["ops_ceiling"] * parts["padding_ceiling"])
    return {k: float(v) for k, v in parts.items()}


def decompose(result: Mapping[str, Any], *, resamples: int = NOISE_RESAMPLES) -> dict[str, float | bool]:
    """The speedup of the demo's four runs as its parts, each with its ceiling and noise band.

    - ``ops``: stock padded -> packfree padded, the same batches; packfree's ops alone. Ceiling ``ops_ceiling``:
      the floor run over stock, i.e. the speedup if packfree's token-mixing layers cost nothing.
    - ``padding``: packfree padded -> packfree packed; padding removed. Ceiling ``padding_ceiling``: the largest
      of :func:`work_ratios` (tokens run, attention pairs, chunk-padded tokens, each padded over packed). A step's
      time is a sum of parts, each growing with one kind of work or not shrinking at all; its ratio cannot exceed
      the largest of theirs.
    - ``total``: stock padded -> packfree packed, the product of the two; ceiling the product of theirs.

    Every figure is taken over the timed steps (after each run's warm-up). Its noise is measured from those steps
    as repeats: the timed steps are resampled with replacement (the same steps in all four runs, so a step's
    content cancels) and ``<part>_noise`` is the half-width of the central 95 % of ``part / ceiling`` over the
    resamples, relative. ``<part>_above_ceiling`` holds only when ``part / ceiling`` exceeds 1 by more than
    that band (its 2.5 % quantile is above 1); ``within_ceilings`` when no part is.
    """
    timed = timed_steps(result)
    parts: dict[str, float | bool] = dict(_parts_over(result, timed))
    generator = np.random.default_rng(0)
    draws = [_parts_over(result, generator.choice(timed, size=len(timed))) for _ in range(resamples)]
    for key in PARTS:
        low, high = np.quantile([d[key] / d[f"{key}_ceiling"] for d in draws], [0.025, 0.975])
        parts[f"{key}_noise"] = float(high - low) / 2
        parts[f"{key}_above_ceiling"] = bool(low > 1)
    parts["within_ceilings"] = not any(parts[f"{key}_above_ceiling"] for key in PARTS)
    return parts


def standing(parts: Mapping[str, float | bool], key: str) -> str:
    """``key``'s standing against its ceiling (:data:`BELOW`, :data:`AT`, :data:`ABOVE`; the speedup
    :data:`UNBOUNDED` when a part's ceiling failed)."""
    if key == "total" and any(standing(parts, part) == ABOVE for part in ("ops", "padding")):
        return UNBOUNDED
    if parts[f"{key}_above_ceiling"]:
        return ABOVE
    return AT if parts[key] > parts[f"{key}_ceiling"] else BELOW


def _ratios_phrase(ratios: Mapping[str, float]) -> str:
    """``tokens run 1.71x, attention pairs 1.00x, ...``: each kind of work, padded / packed."""
    return ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in ratios.items())


def ceiling_model(key: str, ratios: Mapping[str, float]) -> str:
    """What sets ``key``'s ceiling, in words."""
    return {"ops": "the floor run over stock padded: the same padded step with every token-mixing layer skipped, what "
                   "packfree padded would reach if its layers cost nothing",
            "padding": f"the largest work ratio padded / packed ({_ratios_phrase(ratios)}): attention pairs count "
                       f"each sample's L², chunk-padded tokens each row rounded up to the {GDN_CHUNK}-token chunk of "
                       "the Gated DeltaNet; no part of a step shrinks by more than its work does",
            "total": "the product of the two ceilings"}[key]


def part_phrase(parts: Mapping[str, float | bool], key: str) -> str:
    """``key``'s figure as its standing allows: ``1.52x (ceiling 1.70x, noise ±2.1%)``, ``at its ceiling 1.70x
    (...)``, ``no figure: ...`` or, for an unbounded speedup, the figure without a ceiling."""
    value, ceiling, noise = parts[key], parts[f"{key}_ceiling"], parts[f"{key}_noise"]
    state = standing(parts, key)
    if state == BELOW:
        return f"{value:.2f}x (ceiling {ceiling:.2f}x, noise ±{noise:.1%})"
    if state == AT:
        return f"at its ceiling {ceiling:.2f}x (measured above it by less than its ±{noise:.1%} timing noise)"
    if state == ABOVE:
        return (f"no figure: measured above its ceiling by more than its ±{noise:.1%} timing noise, so the "
                "ceiling's model is wrong for this run")
    failed = " and ".join(NAMES[p] for p in ("ops", "padding") if standing(parts, p) == ABOVE)
    return f"{value:.2f}x (no ceiling: the ceiling of {failed} failed in this run)"


def no_figures_reason(load: LoadWatch) -> str | None:
    """Why the run gives no speed figures (the machine too loaded for its timings), or None."""
    if not load.too_loaded:
        return None
    busy = (f"the machine ran at {load.per_core:.2f} load per core (above {LOADED_PER_CORE})"
            if load.others_per_core is None else
            f"other processes used {load.others_per_core:.2f} of each core (above {OTHERS_PER_CORE})")
    return (f"{busy}, so these timings hold other processes' work as much as this run's; rerun on a quiet machine "
            "for speed figures")


def losses_phrase(max_rel_loss_diff: float) -> str:
    """``equal losses (largest relative loss difference 1.5e-07)``, or DIFFERENT above :data:`LOSS_TOLERANCE`."""
    equal = "equal losses" if max_rel_loss_diff <= LOSS_TOLERANCE else "DIFFERENT losses"
    return f"{equal} (largest relative loss difference {max_rel_loss_diff:.1e})"


def verdict(parts: Mapping[str, float | bool], load: LoadWatch, max_rel_loss_diff: float) -> str:
    """The run's result in one sentence: the speedup against its ceiling and whether the losses agree. "No figures"
    and no number of speed when the machine was too loaded (``load``); a part above its ceiling by more than its
    timing noise is named, with no figure of its own."""
    losses = losses_phrase(max_rel_loss_diff)
    reason = no_figures_reason(load)
    if reason:
        return f"no figures: {reason}. Padded and packed trained with {losses}"
    above = [key for key in PARTS if standing(parts, key) == ABOVE]
    failed = (f"; {', '.join(above)} above its ceiling by more than its timing noise: that ceiling's model is wrong "
              "for this run (an assumption it makes failed, or the machine's load changed between runs)"
              if above else "")
    state = standing(parts, "total")
    if state == BELOW:
        total, ceiling = parts["total"], parts["total_ceiling"]
        said = (f"packed trains {total:.2f}x as fast as stock padded, {total / ceiling:.0%} of its ceiling "
                f"{ceiling:.2f}x")
    elif state == AT:
        said = f"packed trains at its ceiling, {parts['total_ceiling']:.2f}x as fast as stock padded"
    elif state == UNBOUNDED:
        said = f"packed trains {parts['total']:.2f}x as fast as stock padded, with no ceiling"
    else:
        said = "packed trains faster than its ceiling allows, so no speedup figure"
    return f"{said}{failed}. Padded and packed trained with {losses}"


def decomposition_lines(parts: Mapping[str, float | bool], ratios: Mapping[str, float], load: LoadWatch,
                        max_rel_loss_diff: float) -> list[str]:
    """Console lines: the speedup and each part as their standings allow (none on a loaded machine), the machine's
    load, the verdict."""
    figures = [] if load.too_loaded else [
        f"speedup {part_phrase(parts, 'total')} = packfree's ops x padding removed",
        f"  packfree's ops  {part_phrase(parts, 'ops')}; ceiling: token mixers free",
        f"  padding removed {part_phrase(parts, 'padding')}; ceiling: the largest of {_ratios_phrase(ratios)}, "
        "padded / packed"]
    return [*figures, f"  {load.describe()}", f"  verdict: {verdict(parts, load, max_rel_loss_diff)}"]


def decomposition_table(parts: Mapping[str, float | bool], ratios: Mapping[str, float]) -> list[str]:
    """Markdown rows: each part of the speedup, the runs it compares, what its standing allows of its figure and
    ceiling, its noise, and what sets the ceiling (``ratios``: :func:`work_ratios` over the timed steps)."""
    runs = {"ops": "stock padded -> packfree padded", "padding": "packfree padded -> packfree packed",
            "total": "stock padded -> packfree packed"}
    rows = []
    for key, name in (("ops", "packfree's ops"), ("padding", "padding removed"), ("total", "both")):
        state, ceiling = standing(parts, key), f"{parts[f'{key}_ceiling']:.2f}x"
        figure, bound = {BELOW: (f"**{parts[key]:.2f}x**", ceiling), AT: ("at its ceiling", ceiling),
                         ABOVE: ("no figure", "its model failed"),
                         UNBOUNDED: (f"**{parts[key]:.2f}x**", "none (a part's ceiling failed)")}[state]
        rows.append(f"| {name} | {runs[key]} | {figure} | {bound} | ±{parts[f'{key}_noise']:.1%} | "
                    f"{ceiling_model(key, ratios)} |")
    return ["| part | runs compared | speedup | ceiling | timing noise (95 %) | what sets the ceiling |",
            "|---|---|---:|---:|---:|---|", *rows]
