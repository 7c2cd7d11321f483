"""Prove every model type of the installed transformers and record what is exact.

``python -m tooling.sweep`` (``nox -s sweep``); ``--worker`` runs one of the sweep's worker processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from packfree_plugin.gate.admission import VERIFIED_FILE

from .render import SUPPORT_DOC, gate_kind, load_results, write_outputs
from .run import TIME_LIMIT_S, Result, run_worker, sweep, targets


def main(argv: Sequence[str] | None = None) -> int:
    """Sweep the targets (all, or ``--only`` some types merged into the recorded results), write the outputs and
    print the counts per group and status."""
    parser = argparse.ArgumentParser(prog="python -m tooling.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per target (default 120)")
    parser.add_argument("--only", nargs="*", help="model types to re-run (merged into the recorded results)")
    parser.add_argument("--doc", default=str(SUPPORT_DOC),
                        help="Markdown page whose support-matrix section is replaced (default docs/support-matrix.md)")
    args = parser.parse_args(argv)
    if args.worker:
        run_worker()
        return 0
    import transformers

    chosen = targets()
    previous: list[Result] = []
    if args.only:
        recorded = json.loads(VERIFIED_FILE.read_text()).get(transformers.__version__, {}).get("switches", {})
        previous = [r for r in load_results(transformers.__version__) if r.model_type not in args.only]
        for r in previous:
            r.switches = recorded.get(r.config_type) if r.status == "exact" else None
        chosen = [t for t in chosen if t.model_type in args.only]
    results = previous + sweep(chosen, jobs=args.jobs, time_limit=args.time_limit)
    write_outputs(transformers.__version__, results, Path(args.doc))
    counts = Counter((r.group, r.status) for r in results)
    counts.update((r.group, f"{which}={gate_kind(getattr(r, which))}") for r in results
                  for which in ("default_config", "tester_config"))
    print(json.dumps({f"{g}/{s}": n for (g, s), n in sorted(counts.items())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
