"""The gate: packfree prepares a model for packed rows only once it is proved exact.

- :mod:`.shrink`: a tiny random config of any config / model type, every distinct layer kind kept.
- :mod:`.proof`: the isolation proof, each packed sample against that sample alone on stock transformers.
- :mod:`.admission`: :func:`admit`, called at load; verified classes pass, others are proved or refused.

``verified.json``, the classes proved exact per transformers version, is written by the sweep, a build tool of the
source checkout (``tooling/sweep``, ``nox -s sweep``).
"""

from __future__ import annotations

from .admission import TRUST_ENV, admit, bypassed, is_verified

__all__ = ["TRUST_ENV", "admit", "bypassed", "is_verified"]
