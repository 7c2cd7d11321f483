"""The DeepSpeed Ulysses tests need deepspeed, which only ``nox -s distributed`` installs: without it they are not
collected (neither run nor counted as skipped)."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("deepspeed") is not None else ["test_ulysses.py"]
