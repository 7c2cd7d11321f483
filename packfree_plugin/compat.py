"""The versions packfree is tested with, and the check that refuses the others at load.

packfree reaches into transformers' modeling modules by name (:data:`~.adapters.entry.ROUTED_FUNCTIONS`,
the layer classes of :mod:`~.adapters.families`) and through its attention and mask interfaces, so it is
only known to be exact on the transformers releases its test suite ran on: ``nox -s compat`` runs the model
tests on the oldest and the newest of them. On any other release, preparing a model raises instead of
guessing.
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

__all__ = ["TRANSFORMERS_RANGE", "check_transformers_version"]

OLDEST_TRANSFORMERS = "5.20.0"
"""The oldest transformers release the suite passes on (``nox -s compat`` runs it)."""
NEXT_UNTESTED_MAJOR = "6"
TRANSFORMERS_RANGE = f">={OLDEST_TRANSFORMERS},<{NEXT_UNTESTED_MAJOR}"
"""What ``pyproject.toml`` declares and :func:`check_transformers_version` enforces."""


def check_transformers_version(installed: str | None = None) -> None:
    """Raise ``ValueError`` naming the supported range when the installed transformers is outside it."""
    installed = installed or version("transformers")
    if not Version(OLDEST_TRANSFORMERS) <= Version(installed) < Version(NEXT_UNTESTED_MAJOR):
        raise ValueError(
            f"packfree supports transformers {TRANSFORMERS_RANGE} (tested on those releases); transformers "
            f"{installed} is installed. Install a supported release, e.g. pip install 'transformers{TRANSFORMERS_RANGE}'"
        )
