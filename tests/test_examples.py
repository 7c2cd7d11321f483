"""Every recipe in examples/ runs as a user runs it, in its tiny mode (a tiny random model built from a config,
nothing downloaded): a fresh Python process, exit status 0, and the lines it prints to show that it packed and
trained. A recipe that breaks fails here, not in a user's first run.

Nothing here is skipped for a missing package: every recipe needs only ``pip install ".[integrations]"``, and
``nox -s examples`` runs this file in an environment with only that (and pytest), without the suite's conftest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # each takes 10-20 s on 2 shared CPU cores


def run_example(arguments: list[str], tmp_path: Path) -> str:
    """Run ``python arguments...`` from the repository root, offline; return stdout, failing on a non-zero exit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, *arguments], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def losses(output: str) -> list[float]:
    return [float(value) for value in re.findall(r"^step \d+: .*loss ([-+0-9.e]+)$", output, re.MULTILINE)]


def assert_trained(output: str, steps: int = 2) -> None:
    found = losses(output)
    assert len(found) == steps and all(value == value and value >= 0 for value in found), output


ONE_ROW = re.compile(r"^a batch of 4 samples: 1 row of \d+ tokens, position_ids restarting 4 times$", re.MULTILINE)


def test_trainer_flattening(tmp_path) -> None:
    output = run_example([str(EXAMPLES / "trainer_flattening.py"), "--tiny", "--output-dir", str(tmp_path / "o")],
                         tmp_path)
    assert ONE_ROW.search(output), output
    assert_trained(output)


def test_sft_trl(tmp_path) -> None:
    output = run_example([str(EXAMPLES / "sft_trl.py"), "--tiny", "--output-dir", str(tmp_path / "o")], tmp_path)
    assert ONE_ROW.search(output), output
    assert_trained(output)


def assert_scored_packed(output: str, role: str, sequences: int) -> None:
    """The recipe printed that one of ``role``'s scoring forwards ran its ``sequences`` padded rows as one packed row
    of their real tokens, fewer than the padded batch's."""
    found = re.search(rf"^{role} scoring forward: {sequences} sequences \(TRL's padded batch: {sequences} rows of "
                      rf"(\d+) tokens\) ran as 1 row of (\d+) tokens, position_ids restarting {sequences} times$",
                      output, re.MULTILINE)
    assert found, output
    assert int(found[2]) < sequences * int(found[1])


def test_dpo_trl(tmp_path) -> None:
    output = run_example([str(EXAMPLES / "dpo_trl.py"), "--tiny", "--output-dir", str(tmp_path / "o")], tmp_path)
    assert_trained(output)
    assert abs(losses(output)[0] - 0.6931) < 1e-3, "DPO's first loss is ln 2: the reference equals the policy"
    for role in ("policy", "reference"):  # 4 pairs: prompt + chosen and prompt + rejected
        assert_scored_packed(output, role, 8)


def test_grpo_trl(tmp_path) -> None:
    output = run_example([str(EXAMPLES / "grpo_trl.py"), "--tiny", "--output-dir", str(tmp_path / "o")], tmp_path)
    steps = re.findall(r"^step \d+: reward ([-0-9.e]+), loss ([-+0-9.e]+)$", output, re.MULTILINE)
    assert len(steps) == 2 and all(float(reward) <= 0 for reward, _ in steps), output
    for role in ("policy", "reference"):  # 2 prompts x 2 completions a step
        assert_scored_packed(output, role, 4)


def test_sentence_transformers(tmp_path) -> None:
    output = run_example([str(EXAMPLES / "sentence_transformers_train.py"), "--tiny",
                          "--output-dir", str(tmp_path / "o")], tmp_path)
    encoded = re.search(r"^encode: 4 texts ran as token ids \[1, \d+\], embeddings \[4, 32\]$", output, re.MULTILINE)
    assert encoded, f"the texts were not encoded in one packed row:\n{output}"
    assert_trained(output)


def test_long_context_sp_on_two_ranks(tmp_path) -> None:
    output = run_example(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(EXAMPLES / "long_context_sp.py"), "--tiny"], tmp_path)
    assert re.findall(r"^step \d+: 256 tokens over 2 ranks \(128 each\), loss [0-9.]+$", output, re.MULTILINE) \
        and len(losses(output)) == 2, output


SP_RECIPES = {"trainer": ["trainer_sp.py"], "sft": ["trainer_sp.py", "--sft"], "accelerate": ["accelerate_sp.py"]}


@pytest.mark.parametrize("recipe", list(SP_RECIPES))
def test_sequence_parallel_recipe_on_two_ranks_equals_one_process(recipe: str, tmp_path) -> None:
    """The HF Trainer, TRL's SFTTrainer (padding_free=True) and an accelerate loop with accelerate's sequence-parallel
    config: 2 ranks print the losses one process prints (the same rows, float32 after an optimizer step: 1e-5; the
    accelerate loop steps with SGD, so a gradient off by a factor moves its second loss)."""
    script, *flags = SP_RECIPES[recipe]
    found = {}
    for ranks in (2, 1):
        output_dir = ["--output-dir", str(tmp_path / f"o{ranks}")] if script == "trainer_sp.py" else []
        output = run_example(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                              str(EXAMPLES / script), "--tiny", *flags, *output_dir], tmp_path)
        assert re.search(rf"^step \d+: 4 samples in one row over {ranks} ranks?, loss", output, re.MULTILINE), output
        assert_trained(output)
        found[ranks] = losses(output)
    assert found[2] == pytest.approx(found[1], rel=1e-5)
