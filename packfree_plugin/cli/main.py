"""``packfree`` command line: ``demo``, ``demo-vlm``, ``doctor``, ``verify``, ``bench``. Parsing only; the work lives
in :mod:`.demo`, :mod:`.demo_vlm`, :mod:`.doctor`, :mod:`.verify` and :mod:`.bench`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


class UsageError(Exception):
    """A bad command line: reported as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line too, no usage dump
        raise UsageError(message)


def _target(target: str) -> str:
    """A model directory with a config.json, or a model type of the installed transformers."""
    from pathlib import Path

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{target} is a directory without config.json (not a saved model)")
        return target
    if target in CONFIG_MAPPING_NAMES:
        return target
    if "/" in target or target.startswith("."):
        raise UsageError(f"no such model directory: {target}")
    raise UsageError(f"{target!r} is neither a model directory nor a model type of transformers "
                     "(model types are the config's model_type, e.g. llama, qwen3_next, mamba2)")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        raise UsageError(f"--lengths must be comma-separated positive integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise UsageError(f"--lengths must be comma-separated positive integers, got {text!r}")
    return lengths


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo

    summary = run_demo(DemoOptions(model_type=args.model_type, steps=args.steps, batch_size=args.batch_size,
                                   max_tokens=args.max_tokens, data_file=args.data_file, out=args.out,
                                   threads=args.threads, progress=not args.no_progress))
    return 0 if summary["audit_ok"] else 1


def _demo_vlm(args: argparse.Namespace) -> int:
    from .demo_vlm import VisionDemoOptions, run_vision_demo

    run_vision_demo(VisionDemoOptions(epochs=args.epochs, batch_size=args.batch_size, out=args.out,
                                      threads=args.threads, progress=not args.no_progress))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import environment, parallel_layout, plan, position_numbering, render, sequence_parallel_support

    print("## packages\n")
    for package, version in environment():
        print(f"- {package}: {version or 'not installed'}")
    import torch

    print(f"- CUDA: {'available, ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
    print("\n## parallel layout\n")
    for what, value in parallel_layout():
        print(f"- {what}: {value}")
    status = 0
    for target in [_target(model) for model in args.models]:
        print(f"\n## {target}\n")
        try:
            plans = plan(target)
        except Exception as error:  # noqa: BLE001 - report any model we cannot build, keep going
            print(f"cannot build {target}: {type(error).__name__}: {error}")
            status = 1
            continue
        print(render(plans))
        print(f"\none packed row split over ranks: {sequence_parallel_support(target)}")
        print(f"positions of a lone sample: {position_numbering(target)}")
        if not all(p.boundary_safe for p in plans):
            status = 1
    return status


def _verify(args: argparse.Namespace) -> int:
    from .verify import verify

    mine, stock = verify(_target(args.model), lengths=_lengths(args.lengths), reference="" if args.no_reference else args.reference)
    print(mine.summary(limit=args.show))
    if stock is not None:
        print(stock.summary(limit=args.show))
        if stock.ok:
            print(f"(stock {stock.attn_implementation} shows no leak on this input)")
    print("OK: no module leaks across samples under packfree" if mine.ok else "LEAK: see the modules above"
          if mine.leaks else "WRONG: packed samples differ from each sample alone under packfree, see above")
    return 0 if mine.ok else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    run_bench(out=args.out, quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="packfree", description="packfree: exact padding-free training")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser("demo", help="train a small hybrid padded and packed on GSM8K; report and plot")
    demo.add_argument("--model-type", default="qwen3_next",
                      help="transformers model type (default: qwen3_next, dense, 3 GDN : 1 attention layers)")
    demo.add_argument("--steps", type=int, default=32, help="optimizer steps per run (default 32)")
    demo.add_argument("--batch-size", type=int, default=16, help="samples per step (default 16)")
    demo.add_argument("--max-tokens", type=int, default=4096,
                      help="token budget per packed row (default 4096: a step's 16 samples fit one unpadded row)")
    demo.add_argument("--data-file", default=None, help="GSM8K-format .jsonl (default: the embedded test split)")
    demo.add_argument("--out", default="packfree-report", help="output folder (report.md, demo.png, demo.json)")
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: half the cores)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)

    vlm = commands.add_parser("demo-vlm", help="train a small Qwen2-VL padded and packed on the embedded captioned "
                                               "images; report and plot")
    vlm.add_argument("--epochs", type=int, default=4, help="passes over the 45 images (default 4)")
    vlm.add_argument("--batch-size", type=int, default=15, help="samples per step (default 15)")
    vlm.add_argument("--out", default="packfree-report", help="output folder (report-vlm.md, demo-vlm.png)")
    vlm.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: half the cores)")
    vlm.add_argument("--no-progress", action="store_true", help="no progress bars")
    vlm.set_defaults(run=_demo_vlm)

    doctor = commands.add_parser("doctor", help="packages found and, per model, each layer's backend here")
    doctor.add_argument("models", nargs="*", default=["qwen3_next"],
                        help="model directories or model types (default: qwen3_next)")
    doctor.set_defaults(run=_doctor)

    verify = commands.add_parser("verify", help="leak audit: perturb one packed sample, watch every module")
    verify.add_argument("model", help="a model directory or a model type (tiny random model)")
    verify.add_argument("--lengths", default="7,5,9,6", help="packed sample lengths (default 7,5,9,6)")
    verify.add_argument("--reference", default="sdpa", help="stock implementation audited alongside (default sdpa)")
    verify.add_argument("--no-reference", action="store_true", help="skip the stock audit")
    verify.add_argument("--show", type=int, default=8, help="leaking modules listed per audit")
    verify.set_defaults(run=_verify)

    bench = commands.add_parser("bench", help="benchmark tables (repo's benchmarks package, else built-in) + chart")
    bench.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    bench.add_argument("--out", default="bench-results", help="folder for bench.md, bench.json, bench.png")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; usage errors print one line on stderr and return 2."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UsageError as error:
        print(f"packfree: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
