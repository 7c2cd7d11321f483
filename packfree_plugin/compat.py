"""The version contract, in one place: which transformers releases packfree admits, which it was tested on, and how it
reaches the kernel functions of a release.

packfree reaches into transformers' modeling modules by name (the classes and routed kernel functions of
:data:`~.classes.CLASSES`) and through its attention, mask and kernel interfaces. ``pyproject.toml``
declares :data:`TRANSFORMERS_RANGE`; inside it, :data:`TESTED_TRANSFORMERS` are the release series the suite ran on
(``nox -s compat`` runs the oldest, the default session the newest). A newer release inside the declared range loads:
the load-time gate proves every model on a tiny copy (no class of it is in ``gate/verified.json``), and packfree says
so once. A routed kernel function such a release removed refuses the model that needs it, naming the release and what
to do. A release outside the range is refused at load.
"""

from __future__ import annotations

import logging
from importlib.metadata import version

from packaging.version import Version

__all__ = ["NEWEST_TESTED_TRANSFORMERS", "OLDEST_TRANSFORMERS", "TESTED_TRANSFORMERS", "TRANSFORMERS_RANGE",
           "check_transformers_version", "installed_series", "installed_transformers", "is_untested", "kernel_seam",
           "unroutable_message"]

OLDEST_TRANSFORMERS = "5.20.0"
"""The oldest transformers release the suite passes on (``nox -s compat`` runs it)."""
NEWEST_TESTED_TRANSFORMERS = "5.25.0"
"""The newest transformers release the suite passed on (the default session installs the newest the index serves)."""
TESTED_TRANSFORMERS = "5.20 - 5.25"
"""The tested minor series, as the README and docs/loading.md state them."""
NEXT_UNTESTED_MAJOR = "6"
TRANSFORMERS_RANGE = f">={OLDEST_TRANSFORMERS},<{NEXT_UNTESTED_MAJOR}"
"""What ``pyproject.toml`` declares and :func:`check_transformers_version` enforces."""

logger = logging.getLogger("packfree")
_said_untested: set[str] = set()


def installed_series(distribution: str) -> tuple[int, int]:
    """The installed release series ``(major, minor)`` of ``distribution`` (``"deepspeed"``, ...), from its metadata:
    what the integrations compare with the releases they were tested with."""
    major, minor = version(distribution).split(".")[:2]
    return int(major), int(minor)


def installed_transformers() -> str:
    """The installed transformers release, from its distribution metadata: the one version every check of packfree
    reads (the range at load, the gate's record in ``gate/verified.json``). Not ``transformers.__version__``: that is
    an attribute of whichever module object ``sys.modules["transformers"]`` holds at the time, and transformers
    replaces that object when ``processing_utils`` is first imported (``direct_transformers_import`` runs its
    ``__init__.py`` again)."""
    return version("transformers")


def is_untested(installed: str | None = None) -> bool:
    """Whether ``installed`` is newer than every tested release series (inside the declared range)."""
    release = Version(installed or installed_transformers()).release[:2]
    return release > Version(NEWEST_TESTED_TRANSFORMERS).release[:2]


def check_transformers_version(installed: str | None = None) -> None:
    """Raise ``ValueError`` naming the declared range when the installed transformers is outside it; on a release
    newer than the tested ones, log once that every model is proved at load."""
    installed = installed or installed_transformers()
    if not Version(OLDEST_TRANSFORMERS) <= Version(installed) < Version(NEXT_UNTESTED_MAJOR):
        raise ValueError(
            f"packfree supports transformers {TRANSFORMERS_RANGE} (tested on {TESTED_TRANSFORMERS}); transformers "
            f"{installed} is installed. Install a supported release, e.g. pip install 'transformers{TRANSFORMERS_RANGE}'"
        )
    if is_untested(installed) and installed not in _said_untested:
        _said_untested.add(installed)
        logger.warning(
            "packfree was tested on transformers %s; %s is newer, so every model is proved exact on packed rows at "
            "load (the load-time gate) before it is prepared", TESTED_TRANSFORMERS, installed)


def unroutable_message(module_name: str, function: str, kernel: str, why: str) -> str:
    """The refusal of a model whose modeling module's kernel function packfree cannot route (``why``: it is missing,
    or transformers' kernel seam refused packfree's route)."""
    installed = installed_transformers()
    newest = Version(NEWEST_TESTED_TRANSFORMERS)
    advice = (f"install a tested release (pip install 'transformers>={OLDEST_TRANSFORMERS},<{newest.major}."
              f"{newest.minor + 1}') or wait for a packfree release that supports transformers {installed}")
    tested = "newer than the releases packfree was tested on" if is_untested(installed) else "a tested release"
    return (f"{module_name}.{function}, which packfree routes to its {kernel} op, {why} on transformers {installed} "
            f"({tested}, {TESTED_TRANSFORMERS}): packfree cannot keep packed samples apart in this model there; "
            f"{advice}")


def kernel_seam(function: object) -> bool:
    """Whether a modeling module's kernel function is one of transformers' kernel seams: declared with
    ``use_kernel_func_from_hub_with_fallback`` / ``use_kernel_forward_from_hub`` while a ``kernels`` release that
    transformers accepts is installed, it is a ``kernels`` layer (an ``nn.Module``) that ``kernels.kernelize`` can give
    another forward. Otherwise (no compatible ``kernels``) it is a plain function, and packfree wraps it in the module
    instead."""
    from torch import nn

    return isinstance(function, nn.Module)
