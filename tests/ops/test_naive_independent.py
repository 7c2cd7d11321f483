"""Each naive reference computes on its own: read from the source with ``ast`` (every import, function-level ones
included), no ``ops/<family>/naive.py`` imports a packfree module but the references' own helpers
(:data:`REFERENCE_ONLY`), those helpers are imported by no fast path, and no other module of a family imports its
naive reference. A reference that shares code with the path it checks would agree with that path's bug."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "packfree_plugin" / "ops"
PACKAGE = "packfree_plugin"
REFERENCE_ONLY = {"packfree_plugin.ops._reference"}
"""Modules that only naive references may import (sample spans and the accumulation dtype, written for them)."""
FAMILIES = sorted(path.parent for path in OPS.glob("*/naive.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(OPS.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module (and, for ``from m import n``, every ``m.n``) that ``path``'s imports may load, relative
    imports resolved to absolute names."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _packfree(modules: set[str]) -> set[str]:
    return {m for m in modules if m == PACKAGE or m.startswith(PACKAGE + ".")}


def test_every_family_has_a_reference():
    """The check below reads something: the six families of docs/layout.md."""
    assert {path.name for path in FAMILIES} >= {"conv", "ssd", "selective_scan", "gated_delta", "linear_attention", "lru"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda path: path.name)
def test_naive_imports_nothing_the_fast_path_computes_with(family: Path):
    """``naive.py`` loads no packfree module but :data:`REFERENCE_ONLY` (the package itself included: its
    ``__init__`` would load the fast path)."""
    loaded = _packfree(imported_modules(family / "naive.py")) - REFERENCE_ONLY
    # ``from packfree_plugin.ops._reference import x`` also names ``..._reference.x``: a name, not a module
    loaded = {m for m in loaded if not any(m.startswith(r + ".") for r in REFERENCE_ONLY)}
    assert not loaded, f"{family.name}/naive.py imports {sorted(loaded)}"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda path: path.name)
def test_fast_path_imports_nothing_from_its_reference(family: Path):
    """No module of the family but its ``__init__`` (which re-exports the reference) imports ``naive``."""
    naive = _module_name(family / "naive.py")
    for path in sorted(family.glob("*.py")):
        if path.name in ("naive.py", "__init__.py"):
            continue
        hits = {m for m in imported_modules(path) if m == naive or m.startswith(naive + ".")}
        assert not hits, f"{family.name}/{path.name} imports {sorted(hits)}"


def test_reference_helpers_serve_references_only():
    """No module of the package but a naive reference imports :data:`REFERENCE_ONLY`."""
    for path in sorted(OPS.parent.rglob("*.py")):
        if path.name == "naive.py" and path.parent in FAMILIES:
            continue
        hits = {m for m in imported_modules(path) if any(m == r or m.startswith(r + ".") for r in REFERENCE_ONLY)}
        assert not hits, f"{path.relative_to(OPS.parent)} imports {sorted(hits)}"
