"""Real supervised fine-tuning data embedded in the package: the GSM8K test split (MIT, see LICENSE-GSM8K) and
45 captioned CC0 / public-domain images (see LICENSE-IMAGES.md).

The file is read through :mod:`importlib.resources`, so it works from a source checkout, an installed wheel
or a zip import alike, and nothing outside the package is ever read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy

__all__ = ["GSM8K_RESOURCE", "GSM8K_TEST_RECORDS", "CaptionedImage", "format_sft", "load_captioned_images",
           "load_gsm8k"]

#: Name of the embedded file inside this package.
GSM8K_RESOURCE = "gsm8k_test.jsonl"
#: Number of records in the embedded file.
GSM8K_TEST_RECORDS = 1319


def _parse(stream: IO[str], source: str, limit: int | None) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(stream, start=1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not {"question", "answer"} <= record.keys():
            raise ValueError(f"{source}:{lineno}: expected an object with 'question' and 'answer', got {line[:80]!r}")
        records.append(record)
    return records


def _open_embedded() -> IO[str]:
    return resources.files(__name__).joinpath(GSM8K_RESOURCE).open("r", encoding="utf-8")


def load_gsm8k(path: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Load GSM8K records (``{"question": str, "answer": str}``) from a JSON-lines file.

    Args:
        path: a ``.jsonl`` file in the GSM8K format; ``None`` (default) reads the test split embedded in
            this package (1,319 records).
        limit: keep only the first ``limit`` records (``None``: all).

    Raises:
        ValueError: ``limit`` is negative, or a line is not a GSM8K record.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if path is None:
        with _open_embedded() as stream:
            return _parse(stream, f"packfree_plugin/cli/data/{GSM8K_RESOURCE}", limit)
    path = Path(path)
    with path.open("r", encoding="utf-8") as stream:
        return _parse(stream, str(path), limit)


def format_sft(record: Mapping[str, Any]) -> str:
    """One training text from a GSM8K record: ``"Question: ...\\nAnswer: ..."``.

    The answer keeps GSM8K's worked solution, calculator annotations (``<<6*2=12>>``) and final
    ``#### <number>`` line, so a model trained on the text learns the full solution format.
    """
    try:
        question, answer = record["question"], record["answer"]
    except KeyError as exc:
        raise ValueError(f"record lacks {exc.args[0]!r}; keys are {sorted(record)}") from None
    return f"Question: {str(question).strip()}\nAnswer: {str(answer).strip()}"


class CaptionedImage(NamedTuple):
    """One embedded image with its text: ``pixels`` uint8 ``[H, W, 3]``."""

    name: str
    pixels: numpy.ndarray
    question: str
    answer: str


def load_captioned_images(limit: int | None = None) -> list[CaptionedImage]:
    """The 45 embedded captioned images (``images.npz`` + ``image_captions.json``), in file order."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    package = resources.files(__name__)
    records = json.loads(package.joinpath("image_captions.json").read_text(encoding="utf-8"))[:limit]
    with package.joinpath("images.npz").open("rb") as stream, numpy.load(stream) as arrays:
        return [CaptionedImage(r["image"], arrays[r["image"]], r["question"], r["answer"]) for r in records]
