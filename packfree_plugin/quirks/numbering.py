"""How a model numbers the positions of a lone sample, and the one warning packfree gives about the caller's ids.

RoBERTa-style embeddings number a lone sample called without ``position_ids`` from ``padding_idx + 1``
(``2, 3, ...`` with RoBERTa's ``padding_idx = 1``); MRA, Nystromformer and YOSO from their ``position_ids`` buffer,
which starts at 2. packfree follows the caller's ids (docs/input-contract.md): a packed row whose ids restart at 0 in
every sample (``DataCollatorWithFlattening``'s and TRL's default) numbers each of these samples ``0, 1, ...``. That
is what stock gives the sample alone *with those ids*, but not what the model gives it alone without ids, nor what
its checkpoint was trained with. :func:`check_callers_ids` says so, once per model class; it stays silent for models
that number from 0 and for ids that already start where the model starts.

Which modules number this way, and by which rule, is their class's ``numbering`` quirk
(:data:`packfree_plugin.classes.CLASSES`); this module reads the start off each module
(its ``padding_idx``, its buffer) and depends on nothing of packfree but the boundaries.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..boundaries import Boundaries

__all__ = ["FROM_BUFFER", "FROM_PADDING_IDX", "Numbering", "PositionNumberingWarning", "check_callers_ids",
           "lone_sample_numbering", "quiet"]

FROM_PADDING_IDX = "padding_idx + 1"
FROM_BUFFER = "position_ids buffer"
_NUMBERED_AS = "_packfree_numbered_as"
"""Attribute :func:`mark` sets on a position module: ``(model class name, module path)``, for the warning."""


class PositionNumberingWarning(UserWarning):
    """A packed row's ``position_ids`` restart at 0, and the model numbers a lone sample from elsewhere."""


@dataclass(frozen=True)
class Numbering:
    """How a model numbers a lone sample called without ``position_ids``.

    ``start``: its first position (None: the model takes no ``position_ids``, e.g. Mamba, T5). ``origin``:
    :data:`FROM_PADDING_IDX` or :data:`FROM_BUFFER` where a module of the model numbers from elsewhere than 0
    (``module`` its path, ``cls`` its class), else empty.
    """

    start: int | None
    origin: str = ""
    module: str = ""
    cls: str = ""

    def describe(self) -> str:
        """One line: ``from 0``, ``from padding_idx + 1 = 2 (...)``, ``from 2, its position_ids buffer (...)``, or
        ``not by ids``."""
        if self.start is None:
            return "not by ids (the model takes no position_ids)"
        if not self.origin:
            return f"from {self.start}"
        where = f"{self.module or '<model>'}: {self.cls}"
        numbered = (f"from padding_idx + 1 = {self.start}" if self.origin == FROM_PADDING_IDX
                    else f"from {self.start}, its position_ids buffer")
        return f"{numbered} ({where}); packed rows need position_ids starting at {self.start}, or none"


def lone_sample_numbering(module: nn.Module, rule: str, path: str = "") -> Numbering:
    """How ``module`` (a position module numbered by the adapter ``rule``) numbers a lone sample: from
    ``module.padding_idx + 1`` (``after_padding_idx``), from its ``position_ids`` buffer's first entry
    (``position_buffer``), else from 0 (tables indexed by the position in the sample). A buffer still on the meta
    device has no values: it raises ``ValueError``."""
    if rule == "after_padding_idx":
        return Numbering(int(module.padding_idx) + 1, FROM_PADDING_IDX, path, type(module).__name__)
    if rule == "position_buffer":
        buffer = module.position_ids
        if buffer.is_meta:
            raise ValueError(f"{type(module).__name__}'s position_ids buffer is on the meta device: no values to read")
        return Numbering(int(buffer.reshape(-1)[0]), FROM_BUFFER, path, type(module).__name__)
    return Numbering(0)


def mark(module: nn.Module, model: nn.Module, path: str) -> None:
    """Record on ``module`` which model class holds it and where (what the warning names)."""
    setattr(module, _NUMBERED_AS, (type(model).__name__, path))


class _Quiet(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_quiet = _Quiet()
_WARNED: set[str] = set()
"""Model class names already warned about (once per class, not per forward or layer)."""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within ``with``, on this thread, :func:`check_callers_ids` stays silent and remembers nothing: the gate's
    proof and the leak audit pack 0-based ids on purpose (on a tiny copy of the very class a user then runs)."""
    _quiet.depth += 1
    try:
        yield
    finally:
        _quiet.depth -= 1


def _sample_firsts(position_ids: torch.Tensor, boundaries: Boundaries) -> list[int] | None:
    """The caller's id at the first token of every packed sample (padding spans left out); None if the ids do not
    lay out as the boundaries' ``[B, T]`` (one host copy of ``N`` ids)."""
    batch, seq_len = boundaries.batch_size, boundaries.seq_len
    if position_ids.shape[-1] != seq_len or position_ids.numel() not in (seq_len, batch * seq_len):
        return None
    flat = position_ids.reshape(-1, seq_len).expand(batch, seq_len).reshape(-1)
    starts = [start for start, pad in zip(boundaries.offsets[:-1], boundaries.padding) if not pad]
    return flat[torch.tensor(starts, device=flat.device)].tolist()


def check_callers_ids(module: nn.Module, rule: str, position_ids: torch.Tensor, boundaries: Boundaries) -> None:
    """Warn (:class:`PositionNumberingWarning`, once per model class) when the caller's ``position_ids`` of a packed
    row start at 0 in every sample and ``module`` numbers a lone sample from elsewhere (``rule``: its position
    adapter's). Silent for modules that number from 0, for ids that start elsewhere, and under :func:`quiet`."""
    model_class, path = getattr(module, _NUMBERED_AS, (type(module).__name__, ""))
    if _quiet.depth or model_class in _WARNED:
        return
    numbering = lone_sample_numbering(module, rule, path)
    if not numbering.start:
        return
    firsts = _sample_firsts(position_ids, boundaries)
    if not firsts or any(first != 0 for first in firsts):
        return
    _WARNED.add(model_class)
    start = numbering.start
    origin = f"padding_idx + 1 = {start}" if numbering.origin == FROM_PADDING_IDX else f"{start}, its position_ids buffer"
    warnings.warn(
        f"{model_class}: the packed position_ids restart at 0 in every sample, but {path or '<model>'} "
        f"({numbering.cls}) numbers a sample alone {start}, {start + 1}, ... (from {origin}). packfree follows your "
        "ids, so every sample is numbered 0, 1, ...: what stock gives it with those ids, not what the model gives it "
        f"alone. To number each sample as it is numbered alone, pass ids from {start}: "
        f"DataCollatorWithFlattening(position_ids_start={start}) (transformers 5.24) or "
        f"packfree_plugin.packing.PackedCollator(position_ids_start={start}); or "
        "pass no position_ids (DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True), "
        "PackedCollator(return_position_ids=False)) and packfree numbers each sample as the model does. "
        "(Said once per model class.)",
        PositionNumberingWarning, stacklevel=2)
