"""The package's import structure, read from the source with ``ast`` (module-level imports: those that run when a
module loads): no circles, and lower floors never import higher ones, but for the one arrow listed below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "packfree_plugin"
FLOORS = (  # bottom first, by subpackage of packfree_plugin (docs/layout.md)
    {"compat", "boundaries", "classes", "ops"},
    {"forward"},
    {"attention"},
    {"mixers"},
    {"quirks"},
    {"parallel", "packing", "integrations", "loss"},
    {"gate"},
    {"loading"},
    {"cli", "__init__", "__main__"},
)
ARROWS_UP: set[tuple[str, str]] = set()
"""Known arrows back up: none."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules its module-level imports load (a package's submodules, not the package, where
    ``from . import x`` names submodules)."""
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                named = {f"{target}.{alias.name}" for alias in node.names}
                targets.update(named if named <= modules.keys() else {target, *named})
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def _floor(module: str) -> int | None:
    key = module.split(".")[1] if "." in module else "__init__"
    return next((index for index, floor in enumerate(FLOORS) if key in floor), None)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_no_import_circles() -> None:
    assert _circles(_imports(_modules())) == []


def test_every_module_has_a_floor() -> None:
    """A module on no floor would escape the arrow check below."""
    assert sorted({name for name in _modules() if _floor(name) is None}) == []


def test_lower_floors_do_not_import_higher_ones() -> None:
    graph = _imports(_modules())
    up = {(module, target) for module, targets in graph.items() for target in targets
          if None not in (_floor(module), _floor(target)) and _floor(target) > _floor(module)}
    assert up <= ARROWS_UP, sorted(up - ARROWS_UP)
