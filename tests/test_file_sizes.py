"""Each runtime file does one job: none of the package's modules is longer than :data:`MOST_LINES` (split by job, as
docs/layout.md lays out, rather than grow)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "packfree_plugin"
MOST_LINES = 450


def test_no_runtime_file_is_longer_than_the_limit() -> None:
    lengths = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
               for path in ROOT.rglob("*.py")}
    assert len(lengths) > 100
    longer = {name: lines for name, lines in lengths.items() if lines > MOST_LINES}
    assert not longer, f"split these by job (at most {MOST_LINES} lines each): {longer}"
