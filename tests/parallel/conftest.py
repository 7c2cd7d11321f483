"""The DeepSpeed Ulysses tests (packfree's route, and the Trainer's) need deepspeed (a test dependency; an
environment without it does not collect them: neither run nor counted as skipped). ``nox -s distributed`` sets PACKFREE_SP_FULL=1 for the heavier cases."""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("deepspeed") is not None else [
    "test_ulysses.py", "test_trainer_ulysses.py", "test_eval_sharded.py", "test_sp_attention_refusal.py"]
