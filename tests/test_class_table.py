"""Everything packfree knows about a transformers class is its entry in :data:`packfree_plugin.classes.CLASSES`: no
other runtime module names a transformers class by string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[1] / "packfree_plugin"
TABLE = ROOT / "classes.py"
NOT_TRANSFORMERS_CLASSES = {"integrations/sentence_transformers.py": {"Transformer"}}
"""Strings that equal a transformers class name but name another library's class (sentence-transformers' module)."""


def _transformers_classes() -> set[str]:
    pattern = re.compile(r"^\s*class (\w+)\b", re.MULTILINE)
    return {name for path in Path(transformers.__file__).parent.rglob("*.py")
            for name in pattern.findall(path.read_text(encoding="utf-8", errors="ignore"))}


def _named_strings(tree: ast.Module) -> set[str]:
    """The module's string literals but docstrings, f-string fragments and name suffixes or prefixes."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else ():
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                skipped.add(id(statement.value))
        if isinstance(node, ast.JoinedStr):
            skipped.update(map(id, node.values))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {"endswith", "startswith", "removesuffix",
                                                                              "removeprefix"}:
            skipped.update(map(id, node.args))
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped}


def test_only_the_class_table_names_transformers_classes() -> None:
    classes = _transformers_classes()
    naming = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if path == TABLE or relative.startswith("cli/"):
            continue
        names = {text for text in _named_strings(ast.parse(path.read_text(encoding="utf-8")))
                 if re.fullmatch(r"([a-z0-9_]+\.)?[A-Z]\w*", text) and text.split(".")[-1] in classes}
        names -= NOT_TRANSFORMERS_CLASSES.get(relative, set())
        if names:
            naming[relative] = sorted(names)
    assert naming == {}, f"name these classes in packfree_plugin/classes.py, one entry each: {naming}"
