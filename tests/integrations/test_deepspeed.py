"""packfree_plugin.integrations.deepspeed in one process: ``UlyssesRows`` against transformers'
``DataCollatorWithFlattening`` on the same samples (the reference), and the adapter installed when DeepSpeed's
Ulysses module is imported, removed by ``unregister``. The multi-rank behaviour is tests/parallel/test_trainer_ulysses.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from packfree_plugin.integrations.deepspeed import UlyssesRows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]


def _padded(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """A padding collator (right padding, labels = inputs where real), as DataCollatorForLanguageModeling pads."""
    width = max(len(feature["input_ids"]) for feature in features)
    tokens = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for row, feature in enumerate(features):
        tokens[row, :len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        mask[row, :len(feature["input_ids"])] = 1
    return {"input_ids": tokens, "attention_mask": mask, "labels": torch.where(mask.bool(), tokens, -100)}


def _reference(sp_size: int, length: int | None = None) -> dict[str, torch.Tensor]:
    """DataCollatorWithFlattening's row, padded by hand with one sample of positions 0, 1, ... and labels -100."""
    from transformers import DataCollatorWithFlattening

    row = DataCollatorWithFlattening()([{"input_ids": sample} for sample in SAMPLES])
    size = row["input_ids"].shape[1]
    pad = (length or size + -size % sp_size) - size
    return {"input_ids": torch.cat([row["input_ids"], torch.zeros(1, pad, dtype=torch.long)], dim=1),
            "position_ids": torch.cat([row["position_ids"], torch.arange(pad)[None]], dim=1),
            "labels": torch.cat([row["labels"], torch.full((1, pad), -100)], dim=1)}


@pytest.mark.parametrize("source", ["padded", "flattened", "flash_kwargs"])
@pytest.mark.parametrize("sp_size, length", [(2, None), (4, None), (4, 16)])
def test_rows_equal_the_flattening_collator_padded(source: str, sp_size: int, length: int | None) -> None:
    from transformers import DataCollatorWithFlattening

    collator = {"padded": _padded, "flattened": DataCollatorWithFlattening(),
                "flash_kwargs": DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False,
                                                           return_seq_idx=True)}[source]
    got = UlyssesRows(collator, sp_size, length=length)([{"input_ids": sample} for sample in SAMPLES])
    expected = _reference(sp_size, length)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), (name, got[name], tensor)
    assert got["input_ids"].shape[1] % sp_size == 0


def test_rows_refuse_what_they_cannot_carry() -> None:
    def with_extra(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        batch = _padded(features)
        return {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}

    features = [{"input_ids": sample} for sample in SAMPLES]
    with pytest.raises(ValueError, match="token_type_ids"):
        UlyssesRows(with_extra, 2)(features)
    with pytest.raises(ValueError, match="does not fit length=8"):
        UlyssesRows(_padded, 2, length=8)(features)
    with pytest.raises(ValueError, match="multiple of sp_size"):
        UlyssesRows(_padded, 4, length=10)


INSTALL = """
import sys
import packfree_plugin
packfree_plugin.register()
print("imported before:", "deepspeed" in sys.modules)
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from packfree_plugin.integrations import deepspeed
print("installed:", deepspeed.installed())
packfree_plugin.unregister()
print("after unregister:", deepspeed.installed())
"""


def test_installed_when_deepspeed_is_imported_and_removed_by_unregister() -> None:
    """A fresh process: registering packfree imports no DeepSpeed; importing DeepSpeed's Ulysses module installs the
    adapter; unregister removes it."""
    done = subprocess.run([sys.executable, "-c", INSTALL], capture_output=True, text=True, timeout=240,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith(("imported", "installed", "after"))]
    assert said == ["imported before: False", "installed: True", "after unregister: False"], done.stdout
