"""Every Sphinx-style cross-reference in the package's docstrings and comments (``:mod:``, ``:func:``, ``:class:``,
``:data:``, ``:meth:``, ``:attr:``, ``:exc:``) names something that exists, so a reader who follows one arrives."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "packfree_plugin"
REFERENCE = re.compile(r":(?:mod|func|class|data|meth|attr|exc):`~?([A-Za-z0-9_.]+)(?:\(\))?`")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute path inside one (``module.Class.method``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(target, "__dataclass_fields__", {})
            if name in fields:  # a dataclass field with a default factory is no class attribute
                return name == parts[-1]
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def _candidates(module: str, target: str) -> list[str]:
    """Where ``target`` may live, as Sphinx searches a reference written in ``module``: relative (leading dots: the
    module, then each enclosing package), inside the module itself, or absolute."""
    if target.startswith("."):
        relative = target.lstrip(".")
        scopes = module.split(".")
        return [".".join(scopes[:cut] + [relative]) for cut in range(len(scopes), 0, -1)]
    loaded = importlib.import_module(module)
    members = [f"{module}.{name}.{target}" for name, value in vars(loaded).items()
               if isinstance(value, type) and value.__module__ == module]  # a method named inside its class
    return [f"{module}.{target}", target, *members, *(f"{'.'.join(module.split('.')[:cut])}.{target}"
                                                      for cut in range(len(module.split(".")) - 1, 0, -1))]


def _references() -> list[tuple[str, str]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for target in REFERENCE.findall(path.read_text(encoding="utf-8")):
            found.append((module, target))
    return found


def test_the_package_has_references_to_check() -> None:
    assert len(_references()) > 100


@pytest.mark.parametrize("module", sorted({module for module, _ in _references()}))
def test_every_reference_resolves(module: str) -> None:
    broken = sorted({target for where, target in _references() if where == module
                     and not any(_resolves(candidate) for candidate in _candidates(module, target))})
    assert not broken, f"{module} names what does not exist: {broken}"
